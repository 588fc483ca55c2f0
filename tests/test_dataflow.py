"""The schedule as a graph: its longest path equals the event loop wherever no device is oversubscribed."""
from __future__ import annotations

import importlib
import itertools

import numpy as np
import pandas as pd
import pytest

from pipexplore.predict.dataflow import ActionGraph, oversubscribed
from pipexplore.predict.simulator import schedule_graph, simulate

simulate_module = importlib.import_module("pipexplore.predict.simulator")
sharing_module = importlib.import_module("pipexplore.predict.sharing")  # the processor-sharing loops

KEYS = ["stage", "phase", "microbatch", "lane", "device"]


def table(n: int = 12, share: float = 0.45) -> pd.DataFrame:
    rng = np.random.default_rng(1)
    return pd.DataFrame({"forward": rng.random(n), "backward": 2 * rng.random(n), "output_bytes": 1e6 * rng.random(n),
                         "param_bytes": 10.0, "share_forward": share, "share_backward": share})


def canonical(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.sort_values(["stage", "phase", "microbatch", "start"]).reset_index(drop=True)


def both_ways(monkeypatch, layers: pd.DataFrame, **kwargs) -> tuple[pd.DataFrame, pd.DataFrame, bool]:
    """The timeline as simulate gives it, as the event loop alone gives it, and whether the
    graph's longest path gave the first."""
    longest = simulate_module._longest_path
    taken = []

    def spy(*args, **kw):
        result = longest(*args, **kw)
        taken.append(result is not None)
        return result

    monkeypatch.setattr(simulate_module, "_longest_path", spy)
    # (the graph is tried even where a device's workers could crowd it, as without the compiled loop,
    # which test_the_compiled_loop_emits_what_the_python_loop_does_bit_for_bit compares with this one)
    monkeypatch.setattr(simulate_module, "_sharing", None)
    fast = simulate(layers, [3, 6, 9], **kwargs)
    monkeypatch.setattr(simulate_module, "_longest_path", lambda *args, **kw: None)
    loop = simulate(layers, [3, 6, 9], **kwargs)
    return fast, loop, bool(taken and taken[0])


def devices_for(schedule: str, kind: str) -> list[str]:
    if schedule == "interleaved":
        return {"cuda": ["cuda:0", "cuda:1"], "cpu": ["cpu", "cpu"], "mixed": ["cpu", "cuda:0"]}[kind]
    return {"cuda": [f"cuda:{s}" for s in range(4)], "cpu": ["cpu"] * 4,
            "mixed": ["cpu", "cuda:0", "cuda:0", "cuda:1"]}[kind]


CONFIGS = [(s, e, c, d) for s, e, c, d in itertools.product(
    ["gpipe", "1f1b", "zero-bubble", "interleaved"], ["autograd", "threads", "processes"],
    ["always", "except_last", "never"], ["cuda", "cpu", "mixed"]) if e != "autograd" or s == "gpipe"]


@pytest.mark.parametrize("schedule,executor,checkpoint,devices", CONFIGS)
def test_the_graph_times_every_plan_as_the_event_loop_does(monkeypatch, schedule, executor, checkpoint, devices):
    fast, loop, taken = both_ways(monkeypatch, table(), chunks=6, schedule=schedule, checkpoint=checkpoint,
                                  devices=devices_for(schedule, devices), executor=executor, copy_cost=1e-9, batch=24)
    a, b = canonical(fast), canonical(loop)
    assert (a[KEYS].to_numpy() == b[KEYS].to_numpy()).all()
    np.testing.assert_allclose(a[["start", "end", "memory"]], b[["start", "end", "memory"]], rtol=1e-9, atol=1e-12)
    assert fast["start"].is_monotonic_increasing
    if devices == "cuda":
        assert taken  # a device per stage: no worker ever shares one with another running action


def test_a_device_whose_workers_cannot_crowd_it_is_not_checked_and_one_that_could_goes_to_the_loop(monkeypatch):
    checked = []
    real = simulate_module.oversubscribed
    monkeypatch.setattr(simulate_module, "oversubscribed", lambda *a: checked.append(1) or real(*a))
    loops = []
    sharing = simulate_module.processor_sharing
    monkeypatch.setattr(simulate_module, "processor_sharing", lambda *a, **k: loops.append(1) or sharing(*a, **k))
    simulate(table(share=0.2), [3, 6, 9], chunks=4, schedule="1f1b", devices=["cpu"] * 4)  # 4 × 0.2 of the host
    assert not checked and not loops
    simulate(table(share=0.3), [3, 6, 9], chunks=4, schedule="1f1b", devices=["cpu"] * 4)  # 4 × 0.3: could be
    assert not checked and loops == [1]


def test_stages_that_oversubscribe_their_host_are_left_to_processor_sharing(monkeypatch):
    fast, loop, taken = both_ways(monkeypatch, table(share=1.0), chunks=4, schedule="1f1b", devices=["cpu"] * 4)
    assert not taken
    pd.testing.assert_frame_equal(fast, loop)
    # and the sharing shows: the same plan with every stage on a device of its own is faster.
    alone = simulate(table(share=1.0), [3, 6, 9], chunks=4, schedule="1f1b", copy_cost=0.0,
                     devices=[f"cuda:{s}" for s in range(4)])
    assert fast["end"].max() > 1.2 * alone["end"].max()


def test_oversubscribed_reads_shares_of_actions_that_overlap_on_one_resource():
    graph = ActionGraph.build([[(0, "F", 0)], [(1, "F", 0)]], stages=2)

    def check(share, start, end, resource=(0, 0)):
        return oversubscribed(graph, np.asarray(resource), *map(np.asarray, (share, start, end)))

    assert check((0.6, 0.6), (0.0, 0.5), (1.0, 1.5))
    assert not check((0.5, 0.5), (0.0, 0.5), (1.0, 1.5))  # all of it, not more
    assert not check((0.9, 0.9), (0.0, 1.0), (1.0, 2.0))  # one ends as the other starts
    assert not check((0.9, 0.9), (0.0, 0.5), (1.0, 1.5), resource=(0, 1))  # two devices
    assert not check((0.9, 0.0), (0.0, 0.5), (1.0, 1.5))  # a sleep asks for none of it


def test_schedule_graphs_are_cached_and_every_input_sits_in_an_earlier_level():
    graph = schedule_graph("1f1b", 4, 8, executor="threads", checkpointed=7)
    assert schedule_graph("1f1b", 4, 8, executor="threads", checkpointed=7) is graph
    level = np.r_[graph.level, -1]  # the sentinel "no input" comes before everything
    for inputs in (graph.after, graph.first, graph.second):
        assert (level[inputs] < level[:-1]).all()
    assert len(graph) == 4 * 8 * 2 + 4 * 7  # F, B, and a recompute for the checkpointed micro-batches
    # each worker's actions are numbered in its queue's order, and run in it
    for q, queue in enumerate(graph.queues):
        mine = np.flatnonzero(graph.lane == q)
        assert [(int(graph.stage[n]), int(graph.micro[n])) for n in mine] == [(s, i) for s, _, i in queue]
        assert (np.diff(graph.level[mine]) > 0).all()


def test_a_schedule_that_waits_for_itself_is_refused():
    with pytest.raises(ValueError, match="deadlocks"):
        ActionGraph.build([[(0, "B", 0), (0, "F", 0)]], stages=1).level
    with pytest.raises(ValueError, match=r"waits for \(0, 'F', 0\), which no worker runs"):
        ActionGraph.build([[(0, "B", 0)]], stages=1)
    with pytest.raises(ValueError, match="twice"):
        ActionGraph.build([[(0, "F", 0)], [(0, "F", 0)]], stages=1)


def test_stages_that_leave_the_host_free_are_timed_as_a_graph(monkeypatch):
    # cpu_stages_overlap: CPU stages ask for none of the host, so none can oversubscribe it.
    fast, loop, taken = both_ways(monkeypatch, table(share=1.0), chunks=4, schedule="gpipe", devices=["cpu"] * 4,
                                  executor="threads", cpu_stages_overlap=True)
    assert taken
    np.testing.assert_allclose(canonical(fast)[["start", "end"]], canonical(loop)[["start", "end"]], rtol=1e-9)


def test_the_compiled_loop_is_built():
    # setup.py builds it (optional, so an install without a compiler still works, more slowly)
    assert simulate_module._sharing is not None, "pipexplore.predict._sharing was not built: pip install -e . with a C compiler"
    assert sharing_module._sharing is simulate_module._sharing


@pytest.mark.parametrize("schedule, executor, checkpoint, devices", CONFIGS[::2])
@pytest.mark.parametrize("gap", [0.0, 0.05])
def test_the_compiled_loop_emits_what_the_python_loop_does_bit_for_bit(monkeypatch, schedule, executor, checkpoint,
                                                                         devices, gap):
    monkeypatch.setattr(simulate_module, "_longest_path", lambda *a, **k: None)
    captured = {}
    real = simulate_module.processor_sharing

    def spy(graph, costs, gap_, resource, compiled=None):
        captured.update(graph=graph, costs=costs, resource=resource)
        return real(graph, costs, gap_, resource, compiled)

    monkeypatch.setattr(simulate_module, "processor_sharing", spy)
    simulate(table(share=0.7), [3, 6, 9], chunks=6, schedule=schedule, checkpoint=checkpoint, executor=executor,
             devices=devices_for(schedule, devices), copy_cost=1e-9, batch=24)
    args = captured["graph"], captured["costs"], gap, captured["resource"]
    c, py = real(*args, compiled=True), real(*args, compiled=False)
    assert len(c.action) == len(py.action) >= len(captured["graph"])
    for field in c._fields:
        np.testing.assert_array_equal(getattr(c, field), getattr(py, field), err_msg=field)


def test_the_compiled_loop_refuses_inputs_that_do_not_fit_and_a_deadlock():
    graph = ActionGraph.build([[(0, "F", 0)], [(1, "F", 0)]], stages=2)
    costs = sharing_module.ActionCosts(*(np.ones(2) for _ in range(5)))
    short = costs._replace(seconds=np.ones(1))
    with pytest.raises(ValueError, match="took: expected 16 bytes, got 8"):
        sharing_module.processor_sharing(graph, short, 0.0, ["host", "host"], compiled=True)
    # each worker waits for the other's action: neither loop can start anything
    stuck = ActionGraph.build([[(0, "B", 0), (0, "F", 0)], [(1, "B", 0), (1, "F", 0)]], stages=2)
    costs = sharing_module.ActionCosts(*(np.ones(4) for _ in range(5)))
    for compiled in (True, False):
        with pytest.raises(RuntimeError, match="deadlocked"):
            sharing_module.processor_sharing(stuck, costs, 0.0, ["host", "host"], compiled=compiled)


@pytest.mark.parametrize("schedule, executor, checkpoint, devices", CONFIGS[1::3])
def test_the_compiled_longest_path_times_the_graph_as_the_array_passes_do_bit_for_bit(schedule, executor, checkpoint,
                                                                                        devices):
    graph = schedule_graph(schedule, 4, 6, executor=executor, checkpointed={"always": 6, "except_last": 5,
                                                                           "never": 0}[checkpoint])
    rng = np.random.default_rng(len(graph))
    seconds, first_wait, second_wait = (rng.random(len(graph)) for _ in range(3))
    compiled = graph.times(seconds, first_wait, second_wait, 0.01)
    passes = graph.times(seconds, first_wait, second_wait, 0.01, compiled=False)
    for a, b in zip(compiled, passes, strict=True):
        np.testing.assert_array_equal(a, b)
    assert (compiled[1] > compiled[0]).all()


@pytest.mark.parametrize("schedule, stages, m, checkpointed", [
    ("1f1b", 4, 8, 3), ("zero-bubble", 4, 8, 0), ("interleaved", 4, 8, 8), ("zbv", 4, 8, 0),
    ("dualpipev", 4, 8, 2), ("gpipe", 3, 5, 5)])
def test_the_compiled_level_sort_gives_the_python_levels_and_a_graph_built_by_arrays_its_inputs(
        schedule, stages, m, checkpointed):
    from pipexplore.predict import dataflow

    graph = schedule_graph(schedule, stages, m, executor="threads", checkpointed=checkpointed, optimizer=True)
    compiled = dataflow._levels(graph.after, graph.first, graph.second)
    np.testing.assert_array_equal(compiled, dataflow._levels(graph.after, graph.first, graph.second, compiled=False))
    # the inputs, as the rules of the module's docstring name them, action by action
    actions = [a for queue in graph.queues for a in queue]
    number = {a: n for n, a in enumerate(actions)}
    split = schedule in ("zero-bubble", "zbv", "dualpipev")
    for n, (s, kind, i) in enumerate(actions):
        first, second = len(actions), len(actions)
        if kind == "F" and s > 0:
            first = number[(s - 1, "F", i)]
        elif kind == "W":
            first = number[(s, "I", i)]
        elif kind in ("B", "R", "I"):
            first = number[(s, "F", i)]
            if s < graph.stage.max():
                other = (s + 1, "B" if split else "I", i)
                second = number[other] if other in number else number[(s + 1, "I" if split else "B", i)]
        elif kind == "O":
            first = max(k for k, a in enumerate(actions) if a[0] == s and a[1] in "BIW")
        assert (graph.first[n], graph.second[n]) == (first, second), (s, kind, i)
    stuck = ActionGraph.build([[(0, "F", 1), (0, "B", 0), (0, "F", 0), (0, "B", 1)]], stages=1)
    for flag in (True, False):
        with pytest.raises(ValueError, match="deadlocks"):
            dataflow._levels(stuck.after, stuck.first, stuck.second, compiled=flag)


def test_the_compiled_longest_path_refuses_a_graph_out_of_level_order():
    n = 2
    one = np.zeros(n)
    with pytest.raises(ValueError, match="not in level order"):
        simulate_module._sharing.times(np.array([n, 1]), np.array([n, n]), np.array([n, n]), one, one, one, one,
                                       np.empty(n), np.empty(n + 1))
    with pytest.raises(ValueError, match="end: expected 24 bytes, got 16"):
        simulate_module._sharing.times(*(np.array([n, n]),) * 3, one, one, one, one, np.empty(n), np.empty(n))


def test_without_the_compiled_module_simulate_runs_the_python_loops_with_the_same_timeline():
    # An install without a C compiler has no pipexplore.predict._sharing: the same timelines, in Python.
    import json
    import subprocess
    import sys

    code = """
import importlib.abc, json, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "pipexplore.predict._sharing":
            raise ImportError("no compiled loop in this install")
sys.meta_path.insert(0, Block())
import importlib
import numpy as np, pandas as pd
simulate_module = importlib.import_module("pipexplore.predict.simulator")
assert simulate_module._sharing is None
rng = np.random.default_rng(1)
table = pd.DataFrame({"forward": rng.random(12), "backward": 2 * rng.random(12), "output_bytes": 1e6,
                      "share_forward": 0.7, "share_backward": 0.7})
frame = simulate_module.simulate(table, [3, 6, 9], chunks=6, schedule="1f1b", devices=["cpu"] * 4)
print(json.dumps([frame["start"].tolist(), frame["end"].tolist(), frame["phase"].tolist()]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    start, end, phase = json.loads(out.stdout)
    rng = np.random.default_rng(1)
    layers = pd.DataFrame({"forward": rng.random(12), "backward": 2 * rng.random(12), "output_bytes": 1e6,
                           "share_forward": 0.7, "share_backward": 0.7})
    frame = simulate(layers, [3, 6, 9], chunks=6, schedule="1f1b", devices=["cpu"] * 4)
    assert simulate_module._sharing is not None
    assert frame["start"].tolist() == start and frame["end"].tolist() == end and frame["phase"].tolist() == phase
