"""A run under torchrun, brought back (issue 24, items 1, 2, 4 and 6): the exported script records
with ``--record DIR`` under two torchrun node agents on this machine (c10d rendezvous on
loopback, gloo, 2 ranks each), ``explorer.load_run`` reads it whole and ``explorer.run(
executor='torchrun', nodes=2)`` does both; a rank that dies is named, a directory missing a
rank, of another plan or truncated is refused and nothing of it is kept. The 1F1B run has two
agents of two ranks, the interleaved run and a cancel two agents of one rank: each rank is an
interpreter importing torch's pipelining (~5 s of CPU); a CSV schedule with the profiler on beside
the recorder runs on two ranks forked here (``pipexplore.runs.forked``). The test of a rank that
dies (what torchrun itself reports) runs a script of its own that imports nothing; where the agents
meet is watched in the 1F1B run's launch."""
from __future__ import annotations

import html
import importlib
import json
import math
import os
import pathlib
import re
import shutil
import socket
import sys
import time

import pytest
import torch

import pipexplore
from pipexplore import timeline as tl
from pipexplore.devices import planned_devices
from pipexplore.host import host_cores
from pipexplore.predict.basis import MEASURED_ERROR, TORCHRUN_HERE_ERROR
from pipexplore.predict.costs import Corrections
from pipexplore.runs.launch import TorchrunError, launch, printed_losses, torchrun_failures
from pipexplore.runs.load import RunDirectoryError, read_run
from pipexplore.runs.record import CLOCK_SHIFT_ENV

HOOKS = '''
import torch
from torch import nn


def build_model():
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [nn.Linear(64, 64), nn.GELU()]
    return nn.Sequential(*layers)


def get_batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(32, 64, generator=generator), torch.randn(32, 64, generator=generator)


def loss_fn(output, target):
    return ((output - target) ** 2).mean()


def build_optimizer(parameters):
    return torch.optim.Adam(parameters, lr=1e-3)
'''
INTERLEAVED = [4, 8, 12]  # 4 stages: 2 a rank on 2 ranks


@pytest.fixture(scope="module")
def hooks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hooks")
    (folder / "roundtrip_hooks.py").write_text(HOOKS)
    sys.path.insert(0, str(folder))
    try:
        yield importlib.import_module("roundtrip_hooks"), folder
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("roundtrip_hooks", None)


def _explorer(module, schedule="1f1b", devices="cpu,cpu,cpu,cpu", **options):
    inputs, target = module.get_batch()
    return pipexplore.explore(module.build_model(), inputs, target=target, loss_fn=module.loss_fn,
                              optimizer=module.build_optimizer, chunks=4, schedule=schedule,
                              devices=devices, executor="processes", profile_repeats=1, **options)


def _shared_threads(ranks: int) -> int:
    """A local rank's intra-op threads: the caller's OMP_NUM_THREADS, or this machine's cores shared."""
    return int(os.environ.get("OMP_NUM_THREADS") or max(1, host_cores() // ranks))


def _rank_cores(ranks: int) -> list:
    """The cores each local rank of ``ranks`` keeps to: its own block where they are enough (and the
    caller did not set OMP_NUM_THREADS), else every core of this machine."""
    from pipexplore.host import rank_cores

    blocks = [rank_cores(rank, ranks) for rank in range(ranks)]
    every = sorted(os.sched_getaffinity(0))
    return blocks if all(blocks) and "PIPEXPLORE_RANK_CORES" not in os.environ else [every] * ranks


def test_ranks_share_the_cores_in_blocks_of_their_own_or_not_at_all():
    from pipexplore.host import rank_cores

    assert [rank_cores(rank, 2, cores=[0, 1, 2, 3]) for rank in range(2)] == [[0, 1], [2, 3]]
    assert [rank_cores(rank, 3, cores=[4, 5, 6, 7]) for rank in range(3)] == [[4], [5], [6]]
    assert rank_cores(0, 4, cores=[0, 1]) is None and rank_cores(2, 2, cores=[0, 1]) is None


def _unsplit_loss(module) -> float:
    inputs, target = module.get_batch()
    with torch.no_grad():
        return float(module.loss_fn(module.build_model()(inputs), target))


@pytest.fixture(scope="module")
def recorded(hooks, tmp_path_factory):
    """A 1F1B run of the exported script under two node agents, as a cluster user makes it."""
    module, folder = hooks
    explorer = _explorer(module)
    work = tmp_path_factory.mktemp("cluster")
    script = work / "train_pipeline.py"
    script.write_text(explorer.export("torchrun", hooks="roundtrip_hooks", steps=4))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]))
    with pytest.MonkeyPatch.context() as patch:  # the rendezvous store the launch holds, watched
        stores = _watch_stores(patch)
        outcome = launch(script, nodes=2, nproc_per_node=2, args=["--record", str(work / "run")], env=env,
                         timeout=300)
    return explorer, work / "run", outcome, stores


def _watch_stores(patch) -> list:
    """The rendezvous stores launches hold from now on (``launch.rendezvous_store`` spied on), each
    checked when it is made: no other process can bind its port."""
    import pipexplore.runs.launch as launching

    original, held = launching.rendezvous_store, []

    def spy(timeout):
        store = original(timeout)
        with socket.socket() as other:
            with pytest.raises(OSError):
                other.bind(("127.0.0.1", store.port))
        held.append(store)
        return store

    patch.setattr(launching, "rendezvous_store", spy)
    return held


def _every_action(timeline, stages, chunks):
    compute = timeline[timeline["phase"].isin(["forward", "backward"])]
    found = set(zip(compute["stage"], compute["microbatch"], compute["phase"]))
    return {(s, m, p) for s in range(stages) for m in range(chunks) for p in ("forward", "backward")} - found


def _in_place(timeline):
    """Every forward starts after the previous stage's forward of its micro-batch ended, and every
    backward after the next stage's backward (a clock off by more than that would break it)."""
    spans = {(s, m, p): (a, b) for s, m, p, a, b in
             timeline[["stage", "microbatch", "phase", "start", "end"]].itertuples(index=False)}
    slack = 2e-3  # the clock alignment's residual on a busy 2-core machine
    late = [(s, m, p) for (s, m, p), (a, _) in spans.items() if p == "forward" and (s - 1, m, p) in spans
            and a < spans[(s - 1, m, p)][1] - slack]
    late += [(s, m, p) for (s, m, p), (a, _) in spans.items() if p == "backward" and (s + 1, m, p) in spans
             and a < spans[(s + 1, m, p)][1] - slack]
    return late


@pytest.mark.slow
def test_a_1f1b_run_under_two_node_agents_loads_as_a_run(recorded, hooks):
    explorer, directory, outcome, _ = recorded
    row = explorer.load_run(directory)
    assert row["executor"] == "torchrun" and row["nodes"] == 2 and row["ranks"] == 4 and row["hosts"]
    assert explorer.runs.iloc[-1]["executor"] == "torchrun"
    timeline = explorer.timeline("measured")
    assert not _every_action(timeline, 4, 4)
    assert {"send", "recv", "optimizer"} <= set(timeline["phase"])
    assert not _in_place(timeline)
    printed = printed_losses(outcome.stdout)
    assert row["loss"] == pytest.approx(printed[0], abs=1e-6)  # what the script printed (6 decimals)
    assert row["loss"] == pytest.approx(_unsplit_loss(hooks[0]), rel=1e-5)
    assert row["measured_losses"] == pytest.approx([printed[k] for k in (1, 2, 3)], abs=1e-6)
    assert math.isfinite(row["prediction_error"]) and row["predicted_step_time"] > 0
    assert len(explorer.residuals()) >= 32
    assert explorer.plan.corrections.runs == 1  # the cost model learnt from it
    plan = json.loads((directory / "plan.json").read_text())
    assert plan["optimizer"] == "Adam" and plan["nodes"] == 2 and plan["world"] == 4  # the hooks' optimizer
    assert plan["splits"] == list(explorer.plan.splits) and plan["schedule"] == "1f1b" and plan["chunks"] == 4
    assert read_run(directory).rank_table()["threads"].tolist() == [_shared_threads(4)] * 4
    assert read_run(directory).rank_table()["cores"].tolist() == _rank_cores(4)


@pytest.mark.slow
def test_explorer_runs_interleaved_through_torchrun_with_a_shifted_clock(hooks, monkeypatch):
    """Run step on "torchrun, 2 nodes" (ex.run(executor='torchrun', nodes=2) in the background,
    a rank each, two stages a rank; two ranks a node: the recorded 1F1B run above): rank 1's clock
    runs 5 s ahead (injected); its offset is measured and its events land in place."""
    explorer = _explorer(hooks[0], "interleaved", splits=INTERLEAVED, devices="cpu,cpu")
    monkeypatch.setenv(CLOCK_SHIFT_ENV, "1=5.0")
    before = explorer.plan
    assert [value for _, value in explorer.w_run_on.options] == ["", "1", "2"]
    explorer.w_run_on.value = "2"
    explorer.w_run.click()
    explorer.state.runner._thread.join(300)
    assert not explorer.state.runner.running and len(explorer.runs) == 1, explorer.state.notes
    row = explorer.runs.iloc[-1]
    assert row["executor"] == "torchrun" and row["schedule"] == "interleaved" and row["ranks"] == 2
    assert row["nodes"] == 2
    result = explorer.state.log.result_of(row["run"])
    ranks = result.metrics["rank_table"]
    assert ranks.loc[1, "offset_start"] == pytest.approx(5.0, abs=5e-3)
    assert ranks.loc[1, "offset_end"] == pytest.approx(5.0, abs=5e-3)
    timeline = result.timeline
    assert not _every_action(timeline, 4, 4)
    assert timeline["end"].max() < 2.0 and not _in_place(timeline)
    assert set(timeline.loc[timeline["rank"] == 1, "stage"]) == {1, 3}
    assert row["loss"] == pytest.approx(result.metrics["printed_losses"][0], abs=1e-6)
    assert row["loss"] == pytest.approx(_unsplit_loss(hooks[0]), rel=1e-5)
    assert math.isfinite(row["prediction_error"])
    # beside it, what its benchmark measured of the exported script's ranks run here, not of in-process runs
    assert row["prediction_basis"] == "measured here"
    assert row["benchmark_error"] == TORCHRUN_HERE_ERROR["measured here"][0] != MEASURED_ERROR["measured here"][0]
    assert explorer.plan == before and explorer.plan.executor == "processes"  # the plan stays


@pytest.fixture(scope="module")
def csv_run(hooks, tmp_path_factory):
    """A 1F1B schedule written as a CSV, run by the exported script on two ranks forked here with
    torchrun's environment (``launch_forked``: what is tested is the script's record, not the
    agents) with ``--record`` and, beside it, torch's profiler (``--profile``): the CSV runs through
    torch's runtime schedule, which labels each action in the trace. Then the CSV is deleted, as on
    another machine, where an explorer of its own loads the run."""
    from pipexplore.runs.forked import launch_forked
    from pipexplore.schedules.csv_files import write_csv
    from pipexplore.schedules import rank_orders

    module, folder = hooks
    work = tmp_path_factory.mktemp("csv")
    path = pathlib.Path(write_csv(rank_orders("1f1b", 2, 4), work / "ours.csv"))
    script = work / "train_pipeline.py"
    script.write_text(_explorer(module, schedule=str(path), devices="cpu,cpu").export(
        "torchrun", hooks="roundtrip_hooks", steps=3))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]))
    launch_forked(script, ranks=2, env=env, timeout=300,
                  args=["--record", str(work / "run"), "--profile", str(work / "traces")])
    text = path.read_text()
    path.unlink()
    return work, text


@pytest.mark.slow
def test_a_run_of_a_csv_schedule_holds_the_schedule_it_ran(hooks, csv_run):
    """The recorded run keeps the CSV's text: loaded where the file is not, its plan runs the
    schedule the run ran (written into the run directory)."""
    work, text = csv_run
    module = hooks[0]
    explorer = _explorer(module, devices="cpu,cpu")
    row = explorer.load_run(work / "run")
    ran = explorer.state.log.result_of(row["run"]).plan
    assert ran.schedule == str(work / "run" / "schedule.csv")
    assert (work / "run" / "schedule.csv").read_text() == text
    assert row["loss"] == pytest.approx(_unsplit_loss(module), rel=1e-5) and math.isfinite(row["prediction_error"])
    # two ranks on this machine share its cores (torchrun itself would give an agent's one rank all of them)
    ranks = explorer.state.log.result_of(row["run"]).metrics["rank_table"]
    assert ranks["threads"].tolist() == [_shared_threads(2)] * 2
    # each on cores of its own (the launcher's PIPEXPLORE_RANK_CORES, kept to by the exported script)
    assert ranks["cores"].tolist() == _rank_cores(2)


@pytest.mark.slow
def test_the_exported_script_traces_with_the_profiler_beside_the_recorder(hooks, csv_run):
    """--record and --profile in one run: both load, with the same actions; the recorder's span of
    each action lies inside the profiler's label of it (which also covers the wait for its input)."""
    work, _ = csv_run
    assert sorted(p.name for p in (work / "traces").iterdir()) == [f"trace_rank{r}.json" for r in range(2)]
    recorded = read_run(work / "run").steps[-1]
    explorer = _explorer(hooks[0], devices="cpu,cpu")
    row = explorer.load_run(work / "traces")
    assert row["executor"] == "torchrun"
    traced = explorer.state.log.result_of(row["run"]).timeline
    key = ["stage", "phase", "microbatch"]
    spans = [t[t["phase"].isin(["forward", "backward"])].set_index(key) for t in (recorded, traced)]
    assert sorted(spans[0].index) == sorted(spans[1].index) and len(spans[0]) == 2 * 4 * 2
    ours, theirs = ((s["end"] - s["start"]).sort_index() for s in spans)
    assert (ours <= theirs + 50e-6).all(), (ours - theirs)[ours > theirs + 50e-6]  # of one step, not two


def _copy(directory, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(directory, target)
    return target


def _edit(path, change):
    payload = json.loads(path.read_text())
    change(payload)
    path.write_text(json.dumps(payload))


@pytest.mark.slow
def test_a_known_shift_in_a_rank_file_lands_in_place(recorded, tmp_path):
    explorer, directory, *_ = recorded
    original = read_run(directory)
    copy = _copy(directory, tmp_path)

    def shift(payload, measured=True):
        # A clock 3 s ahead reads 3 s more at every event (its events are kept from its origin) ...
        payload["clock"]["origin_ns"] += 3_000_000_000
        if measured:  # ... and its offset to rank 0, measured at the start and the end, is 3 s more
            payload["clock"]["offset_start"] += 3.0
            payload["clock"]["offset_end"] += 3.0

    _edit(copy / "rank-2.json", shift)
    moved = read_run(copy)
    for a, b in zip(original.steps, moved.steps):
        assert (a["start"] - b["start"]).abs().max() < 1e-9
    _edit(copy / "rank-2.json", lambda payload: shift(payload, measured=False))  # offsets not applied: off
    off = read_run(copy).steps[0]
    assert off.loc[off["rank"] == 2, "start"].min() > 2.9


@pytest.mark.slow
def test_a_run_on_catalogued_gpus_teaches_plans_for_them_and_not_this_machines(recorded, hooks, tmp_path):
    """The same run, its ranks' files saying they ran on H100s: it loads as a run on planned H100s,
    and what it teaches is kept for H100 plans (a plan of the same shape on H100s now predicts it),
    while this machine's predictions stay as they were."""
    _, directory, *_ = recorded
    copy = _copy(directory, tmp_path)
    for rank in range(4):
        _edit(copy / f"rank-{rank}.json", lambda payload, r=rank: payload.update(
            device=f"cuda:{r % 2}", device_name="NVIDIA H100 80GB HBM3", host=f"gpu-node-{r // 2}"))
    _edit(copy / "plan.json", lambda payload: payload.update(checkpoint="always"))  # as a script for H100s applies
    explorer = _explorer(hooks[0])
    before = tl.step_time(explorer.plan.predict())
    row = explorer.load_run(copy)
    result = explorer.state.log.result_of(row["run"])
    assert result.plan.devices[:4] == ("H100:0", "H100:1", "H100:2", "H100:3") and result.plan.gpus_per_node == 2
    assert result.plan.device_kind == "H100" and explorer.plan.device_kind is None
    assert result.plan.checkpoint == result.plan.run_checkpoint == "always"  # predicted as it ran
    learnt = explorer.plan.corrections
    assert learnt.runs == 0 and learnt.kinds["H100"].runs == 1  # kept apart from this machine's
    assert tl.step_time(explorer.plan.predict()) == before  # this machine's plans are predicted as before
    on_h100 = explorer.plan.with_options(devices=planned_devices(["H100"] * 4, 2), gpus_per_node=2)
    untaught = on_h100.with_options(corrections=Corrections())
    measured = row["step_time"]
    assert abs(tl.step_time(on_h100.predict()) / measured - 1) < abs(tl.step_time(untaught.predict()) / measured - 1)
    # and the run as it was, on CPUs, loaded by an explorer planned on H100s: a run of this machine's
    # devices, which teaches no H100 plan
    module = hooks[0]
    inputs, target = module.get_batch()
    planned = pipexplore.explore(module.build_model(), inputs, target=target, loss_fn=module.loss_fn,
                                 optimizer=module.build_optimizer, chunks=4, schedule="1f1b",
                                 devices=["H100"] * 4, gpus_per_node=2)
    row = planned.load_run(directory)
    assert planned.state.log.result_of(row["run"]).plan.devices[:4] == ("cpu",) * 4
    assert planned.state.log.result_of(row["run"]).plan.checkpoint == "never"  # exported for here: none applied
    assert "H100" not in planned.plan.corrections.kinds and planned.plan.corrections.runs == 1
    # GPUs of this machine (every rank on this host, as the page's own torchrun runs them) are this
    # machine's: the run teaches its plans, not the H100 plans
    for rank in range(4):
        _edit(copy / f"rank-{rank}.json", lambda payload: payload.update(host=socket.gethostname()))
    explorer = _explorer(hooks[0])
    row = explorer.load_run(copy)
    assert explorer.state.log.result_of(row["run"]).plan.device_kind is None
    assert explorer.plan.corrections.runs == 1 and not explorer.plan.corrections.kinds


@pytest.mark.parametrize("ranks, words", [
    ([("cuda", "NVIDIA H800 PCIe")] * 4, r"its GPUs \(NVIDIA H800 PCIe\) are not in the catalogue: register a "
                                         r"DeviceSpec of them \(pipexplore.devices.register_device\)"),
    ([("cuda", "NVIDIA H100 80GB HBM3")] * 2 + [("cuda", "NVIDIA A100-SXM4-80GB")] * 2,
     r"its ranks ran on devices of different kinds \(A100-80GB, H100\)"),
    ([("cuda", "")] * 4, r"its ranks did not record their GPUs' names, so their kind is unknown"),
    ([("cpu", "")] * 4, r"its ranks ran on other hosts' CPUs \(gpu-node-0, gpu-node-1\), not this machine's"),
])
def test_a_run_on_devices_no_kind_names_teaches_nothing(recorded, hooks, tmp_path, ranks, words):
    """A run on other hosts whose devices are not one catalogued kind (GPUs the catalogue does not
    know, mixed kinds, unnamed GPUs, other machines' CPUs) loads as a run but corrects no
    prediction: taught to this machine's plans it would give them another machine's speed."""
    _, directory, *_ = recorded
    copy = _copy(directory, tmp_path)
    for rank, (device, name) in enumerate(ranks):
        _edit(copy / f"rank-{rank}.json", lambda payload, r=rank, d=device, n=name: payload.update(
            device=f"cuda:{r % 2}" if d == "cuda" else "cpu", device_name=n or None, host=f"gpu-node-{r // 2}"))
    explorer = _explorer(hooks[0])
    before = tl.step_time(explorer.plan.predict())
    row = explorer.load_run(copy)
    assert re.search(words, row["untaught"]) and row["step_time"] > 0
    assert explorer.plan.corrections.runs == 0 and not explorer.plan.corrections.kinds
    assert tl.step_time(explorer.plan.predict()) == before
    assert re.search("it teaches the predictions nothing: " + words, html.unescape(explorer.w_status.value))
    assert explorer.runs["run"].tolist() == [row["run"]]  # kept as a run all the same


def _drop_a_backward(payload):
    events = payload["steps"][0]["events"]
    events.remove(next(e for e in events if e[1:3] == [2, "backward"]))


@pytest.mark.slow
@pytest.mark.parametrize("damage, words", [
    (lambda d: (d / "rank-3.json").unlink(), "lacks rank-3.json"),
    (lambda d: (d / "plan.json").unlink(), "no plan.json"),
    (lambda d: (d / "rank-1.json").write_text((d / "rank-1.json").read_text()[:500]), "rank-1.json .* truncated"),
    (lambda d: _edit(d / "rank-2.json", lambda p: p["plan"].update(schedule="gpipe")),
     "rank-2.json is from another plan.*schedule 'gpipe' there, '1f1b' in plan.json"),
    (lambda d: _edit(d / "rank-0.json", lambda p: p.update(run_id="0123456789ab")), "another run of the same plan"),
    (lambda d: _edit(d / "rank-1.json", _drop_a_backward), "rank-1.json lacks stage 1's backward of micro-batch 2"),
    (lambda d: _edit(d / "rank-1.json", lambda p: p.update(version=99)), "version 99"),
])
def test_a_damaged_run_directory_is_refused_whole(recorded, tmp_path, damage, words):
    explorer, directory, *_ = recorded
    copy = _copy(directory, tmp_path)
    damage(copy)
    rows, plan, corrections = len(explorer.runs), explorer.plan, explorer.plan.corrections
    with pytest.raises(RunDirectoryError, match=words):
        explorer.load_run(copy)
    assert len(explorer.runs) == rows and explorer.plan == plan and explorer.plan.corrections is corrections


@pytest.mark.slow
def test_a_run_of_another_model_is_refused(recorded, tmp_path):
    _, directory, *_ = recorded
    other = pipexplore.explore(torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]),
                               torch.randn(32, 64), chunks=4, profile_repeats=1)
    with pytest.raises(RunDirectoryError, match="another model"):
        other.load_run(directory)
    assert other.runs.empty


DIES = """import os, sys, time
if os.environ["RANK"] == "1":
    sys.exit(3)  # a rank that dies
time.sleep(300)  # the others wait for it (as the exported script's ranks would, at their first send)
"""


@pytest.mark.slow
def test_a_rank_that_dies_is_named_with_its_host_and_exit_code(tmp_path, monkeypatch):
    """Whatever the script, a rank's death is reported by its agent: the rank, its host and exit code
    named, the other node's agent and rank stopped once the grace for their own reports is over
    (1 s here: this script's other rank waits on nothing that would fail it). A script of its own:
    each rank of the exported one would spend 4 s of CPU importing torch's pipelining first."""
    import pipexplore.runs.launch as launching

    monkeypatch.setattr(launching, "FAILURE_GRACE", 1.0)
    script = tmp_path / "train_pipeline.py"
    script.write_text(DIES)
    with pytest.raises(TorchrunError, match=r"rank 1 on host \S+ exited with code 3") as caught:
        launch(script, nodes=2, nproc_per_node=1, timeout=300)
    assert (caught.value.rank, caught.value.exitcode) == (1, 3) and caught.value.host
    assert not _ours_running(tmp_path)


@pytest.mark.slow
def test_the_agents_meet_at_a_store_held_here_from_the_moment_its_port_is_chosen(recorded):
    """The rendezvous store is hosted by the launcher on a port it holds from the moment it is
    chosen (an agent hosting it would bind a port chosen seconds before, which another process may
    take meanwhile: the agents then waited on a socket that was not a store until the timeout);
    both agents met there."""
    store, = recorded[3]
    assert store.check([f"torch.rendezvous.pipexplore-{store.port}"])  # the agents' rendezvous state, here


def _ours_running(marker) -> list[int]:
    """Processes whose command line names ``marker`` (none of ours may outlive a run)."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if str(marker) in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


@pytest.mark.slow
def test_cancel_stops_every_agent_and_rank(hooks):
    explorer = _explorer(hooks[0], devices="cpu,cpu")  # 2 node agents of one rank
    thread = explorer.run_async("torchrun", nodes=2)
    deadline = time.monotonic() + 60
    while "torchrun:" not in explorer.state.status.text and time.monotonic() < deadline:
        time.sleep(0.05)
    while not (folder := _run_folder()) and time.monotonic() < deadline:  # the agents are up
        time.sleep(0.1)  # (a fixed wait of 3 s was too short on a loaded machine)
    time.sleep(1)
    assert folder and _ours_running(folder)
    assert explorer.cancel(timeout=60)
    assert not thread.is_alive() and explorer.runs.empty
    assert "cancelled" in explorer.state.status.text
    assert not _ours_running(folder)  # anywhere on the machine, whatever its parent now


def _run_folder():
    """The temporary folder of this process's torchrun run (its agents name it), once they run:
    another test's run in another worker has its own."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            found = re.search(r"\S*pipexplore-torchrun-[^/\s]+", " ".join(child.cmdline()))
        except psutil.Error:
            continue
        if found:
            return found.group(0)
    return None


def test_torchrun_failure_report_is_read():
    report = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train_pipeline.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-25_21:01:00
  host      : node-b
  rank      : 2 (local_rank: 0)
  exitcode  : -15 (pid: 17913)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 17913
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-25_21:01:00
  host      : node-b
  rank      : 3 (local_rank: 1)
  exitcode  : 3 (pid: 17916)
  error_file: <N/A>
============================================================"""
    assert [(f["rank"], f["host"], f["exitcode"]) for f in torchrun_failures(report)] == [
        (2, "node-b", -15), (3, "node-b", 3)]


def test_run_on_torchrun_checks_its_arguments(hooks):
    explorer = _explorer(hooks[0])
    with pytest.raises(ValueError, match="divides the plan's 4 ranks"):
        explorer.run(executor="torchrun", nodes=3)
    assert explorer.runs.empty
    from pipexplore.runs.roundtrip import torchrun_result

    inputs, _ = hooks[0].get_batch()  # a traced model's inputs may be a tuple or a dict; an nn.Sequential's not
    with pytest.raises(ValueError, match="an nn.Sequential takes one tensor as its input, not a tuple"):
        torchrun_result(explorer.model, (inputs, inputs), explorer.plan, nodes=2)
    with pytest.raises(ValueError, match="7 rows do not divide into 4 chunks"):
        torchrun_result(explorer.model, inputs[:7], explorer.plan, nodes=2)


def test_the_exported_script_records_on_request(hooks):
    script = _explorer(hooks[0]).export("torchrun", hooks="roundtrip_hooks", steps=3)
    assert "--record" in script and "from pipexplore.runs.record import RankRecorder" in script
    assert 'getattr(hooks, "build_optimizer", None)' in script
    compile(script, "train_pipeline.py", "exec")
    # A plan on this machine's CPUs runs its ranks there, GPUs or not; a plan for GPUs takes one a
    # local rank, and refuses ranks beyond the node's GPUs rather than failing in CUDA.
    assert "DEVICE = 'cpu'" in script
    module = hooks[0]
    inputs, target = module.get_batch()
    gpus = pipexplore.explore(module.build_model(), inputs, target=target, loss_fn=module.loss_fn, chunks=4,
                              devices=["H100"] * 4).export("torchrun", hooks="roundtrip_hooks")
    assert "DEVICE = 'cuda'" in gpus and "but this node has {gpus} GPU(s)" in gpus
    with pytest.raises(ValueError, match="device is 'cuda' or 'cpu', got 'tpu'"):
        from pipexplore.export.torchrun import torchrun_script

        torchrun_script(_explorer(hooks[0]).layer_table, [1], hooks="roundtrip_hooks", chunks=4, device="tpu")


def test_loading_a_missing_directory_says_so(hooks, tmp_path):
    explorer = _explorer(hooks[0])
    with pytest.raises(FileNotFoundError, match="no run directory"):
        explorer.load_run(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RunDirectoryError, match="no plan.json"):
        explorer.load_run(empty)


def test_a_directory_of_profiler_traces_goes_to_the_trace_reader(hooks, tmp_path):
    """No recorded run, torch.profiler traces instead: pipexplore.runs.kineto reads them."""
    for rank in range(2):
        events = [{"ph": "X", "cat": "user_annotation", "name": f"{name} {mb}", "pid": 100 + rank, "tid": 1,
                   "ts": 1_000 + 100 * k + 10 * rank, "dur": 40, "args": {}}
                  for k, (name, mb) in enumerate([("Forward", 0), ("Forward", 1), ("Backward", 0), ("Backward", 1)])]
        (tmp_path / f"trace_rank{rank}.json").write_text(json.dumps(
            {"schemaVersion": 1, "traceEvents": events,
             "distributedInfo": {"backend": "gloo", "rank": rank, "world_size": 2}}))
    explorer = _explorer(hooks[0])
    row = explorer.load_run(tmp_path)
    assert row["executor"] == "torchrun" and len(explorer.runs) == 1
    timeline = explorer.timeline("measured")
    assert set(zip(timeline["stage"], timeline["phase"])) >= {(0, "forward"), (1, "backward")}


def test_the_clock_offset_follows_a_drift_and_keeps_the_better_estimate():
    from pipexplore.runs.load import offset_model

    drifting = {"at_start": 0.0, "at_end": 10.0, "offset_start": 1.0, "offset_end": 1.01, "rtt_start": 1e-4,
                "rtt_end": 2e-4}
    assert offset_model(drifting) == pytest.approx((1.0, 1e-3, 0.0, 1e-4))  # 10 ms over 10 s: followed
    noisy = dict(drifting, offset_end=1.0 + 4e-4, rtt_start=2e-3)  # within the start's round trip: the end's
    assert offset_model(noisy) == pytest.approx((1.0 + 4e-4, 0.0, 10.0, 1e-4))
