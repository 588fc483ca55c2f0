"""Multi-process steps with torch.distributed.pipelining: equal to one process, robust to failures."""
from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys
import threading
import types

import pytest
import torch
from torch import nn

import pipexplore
from models import plain_model
from pipexplore.executors.distributed import DistributedRunError, run_processes, shutdown_pool
from pipexplore.executors.step import run_step

from ranks import no_pool_left_behind  # noqa: F401  (every pool gone after the module)
from ranks import plan_for as _plan
from ranks import worker_children as _children

pytestmark = pytest.mark.slow





@pytest.mark.parametrize("schedule,splits,devices", [
    # the two-rank cases one after the other: they share one warm pool of rank processes
    ("gpipe", [4], ["cpu"] * 2),
    ("1f1b", [4], ["cpu"] * 2),
    ("zero-bubble", [4], ["cpu"] * 2),
    ("interleaved", [2, 4, 6], ["cpu"] * 2),  # 4 stages on 2 ranks
    ("1f1b", [2, 4, 6], ["cpu"] * 4),
])
def test_loss_and_gradients_equal_one_process(schedule, splits, devices):
    torch.manual_seed(0)
    model = plain_model()
    x, target = torch.randn(8, 6), torch.randn(8, 6)
    plan = _plan(model, x, splits, devices, schedule)
    result = run_processes(model, x, plan, target=target, loss_fn=nn.functional.mse_loss, return_grads=True,
                           warmup=0)
    reference = copy.deepcopy(model)
    loss = nn.functional.mse_loss(reference(x), target)
    loss.backward()
    assert result.loss == pytest.approx(loss.item(), rel=1e-5)
    named = dict(reference.named_parameters())
    grads = result.metrics["grads"]
    assert len(grads) == len(named)
    for key, grad in grads.items():
        torch.testing.assert_close(grad, named[key.split(".", 1)[1]].grad)
    # each rank on cores of its own where they are enough, else where the OS puts it
    from pipexplore.host import rank_cores

    blocks = [rank_cores(rank, len(devices)) for rank in range(len(devices))]
    pinned = all(blocks) and "OMP_NUM_THREADS" not in os.environ
    expected = [set(block) if pinned else os.sched_getaffinity(0) for block in blocks]
    assert [os.sched_getaffinity(pid) for pid in result.metrics["worker_pids"]] == expected
    timeline = result.timeline
    assert set(timeline["stage"]) == set(range(len(splits) + 1)) and set(timeline["source"]) == {"measured"}
    compute = timeline[timeline["phase"] != "optimizer"]
    assert (compute.groupby("phase").size() == 4 * (len(splits) + 1)).all()  # each micro-batch, each stage
    steps = timeline[timeline["phase"] == "optimizer"]  # and each stage's optimizer step, the step's last work
    assert sorted(steps["stage"]) == list(range(len(splits) + 1)) and (steps["microbatch"] == -1).all()
    assert timeline["end"].max() == steps["end"].max()
    assert timeline["start"].min() == 0.0
    # torch's runtime recomputes nothing, whatever the plan's checkpoint (except_last here): its
    # prediction neither (it had each checkpointed micro-batch's recompute, and a run taught the
    # backward its time on top: GPipe's second prediction of a 2-stage GPT-2 came out 23 % long)
    assert plan.checkpoint == "except_last" and plan.run_checkpoint == "never"
    predicted = plan.predicted
    assert set(predicted["phase"]) == set(timeline["phase"]) and "recompute" not in set(timeline["phase"])

    def order(frame):  # each stage's actions in the order they ran
        ran = frame.sort_values(["stage", "start"])
        return {s: list(zip(g["phase"], g["microbatch"])) for s, g in ran.groupby("stage")}

    assert order(predicted) == order(timeline)  # torch's order (GPipe: first micro-batch's backward first)





def test_a_rerun_reuses_the_warm_pool_with_the_users_loss_and_optimizer():
    """Closures travel by value; the optimizer factory runs in the workers (Adam's step, not the default SGD)."""
    torch.manual_seed(0)
    model, x, target = plain_model(), torch.randn(8, 6), torch.randn(8, 6)
    weight = torch.linspace(0.5, 2.0, 6)

    def weighted_loss(output, target):  # a closure over a tensor of this test
        return ((output - target) ** 2 * weight).mean()

    make_adam = functools.partial(torch.optim.Adam, lr=0.05)
    plan = _plan(model, x, [4], ["cpu"] * 2, "1f1b")
    shutdown_pool(keep_server=True)
    first = run_step(model, x, plan, target=target, loss_fn=weighted_loss, optimizer=make_adam, warmup=1)
    second = run_step(model, x, plan, target=target, loss_fn=weighted_loss, optimizer=make_adam, warmup=1)
    assert first.metrics["startup_seconds"] > 0 and second.metrics["startup_seconds"] == 0.0
    assert second.metrics["worker_pids"] == first.metrics["worker_pids"]
    assert [p.pid for p in _children()] == first.metrics["worker_pids"]

    reference = copy.deepcopy(model)
    adam = make_adam(reference.parameters())
    initial = weighted_loss(reference(x), target)  # the loss reported: the first step's, at the model's weights
    initial.backward()
    adam.step()
    expected = []  # the measured steps' (run_step's default: 3), after one, two and three Adam steps
    for _ in range(3):
        expected.append(weighted_loss(reference(x), target).item())
        adam.zero_grad()
        weighted_loss(reference(x), target).backward()
        adam.step()
    assert first.loss == pytest.approx(initial.item(), rel=1e-5) and second.loss == pytest.approx(initial.item(),
                                                                                                  rel=1e-5)
    assert first.measured_losses == second.measured_losses == pytest.approx(expected, rel=1e-5)
    # the timeline kept is one measured step's: each micro-batch's forward and backward once per stage
    assert len(first.timeline.query("phase == 'forward'")) == 4 * 2
    assert model[0].weight.grad is None  # the user's model is untouched


def test_what_cannot_be_pickled_is_named_before_any_process_starts():
    model, x = plain_model(), torch.randn(8, 6)
    plan = _plan(model, x, [4], ["cpu"] * 2, "gpipe")
    before = _children()
    model[3][0].lock = threading.Lock()
    with pytest.raises(TypeError, match=r"cannot send model to the worker processes: model\.3\.0\.lock "
                                        r"\(a _thread\.lock\) cannot be pickled .*executor='threads'"):
        run_processes(model, x, plan)
    del model[3][0].lock
    log = open(os.devnull, "w")

    def logged_loss(output, target):
        log.write("loss\n")
        return output.sum()

    with pytest.raises(TypeError, match=r"cannot send loss_fn to the worker processes: loss_fn \(closure variable "
                                        r"'log'\) \(a _io\.TextIOWrapper\)"):
        run_processes(model, x, plan, loss_fn=logged_loss)
    log.close()
    with pytest.raises(ValueError, match=r"timeout must be a positive, finite number of seconds .* not -1"):
        run_processes(model, x, plan, timeout=-1)
    assert _children() == before


def test_ranks_that_share_a_gpu_are_refused_before_any_process_starts():
    # NCCL refuses two ranks on one GPU ("Duplicate GPU detected") and gloo sends no CUDA tensors
    # between processes ("Bad address"), as an H100 showed: said up front, naming the ranks.
    model, x = plain_model(), torch.randn(8, 6)
    before = _children()
    for devices, shared in ((["cuda:0", "cuda:0"], "0 and 1 are both on cuda:0"),
                            (["cuda", "cuda:0"], "0 and 1 are both on cuda:0")):
        plan = _plan(model, x, [4], devices, "gpipe")
        with pytest.raises(ValueError, match=f"one rank a GPU, but ranks {shared} .* threads or autograd"):
            run_processes(model, x, plan)
    assert _children() == before


def test_a_class_the_workers_cannot_import_is_named(monkeypatch):
    """A module that exists only in this process (made in memory, or loaded from a path): its class
    is pickled by reference, the workers cannot import it, and the error says what to do."""
    phantom = types.ModuleType("phantom_layers")
    exec("import torch\nclass Double(torch.nn.Module):\n    def forward(self, x):\n        return 2 * x\n",
         phantom.__dict__)
    monkeypatch.setitem(sys.modules, "phantom_layers", phantom)
    model, x = plain_model(), torch.randn(8, 6)
    model.insert(2, phantom.Double())
    with pytest.raises(DistributedRunError, match=r"rank \d \(cpu\) could not load the job it was sent: "
                                                  r"ModuleNotFoundError: No module named 'phantom_layers'\. .*"
                                                  r"cloudpickle\.register_pickle_by_value\(module\)"):
        run_processes(model, x, _plan(model, x, [4], ["cpu"] * 2, "gpipe"), timeout=60)
    assert _children() == []


SCRIPT = """
import copy, json, sys
import torch
from torch import nn
import pipexplore
from pipexplore.executors.distributed import run_processes
from pipexplore.plan import Plan

print("script body ran", file=sys.stderr)


class Scale(nn.Module):  # a class of __main__: workers cannot import it, it travels by value
    def __init__(self, factor):
        super().__init__()
        self.factor = nn.Parameter(torch.tensor(factor))

    def forward(self, x):
        return torch.tanh(x) * self.factor


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 6), Scale(1.5), nn.Linear(6, 6), Scale(0.5))
x, y = torch.randn(8, 6), torch.randn(8, 6)
plan = Plan(pipexplore.profile(copy.deepcopy(model), x, repeats=1, calibrate=False), (2,), ("cpu", "cpu"),
            chunks=2, schedule="gpipe", executor="processes")
loss_fn = lambda out, t: ((out - t) ** 2).mean()
make_sgd = lambda params: torch.optim.SGD(params, lr=0.5)
result = run_processes(model, x, plan, target=y, loss_fn=loss_fn, optimizer=make_sgd, warmup=1, timeout=60)
reference = copy.deepcopy(model)
sgd = make_sgd(reference.parameters())
loss_fn(reference(x), y).backward()
sgd.step()
print(json.dumps({"processes": result.measured_losses[0], "reference": loss_fn(reference(x), y).item(),
                  "first": result.loss, "unchanged": loss_fn(model(x), y).item()}))
"""


@pytest.mark.parametrize("how", ["stdin", "file"])
def test_a_script_of_main_classes_and_lambdas_trains_in_processes(tmp_path, how):
    """``python - < script.py`` and ``python script.py`` (no __main__ guard): the body runs once."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    command = [sys.executable, "-"] if how == "stdin" else [sys.executable, str(script)]
    package_root = os.path.dirname(os.path.dirname(pipexplore.__file__))  # installed or not
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    with open(script) as stdin:
        done = subprocess.run(command, stdin=stdin, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                              env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("script body ran") == 1
    losses = json.loads(done.stdout.strip().splitlines()[-1])
    assert losses["processes"] == pytest.approx(losses["reference"], rel=1e-5)
    assert losses["processes"] != pytest.approx(losses["unchanged"], rel=1e-3)  # the optimizer stepped
    assert losses["first"] == pytest.approx(losses["unchanged"], rel=1e-5)  # the loss reported: the first step's


def test_explorer_runs_the_processes_executor_beside_threads():
    from pipexplore.widgets import explore

    ex = explore(plain_model(), torch.randn(8, 6), devices=["cpu", "cpu"], splits=[4], chunks=4, schedule="1f1b")
    ex.run()
    with pytest.raises(ValueError, match=r"timeout=5 bounds runs in worker processes \(executor='processes'\)"):
        ex.run(timeout=5)
    row = ex.run(executor="processes", timeout=60)
    assert row["executor"] == "processes" and row["schedule"] == "1f1b"
    assert ex.runs["executor"].tolist() == ["threads", "processes"]
    startup = ex.runs["startup_seconds"].tolist()  # its own column: process start-up, apart from the step
    assert startup[0] != startup[0] and startup[1] >= 0  # NaN for the in-process run
    assert "startup s" in ex.w_runs.value
    assert set(ex.timeline("measured")["stage"]) == {0, 1}


def test_a_plan_for_processes_is_predicted_with_their_costs_probed_in_the_pool_its_run_takes():
    """The first prediction of a processes plan holds what an action and a hand-over cost there
    (torch's runtime in each rank, gloo between them), probed in the warm pool of its ranks, which
    its first run then takes as it is: no start-up."""
    from pipexplore.predict.costs import Corrections
    from pipexplore.timeline import step_time
    from pipexplore.widgets import explore

    shutdown_pool(keep_server=True)
    ex = explore(plain_model(), torch.randn(8, 6), devices=["cpu", "cpu"], splits=[4], chunks=4, schedule="1f1b",
                 executor="processes")
    assert ex.state.status.text == "" and not ex.state.status.busy  # what it said while the ranks started: gone
    learnt = ex.plan.corrections
    assert {"forward", "backward", "all"} <= set(learnt.overheads["processes"])
    assert all(seconds > 0 for seconds in learnt.overheads["processes"].values()), learnt.overheads
    assert learnt.transfer("processes") > 0 and learnt.gap("processes") >= 0
    unprobed = ex.plan.with_options(corrections=Corrections())
    assert step_time(ex.plan.predicted) > step_time(unprobed.predicted)
    row = ex.run(timeout=60)
    assert row["executor"] == "processes" and row["startup_seconds"] == 0  # the pool the probe started


@pytest.mark.parametrize("schedule,splits", [("1f1b", [4]), ("interleaved", [2, 4, 6])])  # 2 stages a rank
def test_ranks_that_outnumber_the_cores_are_probed_with_stages_that_keep_them_busy(monkeypatch, schedule, splits):
    """Where the plan's ranks outnumber this host's cores (here: told it has one), the hand-over is
    probed a second time with stages that compute as long as the plan's actions, and it is the
    hand-over that reproduces that probe's step (what a woken rank waits for a core) the
    prediction uses, never less than the idle probe's median."""
    import importlib

    from pipexplore.widgets import explore

    probing = importlib.import_module("pipexplore.executors.probe")  # (the package's ``probe`` is the function)
    real, loaded = probing.loaded_transfer, []

    def spy(plan, overhead, gap, transfer, stages, chunks, repeats=3):
        loaded.append((transfer, real(plan, overhead, gap, transfer, stages, chunks, repeats)))
        return loaded[-1][1]

    monkeypatch.setattr(probing, "host_cores", lambda: 1)
    monkeypatch.setattr(probing, "loaded_transfer", spy)
    ex = explore(plain_model(), torch.randn(8, 6), devices=["cpu", "cpu"], splits=splits, chunks=4, schedule=schedule,
                 executor="processes")
    (idle, busy), = loaded
    assert 0 < idle <= busy < 0.1 and ex.plan.corrections.transfer("processes") == busy


def test_a_plan_whose_ranks_come_to_outnumber_the_cores_is_probed_again_until_a_run_teaches(monkeypatch):
    """The probe's hand-over is the idle one while the ranks have a core each and the loaded one
    once they outnumber them (here the host is told it has 2 cores, then 1): a plan that crosses
    over is probed again, once a side; after a run, what the run taught stays."""
    import importlib

    from pipexplore.widgets import explore

    probing = importlib.import_module("pipexplore.executors.probe")
    real, loaded, beside, cores = probing.loaded_transfer, [], [], [2]

    def spy(plan, overhead, gap, transfer, *args, **kwargs):
        beside.append(transfer)  # the idle hand-over the same probe measured just before
        loaded.append(real(plan, overhead, gap, transfer, *args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(probing, "host_cores", lambda: cores[0])
    monkeypatch.setattr(probing, "loaded_transfer", spy)
    ex = explore(plain_model(), torch.randn(8, 6), devices=["cpu", "cpu"], splits=[4], chunks=4, schedule="1f1b",
                 executor="processes")
    idle = ex.plan.corrections.transfer("processes")
    assert not loaded and idle > 0
    cores[0] = 1
    ex.update(chunks=2)
    # Loaded is never cheaper than the idle hand-over of its own probe (two probes' idle figures
    # differ with what else the host runs, so the first plan's is no bound).
    assert len(loaded) == 1 and ex.plan.corrections.transfer("processes") == loaded[0] >= beside[0] > 0
    cores[0] = 2
    ex.update(chunks=4)
    ex.update(chunks=2)
    assert len(loaded) == 1  # each side probed once
    ex = explore(plain_model(), torch.randn(8, 6), devices=["cpu", "cpu"], splits=[4], chunks=4, schedule="1f1b",
                 executor="processes")
    ex.run(timeout=60)
    taught = ex.plan.corrections.transfer("processes")
    cores[0] = 1
    ex.update(chunks=2)  # the ranks now outnumber the cores, but a run has taught the hand-over
    assert len(loaded) == 1 and ex.plan.corrections.transfer("processes") == taught


def test_a_mesh_whose_ranks_outnumber_the_cores_is_probed_loaded_on_as_many_ranks(monkeypatch):
    """A mesh's every rank is a process of its run: pp 2 × dp 2 on a host told it has 3 cores has
    two pipeline ranks but four processes, so where the processes probe takes it (as it takes meshes
    of tensor, context or expert ranks, which the exported script's probe does not: here told so)
    its hand-over is the loaded probe's; both probes run a pipeline of four ranks (as many
    processes as the run starts, in one pool)."""
    import importlib

    from pipexplore.widgets import explore

    probing = importlib.import_module("pipexplore.executors.probe")
    real_loaded, real_step, loaded, ranks = probing.loaded_transfer, probing._probe_step, [], []

    def spy(*args, **kwargs):
        loaded.append(real_loaded(*args, **kwargs))
        return loaded[-1]

    def step(module, plan, layers, table, devices, chunks, repeats):
        ranks.append(len(devices))
        return real_step(module, plan, layers, table, devices, chunks, repeats)

    monkeypatch.setattr(probing, "host_cores", lambda: 3)
    monkeypatch.setattr(probing, "loaded_transfer", spy)
    monkeypatch.setattr(probing, "_probe_step", step)
    monkeypatch.setattr(probing, "runs_as_script", lambda plan: False)
    ex = explore(plain_model(), torch.randn(8, 6), devices=["cpu"] * 4, chunks=4, schedule="1f1b",
                 executor="processes", mesh={"pp": 2, "dp": 2})
    assert ex.plan.num_devices == 2 and ex.plan.mesh_or_pipeline.size == 4
    assert ranks == [4, 4]  # the idle probe and the loaded one on the mesh's every rank (one pool)
    assert len(loaded) == 1 and ex.plan.corrections.transfer("processes") == loaded[0]


def test_a_torchrun_run_of_a_threads_plan_is_predicted_with_the_processes_costs(monkeypatch):
    """The torchrun script's ranks are processes: a run of a threads plan under torchrun is predicted
    with the processes executor's own costs (probed once, then kept beside the threads ones), and
    the plan's executor stays threads."""
    import pipexplore.runs.roundtrip as roundtrip
    from pipexplore.widgets import explore

    given = []

    class Stop(Exception):
        pass

    def launched(model, sample, plan, **options):
        given.append(plan)
        raise Stop

    monkeypatch.setattr(roundtrip, "torchrun_result", launched)
    ex = explore(plain_model(), torch.randn(8, 6), devices=["cpu", "cpu"], splits=[4], chunks=4, schedule="1f1b")
    assert ex.plan.executor == "threads" and "processes" not in ex.plan.corrections.overheads
    with pytest.raises(Stop):
        ex.run(executor="torchrun")
    (plan,) = given
    assert plan.executor == "processes" and plan.splits == ex.plan.splits
    assert plan.corrections.overheads["processes"]["forward"] > 0 and plan.corrections.transfer("processes") > 0
    assert plan.corrections.overheads["threads"] == ex.plan.corrections.overheads["threads"]
    assert ex.plan.executor == "threads"


def test_a_busy_layer_keeps_its_thread_computing_forward_and_backward():
    import time

    from pipexplore.executors.probe import BusyLayer

    layer = BusyLayer(0.01, 0.02)
    began = time.thread_time()
    out = layer(torch.randn(2, 1))
    forward = time.thread_time() - began
    out.sum().backward()
    backward = time.thread_time() - began - forward
    assert 0.01 <= forward < 0.1 and 0.02 <= backward < 0.1
    assert layer.linear.weight.grad is not None


def test_a_probe_that_cannot_start_ranks_leaves_the_explorer_working_and_is_not_retried(monkeypatch):
    import pipexplore.executors.distributed as distributed
    from pipexplore.widgets import explore

    tried = []

    def refused(*args, **kwargs):
        tried.append(1)
        raise DistributedRunError("rank 0 could not start: no processes here")

    monkeypatch.setattr(distributed, "run_processes", refused)
    with pytest.warns(RuntimeWarning, match=r"the processes executor's own costs were not probed.*rank 0 could not "
                                            r"start: no processes here"):
        ex = explore(plain_model(), torch.randn(8, 6), devices=["cpu", "cpu"], splits=[4], chunks=4,
                     schedule="1f1b", executor="processes")
    assert ex.plan.corrections.overhead("processes") == 0.0 and ex.plan.corrections.transfer("processes") == 0.0
    ex.update(splits=[3], chunks=2)
    assert tried == [1] and ex.plan.splits == (3,)  # tried once: the next plans are predicted without it


def test_the_status_line_says_the_ranks_start_while_a_change_to_processes_probes_them():
    from pipexplore.widgets import explore

    shutdown_pool(keep_server=True)
    ex = explore(plain_model(), torch.randn(8, 6), devices=["cpu", "cpu"], splits=[4], chunks=4, schedule="1f1b")
    said = []
    ex.state.subscribe(lambda what: said.append((ex.state.status.text, ex.state.status.busy)) if what == "status"
                       else None)
    ex.update(executor="processes")
    assert ("measuring what an action costs the processes executor: starting its 2 rank processes (once; the first "
            "run then finds them started)", True) in said
    assert ex.state.status.text == "" and not ex.state.status.busy and "processes" in ex.plan.corrections.overheads


def test_bad_plans_are_refused_before_any_process_starts():
    model, x = plain_model(), torch.randn(8, 6)
    with pytest.raises(ValueError, match=r"Schedule1F1B needs at least as many micro-batches as stages: chunks 2 < 4"):
        run_processes(model, x, _plan(model, x, [2, 4, 6], ["cpu"] * 4, "1f1b", chunks=2))
    with pytest.raises(ValueError, match="8 rows do not divide into 3 chunks"):
        run_processes(model, x, _plan(model, x, [4], ["cpu"] * 2, "gpipe", chunks=3))
    with pytest.raises(ValueError, match="repeats is the number of measured steps, a whole number from 1, got 0"):
        run_processes(model, x, _plan(model, x, [4], ["cpu"] * 2, "gpipe"), repeats=0)




def test_the_header_says_the_processes_executor_recomputes_nothing():
    from dataclasses import replace

    from pipexplore.widgets.header import plan_text

    model = plain_model()
    plan = _plan(model, torch.randn(8, 6), [4], ["cpu"] * 2, "gpipe")
    assert "· checkpoint except_last (runs never) · processes on cpu,cpu" in plan_text(plan)
    threads = replace(plan, executor="threads")
    assert "· checkpoint except_last · threads" in plan_text(threads) and threads.run_checkpoint == "except_last"
    assert "recompute" in set(threads.predicted["phase"])
    # a plan for catalogue GPUs keeps its own: what the cluster's training checkpoints, which the search weighs
    assert replace(plan, devices=("H100:0", "H100:1")).run_checkpoint == "except_last"
    # a balanced split weighs what the runs do: no recompute for processes, a recompute for threads
    from pipexplore.predict.costs import layer_times

    never = replace(plan, checkpoint="never")
    assert layer_times(plan).tolist() == layer_times(never).tolist()
    assert (layer_times(threads) > layer_times(replace(threads, checkpoint="never"))).all()
