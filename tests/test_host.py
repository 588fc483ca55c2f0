"""CPU stages that run at once share the host's cores: the executors and the profile agree."""
from __future__ import annotations

import html

import pytest
import torch
from torch import nn

import pipexplore
from pipexplore.host import sharing_cores, stage_threads
from pipexplore.widgets.explorer import explore

# Measures time (sleeps, spans, bounds in seconds): run alone, not beside other tests (scripts/test.sh).
pytestmark = pytest.mark.timing


def test_each_cpu_stage_gets_its_share_of_the_cores():
    assert stage_threads(["cpu", "cpu"], cores=2) == 1
    assert stage_threads(["cpu"] * 4, cores=16) == 4
    assert stage_threads(["cpu"] * 3, cores=2) == 1
    assert stage_threads(["cpu"], cores=16) is None  # one CPU stage: torch's own setting
    assert stage_threads(["cuda:0", "cpu"], cores=16) is None
    assert stage_threads(["cuda:0", "cuda:1"], cores=16) is None


def test_sharing_cores_restores_the_thread_count_even_on_error():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="inside"):
        with sharing_cores(1):
            assert torch.get_num_threads() == 1
            raise RuntimeError("inside")
    assert torch.get_num_threads() == before
    with sharing_cores(None):
        assert torch.get_num_threads() == before


class _ThreadsSeen(nn.Module):
    """Records the intra-op threads each forward call runs with (in every copy of the layer)."""

    seen: list[int] = []

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _ThreadsSeen.seen.append(torch.get_num_threads())
        return self.linear(x)


@pytest.mark.parametrize("executor", ["threads", "autograd"])
def test_runs_and_profiles_give_each_cpu_stage_the_same_share(executor, monkeypatch):
    monkeypatch.setattr("pipexplore.host.host_cores", lambda: 6)
    before = torch.get_num_threads()
    _ThreadsSeen.seen.clear()
    ex = explore(nn.Sequential(_ThreadsSeen(), _ThreadsSeen()), torch.randn(8, 4), devices=["cpu", "cpu"],
                 chunks=2, splits=[1], executor=executor, calibrate=False)
    assert ex.layer_table.attrs["threads"] == 3  # 6 cores, 2 stages
    assert _ThreadsSeen.seen and set(_ThreadsSeen.seen) == {3}  # every layer profiled with 3 threads
    assert torch.get_num_threads() == before
    _ThreadsSeen.seen.clear()
    ex.run()
    assert _ThreadsSeen.seen and set(_ThreadsSeen.seen) == {3}  # and run with 3, in every stage's worker
    assert torch.get_num_threads() == before


def test_profile_threads_are_recorded_and_restored():
    before = torch.get_num_threads()
    table = pipexplore.profile(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(8, 4), threads=1)
    assert table.attrs["threads"] == 1
    assert torch.get_num_threads() == before


def test_processes_are_predicted_to_share_cores_not_the_gil(monkeypatch):
    # Layers that twin threads slow to a crawl (the GIL) keep a whole host busy as threads, but a
    # process per stage keeps only its own threads busy: 2 ranks on 2 cores run side by side.
    monkeypatch.setattr("pipexplore.host.host_cores", lambda: 2)
    import importlib

    import pandas as pd

    monkeypatch.setattr(importlib.import_module("pipexplore.predict.simulator"), "host_cores", lambda: 2)

    from pipexplore import simulate
    from pipexplore.timeline import step_time

    table = pd.DataFrame({"forward": [1.0] * 4, "backward": [2.0] * 4, "output_bytes": [0.0] * 4,
                          "share_forward": [1.0] * 4, "share_backward": [1.0] * 4})
    options = dict(chunks=4, schedule="gpipe", checkpoint="never", devices=["cpu", "cpu"])
    threads = step_time(simulate(table, [2], executor="threads", **options))
    processes = step_time(simulate(table, [2], executor="processes", **options))
    serial = step_time(simulate(table, [], executor="threads", **{**options, "devices": ["cpu"]}))
    assert threads == pytest.approx(serial, rel=0.01)  # contended: no faster than one stage
    assert processes == pytest.approx(serial * (4 + 1) / (4 * 2), rel=0.01)  # (m + p - 1) / (m p) of it


def test_a_plan_whose_stages_get_other_threads_says_so_and_reprofile_times_them_again(monkeypatch):
    monkeypatch.setattr("pipexplore.host.host_cores", lambda: 4)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    ex = explore(model, torch.randn(8, 4), devices=["cpu", "cpu"], chunks=2, splits=[2])
    assert ex.layer_table.attrs["threads"] == 2 and ex.state.all_notes() == ex.notes
    ex.run()
    assert ex.plan.corrections.runs == 1
    ex.update(devices=["cpu"] * 4, splits=[1, 2, 3])  # 4 CPU stages on 4 cores: 1 thread each
    note = ex.state.all_notes()[-1]
    assert "timed with 2 intra-op thread(s)" in note and "run with 1" in note and "ex.reprofile()" in note
    assert note in html.unescape(ex.w_status.value)  # shown with the page's notes
    old = ex.layer_table
    table = ex.reprofile()
    assert table is ex.layer_table and table is not old and table.attrs["threads"] == 1
    assert ex.plan.layer_table is table and ex.plan.corrections.runs == 0  # learnt on the old table: dropped
    assert list(ex.plan.splits) == [1, 2, 3] and ex.state.all_notes() == ex.notes
    assert ex.run()["finite"]


def test_overlapping_runs_keep_their_workers_threads_and_each_thread_gets_its_count_back():
    # Two runs at once (two explorers): run A ends while run B is still starting workers. B's
    # workers still take B's share; each run's own thread gets its count back as its block ends.
    import threading

    from pipexplore.host import use_stage_threads
    from pipexplore.timeline import thread_in_this_context

    before = torch.get_num_threads()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, int] = {}

    def worker_of_b() -> None:
        use_stage_threads()
        seen["b's worker"] = torch.get_num_threads()

    def run_b() -> None:
        a_in.wait()
        with sharing_cores(1):
            b_in.set()
            a_out.wait()  # run A has ended (and restored its own thread's count) by now
            worker = thread_in_this_context(worker_of_b, name="b-worker")
            worker.start()
            worker.join()

    b = threading.Thread(target=run_b)
    b.start()
    with sharing_cores(1):
        a_in.set()
        b_in.wait()
    seen["a after"] = torch.get_num_threads()
    a_out.set()
    b.join()
    assert seen["b's worker"] == 1
    assert seen["a after"] == before
    outside = []
    plain = threading.Thread(target=lambda: (use_stage_threads(), outside.append("no block: nothing changes")))
    plain.start()
    plain.join()
    assert outside and torch.get_num_threads() == before


class _Where(nn.Module):
    """Records the thread and its intra-op threads each call runs in."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.seen: set[tuple[int, int]] = set()

    def forward(self, x):
        import threading

        self.seen.add((threading.get_ident(), torch.get_num_threads()))
        return self.linear(x)


@pytest.mark.parametrize("threads", [1, 2])
def test_layers_with_intra_op_threads_are_timed_in_a_worker_thread_as_stages_run_them(threads):
    import threading

    layer = _Where()
    table = pipexplore.profile(nn.Sequential(layer), torch.randn(4, 8), threads=threads, repeats=1, max_repeats=1,
                               calibrate=False)
    callers = {ident for ident, _ in layer.seen}
    if threads == 1:  # no parallel region: where it runs does not matter, the caller's thread times it
        assert threading.get_ident() in callers and table.attrs["timed_in"] == "this thread"
    else:
        assert threading.get_ident() not in callers and table.attrs["timed_in"] == "a worker thread"
    assert {n for _, n in layer.seen} == {threads}  # the stage's intra-op threads, in whatever thread


def test_as_stage_worker_returns_the_result_and_raises_the_error_in_the_caller():
    from pipexplore.host import as_stage_worker

    assert as_stage_worker(lambda: 41 + 1) == 42
    with pytest.raises(ZeroDivisionError):
        as_stage_worker(lambda: 1 / 0)


def test_interrupting_the_caller_of_a_stage_worker_stops_its_work_and_leaves_no_thread(ctrl_c_raises):
    import _thread
    import threading
    import time

    from pipexplore.host import as_stage_worker

    working = threading.Event()

    def long_work():
        working.set()
        for _ in range(3000):  # 30 s unless interrupted
            time.sleep(0.01)
        return "finished"

    # Ctrl+C once the work runs (not after a fixed delay, which a slow start could outlast)
    timer = threading.Thread(target=lambda: working.wait(30) and _thread.interrupt_main(), name="test-ctrl-c")
    timer.start()
    started = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        as_stage_worker(long_work)
    assert time.perf_counter() - started < 5
    assert not [t for t in threading.enumerate() if t.name == "pipexplore-stage-worker" and t.is_alive()]
