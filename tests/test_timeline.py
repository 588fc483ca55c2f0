"""Recording timelines around GPipe, metrics, Chrome traces, and prediction against measurement."""
from __future__ import annotations

import json
import threading

import pandas as pd
import pytest
import torch
from torch import nn

from models import SleepFB, unet_model
from pipexplore import GPipe
from pipexplore.timeline import (COLUMNS, active_recorder, bubble_fraction, busy_time, copy_overlap, record,
                                 step_time, throughput, to_chrome_trace)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("checkpoint,recomputed", [("always", 4), ("except_last", 3), ("never", 0)])
def test_record_gpipe_step_has_every_event(checkpoint, recomputed, device):
    pipe = GPipe(unet_model(), balance=[2, 6, 1], devices=[device] * 3, chunks=4, checkpoint=checkpoint)
    with record(run="r1") as rec:
        pipe(torch.randn(8, 6, device=device)).sum().backward()
    t = rec.timeline
    assert list(t.columns) == COLUMNS
    assert set(t["run"]) == {"r1"} and set(t["source"]) == {"measured"} and set(t["device"]) == {device}
    counts = t.groupby("phase").size().to_dict()
    assert counts["forward"] == 12 and counts["backward"] == 12
    assert counts.get("recompute", 0) == 3 * recomputed
    assert (t["end"] >= t["start"]).all()
    f = t[t.phase == "forward"].set_index(["stage", "microbatch"])
    b = t[t.phase == "backward"].set_index(["stage", "microbatch"])
    for (stage, mb), row in b.iterrows():
        assert row["start"] >= f.loc[(stage, mb), "end"]
        if stage > 0:  # a stage's forward starts after the previous stage finished that micro-batch
            assert f.loc[(stage, mb), "start"] >= f.loc[(stage - 1, mb), "end"]
    if recomputed:
        r = t[t.phase == "recompute"].set_index(["stage", "microbatch"])
        for key, row in r.iterrows():
            assert b.loc[key, "start"] >= row["end"]  # backward starts after its recomputation
    # Peak memory is what CUDA devices report, every one of them (the host's memory is not read).
    peak = t.attrs["peak_memory"]
    assert set(peak) == {f"cuda:{k}" for k in range(torch.cuda.device_count())}
    if device.startswith("cuda"):  # at least the step's parameters, held throughout
        assert peak[device] >= sum(p.numel() * p.element_size() for p in pipe.parameters()) > 0


def test_nothing_recorded_outside_the_block():
    pipe = GPipe(unet_model(), balance=[4, 5], devices=["cpu"] * 2, chunks=2)
    assert active_recorder() is None
    pipe(torch.randn(4, 6)).sum().backward()
    with record() as rec:
        assert active_recorder() is rec
    assert active_recorder() is None
    assert rec.timeline.empty and list(rec.timeline.columns) == COLUMNS


def test_record_blocks_do_not_nest():
    with record():
        with pytest.raises(RuntimeError, match="cannot be nested: this thread is already recording"):
            with record():
                pass


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_record_blocks_in_two_threads_at_once_each_get_their_own_work(device):
    pipes = {2: GPipe(unet_model(), balance=[4, 5], devices=[device] * 2, chunks=2),
             3: GPipe(unet_model(), balance=[2, 6, 1], devices=[device] * 3, chunks=4)}
    inside = threading.Barrier(2, timeout=30)
    timelines, errors = {}, []

    def step(stages):
        try:
            with record(run=stages) as rec:
                inside.wait()  # both blocks are open before either pipeline runs
                for _ in range(3):
                    pipes[stages](torch.randn(8, 6, device=device)).sum().backward()
                inside.wait()
            timelines[stages] = rec.timeline
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=step, args=(k,)) for k in pipes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    for stages, chunks in ((2, 2), (3, 4)):
        forward = timelines[stages][timelines[stages]["phase"] == "forward"]
        assert len(forward) == 3 * stages * chunks and set(forward["stage"]) == set(range(stages))
        assert set(timelines[stages]["run"]) == {stages}


def test_workers_record_into_the_block_of_the_thread_that_started_them():
    pipe = GPipe(unet_model(), balance=[4, 5], devices=["cpu"] * 2, chunks=2)
    seen = []

    def outside():
        seen.append(active_recorder())

    with record() as rec:
        other = threading.Thread(target=outside)  # a thread started by the user: not the pipeline's
        other.start()
        other.join()
        pipe(torch.randn(4, 6)).sum().backward()
    assert seen == [None]
    assert len(rec.timeline[rec.timeline["phase"] == "forward"]) == 2 * 2


def _frame(rows):
    return pd.DataFrame([(0, s, d, i, p, a, b, "predicted") for s, d, i, p, a, b in rows], columns=COLUMNS)


def test_metrics_on_a_known_timeline():
    # Two stages, two micro-batches, forward 1 s each, GPipe fill and drain (no backward).
    t = _frame([(0, "cpu", 0, "forward", 0, 1), (0, "cpu", 1, "forward", 1, 2),
                (1, "cpu", 0, "forward", 1, 2), (1, "cpu", 1, "forward", 2, 3),
                (1, "cpu", 0, "copy", 1, 1.5)])
    assert step_time(t) == 3
    assert busy_time(t, 0) == 2 and busy_time(t) == 4
    assert bubble_fraction(t) == pytest.approx(1 / 3)  # (p-1)/(m+p-1)
    per = bubble_fraction(t, per_stage=True)
    assert per.to_dict() == pytest.approx({0: 1 / 3, 1: 1 / 3})
    assert throughput(t, samples=6) == 2
    assert copy_overlap(t) == 1.0  # the copy ran while stage 1 computed on the same device
    assert bubble_fraction(t, by="device") == 0.0  # one device "cpu" was busy from 0 to 3


def test_busy_time_counts_overlaps_once_and_by_device():
    t = _frame([(0, "cuda:0", 0, "forward", 0, 2), (1, "cuda:0", 0, "forward", 1, 3),
                (2, "cuda:1", 0, "forward", 0, 1)])
    assert busy_time(t, "cuda:0", by="device") == 3
    assert bubble_fraction(t, by="device", per_stage=True).to_dict() == pytest.approx({"cuda:0": 0.0, "cuda:1": 2 / 3})
    with pytest.raises(ValueError, match="by must be 'stage' or 'device'"):
        bubble_fraction(t, by="lane")


def test_chrome_trace_written_and_parsed_back(tmp_path):
    pipe = GPipe(unet_model(), balance=[2, 7], devices=["cpu"] * 2, chunks=3)
    with record() as rec:
        pipe(torch.randn(6, 6)).sum().backward()
    path = tmp_path / "trace.json"
    to_chrome_trace(rec.timeline, str(path))
    trace = json.loads(path.read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert len(complete) == len(rec.timeline)
    first = rec.timeline.iloc[0]
    event = next(e for e in complete if e["args"]["stage"] == first.stage and e["cat"] == first.phase
                 and e["args"]["microbatch"] == first.microbatch)
    assert (event["ts"] == pytest.approx(first.start * 1e6)
            and event["dur"] == pytest.approx((first.end - first.start) * 1e6))
    assert {e["args"]["name"] for e in meta if e["name"] == "process_name"} == {"cpu"}
    assert {e["args"]["name"] for e in meta if e["name"] == "thread_name"} == {"stage 0", "stage 1"}


@pytest.mark.slow
def test_gpipe_module_records_every_micro_batch_and_serial_cpu_backward():
    # How close the measured bubble and step come to theory is timing: benchmarks/measure_predict.py.
    p, m, fwd, bwd = 3, 4, 0.01, 0.005
    model = nn.Sequential(*[SleepFB(fwd, bwd) for _ in range(p)])
    pipe = GPipe(model, balance=[1] * p, devices=["cpu"] * p, chunks=m, checkpoint="never")
    x = torch.ones(m, 1)
    pipe(x).sum().backward()  # warm-up
    with record() as rec:
        pipe(x).sum().backward()
    measured = rec.timeline
    forward = measured[measured.phase == "forward"]
    assert sorted(zip(forward["stage"], forward["microbatch"])) == [(s, i) for s in range(p) for i in range(m)]
    assert 0 < bubble_fraction(measured, phases=["forward"]) < 1
    # CPU backward through one backward() call runs serially: p*m backward spans, none overlapping.
    b = measured[measured.phase == "backward"].sort_values("start")
    assert len(b) == p * m
    assert (b["start"].to_numpy()[1:] >= b["end"].to_numpy()[:-1] - 1e-4).all()


@pytest.mark.parametrize("executor,schedule", [("threads", "1f1b"), ("threads", "zero-bubble"), ("autograd", "gpipe")])
def test_actions_are_counted_per_stage_while_the_measured_steps_run(executor, schedule):
    import time

    from pipexplore import profile
    from pipexplore.plan import Plan
    from pipexplore.executors.step import run_step
    from pipexplore.timeline import COMPUTE_PHASES, counting_actions

    model = nn.Sequential(*[SleepFB(0.002, 0.002) for _ in range(4)])
    sample = torch.randn(8, 4)
    plan = Plan(profile(model, sample), (2,), ("cpu", "cpu"), chunks=4, schedule=schedule, checkpoint="never",
                executor=executor)
    seen: list[dict[int, int]] = []
    over = threading.Event()

    def watch() -> None:  # reads the counts until the run is over, however long it takes
        while not over.is_set():
            seen.append(counter.done())
            time.sleep(0.002)

    with counting_actions() as counter:
        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            result = run_step(model, sample, plan, repeats=3)
        finally:
            over.set()
            watcher.join()
    per_step = result.timeline[result.timeline["phase"].isin(COMPUTE_PHASES)].groupby("stage").size()
    assert counter.done() == {int(s): 3 * int(n) for s, n in per_step.items()}  # 3 measured steps, no warm-up
    assert any(0 < sum(d.values()) < sum(counter.done().values()) for d in seen)  # readable mid-run
    with counting_actions() as other:  # a new block counts from zero; outside any block nothing counts
        pass
    assert other.done() == {}


def test_a_lane_of_collectives_is_no_idle_device_in_the_bubble():
    """A mesh's timeline draws its collectives on a lane of their own (``'<device> · collectives'``):
    by device, that lane is not a device that computed nothing; the step's span still counts them."""
    compute = pd.DataFrame({"stage": [0, 0, 1, 1], "device": ["H100:0", "H100:0", "H100:1", "H100:1"],
                            "phase": ["forward", "backward", "forward", "backward"],
                            "start": [0.0, 2.0, 1.0, 3.0], "end": [1.0, 4.0, 2.0, 4.0]})
    collectives = pd.DataFrame({"stage": [0, 1], "device": ["H100:0 · collectives", "H100:1 · collectives"],
                                "phase": ["collective"] * 2, "start": [3.5, 4.0], "end": [4.0, 5.0]})
    joined = pd.concat([compute, collectives], ignore_index=True)
    # busy 3 of 5 s and 2 of 5 s: (0.4 + 0.6) / 2 by device and by stage alike
    assert bubble_fraction(joined, by="device") == pytest.approx(0.5)
    assert bubble_fraction(joined, by="stage") == pytest.approx(0.5)
    assert list(bubble_fraction(joined, by="device", per_stage=True).index) == ["H100:0", "H100:1"]
