"""Profiler traces of a torch.distributed.pipelining run read as a timeline (issue 24, item 3):
real traces from a 2-rank gloo run on CPU, and small hand-written ones for GPU kernels and errors."""
from __future__ import annotations

import gzip
import json
import pathlib

import pytest

from pipexplore.runs.kineto import Label, TraceFileError, find_traces, parse_label, read_traces
from pipexplore.timeline import COLUMNS, step_time

# One run of 2 ranks, three schedules: ScheduleGPipe over two profiled steps (ProfilerStep#N), Schedule1F1B,
# and ScheduleInterleaved1F1B with two stages a rank. Each writes <out>/<schedule>/trace_rank{r}.json.
_SCRIPT = '''
import os, sys
import torch, torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.profiler import ProfilerActivity, profile

out = sys.argv[1]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
CHUNKS, WIDTH = 4, 16
x, t = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1)), torch.zeros(8, WIDTH)
for name, cls, per_rank, steps in [("gpipe", ScheduleGPipe, 1, 2), ("1f1b", Schedule1F1B, 1, 1),
                                   ("interleaved", ScheduleInterleaved1F1B, 2, 1)]:
    n = world * per_rank
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()) for _ in range(n)]
    mine = [rank + world * k for k in range(per_rank)]
    stages = [PipelineStage(layers[s], s, n, torch.device("cpu")) for s in mine]
    schedule = cls(stages if per_rank > 1 else stages[0], n_microbatches=CHUNKS,
                   loss_fn=torch.nn.functional.mse_loss)
    optimizer = torch.optim.SGD([p for s in mine for p in layers[s].parameters()], lr=0.01)

    def step():
        optimizer.zero_grad()
        kwargs = dict(target=t, losses=[]) if n - 1 in mine else {}
        schedule.step(x, **kwargs) if 0 in mine else schedule.step(**kwargs)
        optimizer.step()

    step()  # warm-up, not profiled
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
            if steps > 1:
                prof.step()
    os.makedirs(os.path.join(out, name), exist_ok=True)
    prof.export_chrome_trace(os.path.join(out, name, f"trace_rank{rank}.json"))
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def torch_traces(tmp_path_factory):
    """The traces of one run of 2 ranks (gloo, CPU), as torchrun runs the script, for all three schedules."""
    from ranks import run_ranks

    root = tmp_path_factory.mktemp("kineto")
    script = root / "profile_pipeline.py"
    script.write_text(_SCRIPT)
    run_ranks(script, [root / "out"])
    return root / "out"


def _check_order(timeline, stages, microbatches):
    compute = timeline[timeline["phase"].isin(["forward", "backward"])]
    got = set(zip(compute["stage"], compute["phase"], compute["microbatch"]))
    assert got == {(s, p, m) for s in stages for p in ("forward", "backward") for m in microbatches}
    assert len(compute) == len(got)  # each once
    for rank, rows in timeline[timeline["phase"].isin(["forward", "backward", "optimizer"])].groupby("rank"):
        rows = rows.sort_values("start")
        assert (rows["start"].to_numpy()[1:] >= rows["end"].to_numpy()[:-1]).all(), f"rank {rank} overlaps"
    at = {(s, p, m): (a, b) for s, p, m, a, b in compute[["stage", "phase", "microbatch", "start", "end"]]
          .itertuples(index=False)}
    for s in stages:
        for m in microbatches:
            assert at[s, "forward", m][1] <= at[s, "backward", m][0]
            if s + 1 in stages:  # the next stage's forward needs this one's; this one's backward, the next's
                assert at[s + 1, "forward", m][1] > at[s, "forward", m][0]
                assert at[s, "backward", m][1] > at[s + 1, "backward", m][0]


@pytest.mark.slow
def test_a_gpipe_trace_loads_every_forward_and_backward(torch_traces):
    timeline = read_traces(torch_traces / "gpipe")
    assert list(timeline.columns[:len(COLUMNS)]) == COLUMNS
    assert set(timeline["source"]) == {"measured"} and set(timeline["device"]) == {"cpu"}
    assert set(timeline["run"]) == {"gpipe"} and set(timeline["clock"]) == {"cpu"}
    _check_order(timeline, [0, 1], range(4))
    optimizer = timeline[timeline["phase"] == "optimizer"]
    assert sorted(optimizer["stage"]) == [0, 1] and set(optimizer["microbatch"]) == {-1}
    assert timeline["start"].min() == 0.0 and step_time(timeline) > 0
    attrs = timeline.attrs
    assert attrs["world"] == 2 and attrs["stages_from_rank"] and attrs["labels"] == ["Forward i / Backward i"]
    assert len(attrs["steps"]) == 2 and attrs["step"] == max(attrs["steps"])  # ProfilerStep#N: the last one
    assert set(attrs["rank_start"]) == {0, 1} and "clocks agree" in attrs["clock"]
    earlier = read_traces(torch_traces / "gpipe", step=min(attrs["steps"]))
    assert earlier.attrs["origin"] < attrs["origin"]
    _check_order(earlier, [0, 1], range(4))


@pytest.mark.slow
def test_a_1f1b_trace_is_refused_for_want_of_labels(torch_traces):
    with pytest.raises(TraceFileError, match="Schedule1F1B labels nothing per micro-batch.*nothing was guessed"):
        read_traces(torch_traces / "1f1b")


@pytest.mark.slow
def test_an_interleaved_1f1b_trace_loads_actions_sends_and_receives(torch_traces):
    timeline = read_traces(torch_traces / "interleaved")
    _check_order(timeline, [0, 1, 2, 3], range(4))
    assert not timeline.attrs["stages_from_rank"]
    assert dict(timeline.groupby("stage")["rank"].unique().map(list)) == {0: [0], 1: [1], 2: [0], 3: [1]}
    assert set(timeline.loc[timeline["phase"] == "send", "microbatch"]) == set(range(4))
    assert set(timeline.loc[timeline["phase"] == "recv", "stage"]) == {0, 1, 2, 3}
    last = timeline[timeline["stage"] == 3].set_index(["phase", "microbatch"])["start"]
    assert last["backward", 0] < last["forward", 3]  # one forward, one backward: not fill-drain
    shifted = read_traces(torch_traces / "interleaved", offsets={1: 1.0})  # rank 1's clock a second behind
    key = ["stage", "phase", "microbatch"]
    before, after = (t[t["phase"].isin(["forward", "backward"])].set_index(key) for t in (timeline, shifted))
    moved = after["start"] - before["start"]
    moved -= moved[before["rank"] == 0].iloc[0]  # the origin may move with it
    assert moved[before["rank"] == 1].round(9).eq(1.0).all() and moved[before["rank"] == 0].round(9).eq(0.0).all()
    assert shifted.attrs["rank_start"][1] - shifted.attrs["rank_start"][0] == pytest.approx(
        timeline.attrs["rank_start"][1] - timeline.attrs["rank_start"][0] + 1.0)


# -- hand-written traces ---------------------------------------------------------------------------------

def _x(name, ts, dur, cat="user_annotation", pid=100, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _write(directory, rank, events, world=2, name=None, info=True, **top):
    data = {"schemaVersion": 1, "traceEvents": events, **top}
    if info:
        data["distributedInfo"] = {"backend": "nccl", "rank": rank, "world_size": world}
    path = pathlib.Path(directory) / (name or f"trace_rank{rank}.json")
    path.write_text(json.dumps(data))
    return path


def _gpu_rank0():
    return [
        _x("PP:0F0", 100, 100), _x("PP:0B0", 300, 150),
        _x("cudaLaunchKernel", 120, 5, cat="cuda_runtime", correlation=1),
        _x("cudaLaunchKernel", 150, 5, cat="cuda_runtime", correlation=2),
        _x("cudaLaunchKernel", 320, 5, cat="cuda_runtime", tid=2, correlation=3),  # autograd's thread
        _x("cudaLaunchKernel", 260, 5, cat="cuda_runtime", correlation=4),  # between actions
        _x("gemm", 130, 10, cat="kernel", pid=0, tid=7, correlation=1, device=0),
        _x("gemm", 160, 90, cat="kernel", pid=0, tid=7, correlation=2, device=0),  # past its label's end
        _x("gemm_bwd", 330, 170, cat="kernel", pid=0, tid=7, correlation=3, device=0),
        _x("stray", 270, 10, cat="kernel", pid=0, tid=7, correlation=4, device=0),
        _x("Memcpy DtoD", 252, 8, cat="gpu_memcpy", pid=0, tid=8, device=0),  # linked by its flow only
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 9, "pid": 100, "tid": 1, "ts": 180},
        {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": 9, "pid": 0, "tid": 8, "ts": 252, "bp": "e"},
        _x("PP:0F0", 125, 130, cat="gpu_user_annotation", pid=0, tid=7),  # the label on the GPU: no action
    ]


def test_gpu_kernels_are_attributed_to_the_action_that_launched_them(tmp_path):
    _write(tmp_path, 0, _gpu_rank0(), deviceProperties=[{"id": 0, "name": "NVIDIA H100"}])
    _write(tmp_path, 1, [_x("PP:1F0", 150, 100, pid=200), _x("PP:1B0", 260, 30, pid=200)],
           baseTimeNanoseconds=0)
    timeline = read_traces(tmp_path, run="gpu")
    rows = timeline.set_index(["rank", "phase"])
    forward, backward = rows.loc[(0, "forward")], rows.loc[(0, "backward")]
    assert (forward["device"], forward["clock"]) == ("cuda:0", "gpu")
    # kernels of correlation 1, 2 and the memcpy (flow 9), launched inside PP:0F0
    assert forward["start"] == pytest.approx(30e-6) and forward["end"] == pytest.approx(160e-6)
    assert forward["cpu_start"] == 0.0 and forward["cpu_end"] == pytest.approx(100e-6)
    assert backward["start"] == pytest.approx(230e-6) and backward["end"] == pytest.approx(400e-6)
    assert timeline.attrs["unattributed_kernels"] == {0: 1, 1: 0}
    assert timeline.attrs["device_names"] == {0: {0: "NVIDIA H100"}}
    assert (rows.loc[(1, "forward"), "device"], rows.loc[(1, "forward"), "clock"]) == ("cpu", "cpu")
    assert len(timeline) == 4 and set(timeline["run"]) == {"gpu"}


def test_clocks_and_base_time(tmp_path):
    """``ts`` counts from ``baseTimeNanoseconds`` where a trace has it: ranks land on one axis."""
    base = 1_700_000_000_000_000_000
    _write(tmp_path, 0, [_x("Forward 0", 1_000, 10), _x("Backward 0", 1_100, 10)], baseTimeNanoseconds=base)
    _write(tmp_path, 1, [_x("Forward 0", base / 1000 + 1_020, 10), _x("Backward 0", base / 1000 + 1_050, 10)])
    timeline = read_traces(tmp_path).set_index(["stage", "phase"])
    assert timeline.loc[(1, "forward"), "start"] == pytest.approx(20e-6, abs=1e-9)
    assert timeline.loc[(0, "backward"), "start"] == pytest.approx(100e-6, abs=1e-9)
    assert timeline.attrs["rank_start"][0] == pytest.approx(1_700_000_000.001)


@pytest.mark.parametrize("name,expected", [
    ("PP:2F0", [Label(2, "forward", 0)]), ("PP:0B13", [Label(0, "backward", 13)]),
    ("PP:1I3", [Label(1, "input_grad", 3)]), ("PP:1W3", [Label(1, "weight_grad", 3)]),
    ("PP:3SEND_F1", [Label(3, "send", 1)]), ("PP:3RECV_B2", [Label(3, "recv", 2)]),
    ("PP:0UNSHARD", []), ("PP:0RESHARD", []), ("PP:1REDUCE_GRAD", []),
    ("PP:(0F1;1B0)OVERLAP_F_B", [Label(0, "forward", 1), Label(1, "backward", 0)]),
    ("Forward 4", [Label(None, "forward", 4)]), ("Backward 0", [Label(None, "backward", 0)]),
    ("Optimizer.step#SGD.step", [Label(None, "optimizer", -1)]),
    ("aten::mm", None), ("Forward", None), ("PP:2X0", None), ("ProfilerStep#3", None),
])
def test_the_label_parser(name, expected):
    assert parse_label(name) == expected


def test_a_label_without_its_microbatch_is_refused():
    with pytest.raises(TraceFileError, match="without its micro-batch"):
        parse_label("PP:2F")


def test_overlapped_actions_share_their_span(tmp_path):
    _write(tmp_path, 0, [_x("PP:0F0", 0, 10), _x("PP:(0F1;0B0)OVERLAP_F_B", 20, 30), _x("PP:0B1", 60, 5),
                         _x("cudaLaunchKernel", 25, 2, cat="cuda_runtime", correlation=5),
                         _x("k", 30, 40, cat="kernel", pid=0, tid=7, correlation=5, device=1)], world=1)
    timeline = read_traces(tmp_path).set_index(["phase", "microbatch"])
    assert timeline.loc[("forward", 1), "start"] == timeline.loc[("backward", 0), "start"] == 30e-6
    assert timeline.loc[("forward", 1), "end"] == timeline.loc[("backward", 0), "end"] == 70e-6
    assert timeline.loc[("forward", 1), "device"] == "cuda:1" and timeline.loc[("forward", 0), "clock"] == "cpu"
    assert timeline.loc[("forward", 1), "overlapped"] and not timeline.loc[("forward", 0), "overlapped"]


def test_repeated_labels_are_steps_and_stages_can_be_mapped(tmp_path):
    events = [_x(f"{p} {m}", t0 + 10 * k, 5) for t0 in (0, 1000)
              for k, (p, m) in enumerate([("Forward", 0), ("Forward", 1), ("Backward", 0), ("Backward", 1)])]
    _write(tmp_path, 0, events, world=1)
    last, first = read_traces(tmp_path, stages={0: 3}), read_traces(tmp_path, step=0)
    assert last.attrs["steps"] == [0, 1] and last.attrs["step"] == 1 and len(last) == len(first) == 4
    assert set(last["stage"]) == {3} and set(first["stage"]) == {0}
    assert last.attrs["origin"] == pytest.approx(first.attrs["origin"] + 1e-3)
    with pytest.raises(TraceFileError, match=r"step 5 is not in every trace.*\[0, 1\]"):
        read_traces(tmp_path, step=5)


def test_gzip_traces_ranks_from_file_names_and_other_json_ignored(tmp_path):
    for rank in (0, 1):
        data = {"traceEvents": [_x("Forward 0", 10 * rank, 5), _x("Backward 0", 50 - 10 * rank, 5)]}
        with gzip.open(tmp_path / f"host_rank{rank}.pt.trace.json.gz", "wt") as f:
            json.dump(data, f)
    (tmp_path / "plan.json").write_text(json.dumps({"splits": [3], "schedule": "gpipe"}))
    assert [p.name for p in find_traces(tmp_path)] == ["host_rank0.pt.trace.json.gz", "host_rank1.pt.trace.json.gz"]
    timeline = read_traces(tmp_path)
    assert sorted(timeline["stage"]) == [0, 0, 1, 1] and timeline.attrs["world"] == 2


def test_errors_name_what_is_wrong(tmp_path):
    with pytest.raises(TraceFileError, match=r"no profiler traces in .*\*\.json and \*\.json\.gz"):
        read_traces(tmp_path)
    with pytest.raises(TraceFileError, match="is not a directory"):
        read_traces(tmp_path / "nowhere")
    good = [_x("Forward 0", 0, 5), _x("Backward 0", 10, 5)]
    _write(tmp_path, 0, good)
    with pytest.raises(TraceFileError, match=r"lacks the traces of rank\(s\) \[1\] of a world of 2"):
        read_traces(tmp_path)
    broken = _write(tmp_path, 1, good)
    broken.write_text(broken.read_text()[:60])  # truncated
    with pytest.raises(TraceFileError, match=f"cannot read the trace {broken}"):
        read_traces(tmp_path)
    _write(tmp_path, 1, [_x("aten::mm", 0, 5)])
    with pytest.raises(TraceFileError, match=f"no per-micro-batch labels in {tmp_path / 'trace_rank1.json'}"):
        read_traces(tmp_path)
    _write(tmp_path, 1, good, name="again_rank1.json")
    with pytest.raises(TraceFileError, match="two traces of rank 1"):
        read_traces(tmp_path)


def test_a_trace_that_says_no_rank_is_refused(tmp_path):
    for name in ("a.json", "b.json"):
        _write(tmp_path, 0, [_x("Forward 0", 0, 5)], name=name, info=False)
    with pytest.raises(TraceFileError, match="a.json says no rank"):
        read_traces(tmp_path)


def test_a_window_that_cut_the_step_is_said(tmp_path):
    _write(tmp_path, 0, [_x("Forward 0", 0, 5), _x("Forward 1", 10, 5), _x("Backward 0", 20, 5)], world=1)
    with pytest.warns(UserWarning, match=r"stage 0 has forwards of micro-batches \[0, 1\] but backwards of \[0\]"):
        read_traces(tmp_path)


def test_a_malformed_event_names_its_file(tmp_path):
    path = _write(tmp_path, 0, [_x("Forward 0", "soon", 5)], world=1)
    with pytest.raises(TraceFileError, match=f"{path} is no trace this reader understands"):
        read_traces(tmp_path)
