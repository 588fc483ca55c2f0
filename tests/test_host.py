"""CPU stages that run at once share the host's cores: the executors and the profile agree."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import pipexplore
from pipexplore.host import sharing_cores, stage_threads
from pipexplore.widgets.explorer import explore


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

    monkeypatch.setattr(importlib.import_module("pipexplore.simulate"), "host_cores", lambda: 2)

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
