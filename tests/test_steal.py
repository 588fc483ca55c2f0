"""What the hypervisor took of the host's CPU time while a run was measured (Linux's steal time):
read from the kernel's counts, kept with each run, and said on the page where it was noted."""
from __future__ import annotations

import math
import time
import warnings

import torch
from torch import nn

import pipexplore.executors.base as base
from pipexplore.host import StealMeter, cpu_ticks
from pipexplore.widgets.explorer import explore
from pipexplore.widgets.header import STEAL_NOTED
from pipexplore.widgets.run_log import run_summary
from pipexplore.widgets.runs_view import runs_html


def _stat(path, user, system, idle, steal):
    """A ``/proc/stat`` as Linux writes it: the ``cpu`` line (ten fields), then one per core."""
    path.write_text(f"cpu  {user} 0 {system} {idle} 7 0 3 {steal} 11 0\n"
                    f"cpu0 {user} 0 {system} {idle} 7 0 3 {steal} 11 0\nintr 12345 0 0\n")


def test_the_kernels_counts_are_read_steal_and_the_sum_of_the_first_eight(tmp_path):
    stat = tmp_path / "stat"
    _stat(stat, user=100, system=20, idle=500, steal=30)
    assert cpu_ticks(str(stat)) == (30, 100 + 0 + 20 + 500 + 7 + 0 + 3 + 30)  # guest (11) is inside user's
    assert cpu_ticks(str(tmp_path / "none")) is None
    (tmp_path / "bad").write_text("cpu 1 2 x\n")
    assert cpu_ticks(str(tmp_path / "bad")) is None
    (tmp_path / "old").write_text("cpu 1 2 3 4\n")  # a kernel that counts no steal
    assert cpu_ticks(str(tmp_path / "old")) is None


def test_the_meter_gives_the_stolen_share_of_the_ticks_since_its_start(tmp_path):
    stat = tmp_path / "stat"
    _stat(stat, user=100, system=20, idle=500, steal=30)
    meter = StealMeter(str(stat))
    assert math.isnan(meter.share())  # no tick yet
    _stat(stat, user=110, system=25, idle=500, steal=31)  # 16 ticks: too few to share out
    assert math.isnan(meter.share())
    _stat(stat, user=160, system=30, idle=510, steal=50)  # 60 + 10 + 10 + 20 = 100 ticks, 20 stolen
    assert meter.share() == 0.2
    assert math.isnan(StealMeter(str(tmp_path / "none")).share())
    if cpu_ticks() is not None:  # this machine's own counts (Linux): a share once enough ticks passed
        here, deadline = StealMeter(), time.monotonic() + 5.0
        while math.isnan(here.share()) and time.monotonic() < deadline:
            sum(range(200_000))
        assert 0.0 <= here.share() <= 1.0


class _Busy(StealMeter):
    """A meter whose machine lent a fifth of its CPU time to other guests."""

    def share(self) -> float:
        return 0.2


def _explorer():
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(4)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return explore(model, torch.randn(16, 32), chunks=2, devices=["cpu", "cpu"])


def test_a_run_keeps_what_was_stolen_while_it_was_measured_and_the_page_says_so(monkeypatch):
    ex = _explorer()
    quiet = ex.run()
    assert math.isnan(quiet["host_steal"]) or 0.0 <= quiet["host_steal"] <= 1.0
    assert "other guests" not in ex.w_header.value or quiet["host_steal"] >= STEAL_NOTED
    monkeypatch.setattr(base, "StealMeter", _Busy)
    busy = ex.run()
    assert busy["host_steal"] == 0.2 and list(ex.runs["host_steal"])[-1] == 0.2
    said = "other guests on this machine held 20 % of its CPU time while it was measured"
    assert said in ex.w_header.value and said in run_summary(dict(busy))
    table = runs_html(ex.runs)
    assert "other guests&#x27; CPU %" in table or "other guests' CPU %" in table
    # a table whose runs were all quiet leaves the column out
    assert "CPU %" not in runs_html(ex.runs.assign(host_steal=[0.0, 0.01]))
