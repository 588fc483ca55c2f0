"""The schedule grid under the timelines: a row of actions per rank, what the workers run, filled
when opened and kept with the plan; a hovered block's action linked to it in the page."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from pipexplore.plan import Plan
from pipexplore.schedules import worker_orders
from pipexplore.widgets import explore
from pipexplore.widgets import schedule_grid
from pipexplore.widgets.schedule_grid import schedule_rows


def _table(n=8):
    return pd.DataFrame({"name": [f"l{k}" for k in range(n)], "type": "Linear", "forward": np.full(n, 1e-3),
                         "backward": np.full(n, 2e-3), "output_bytes": np.full(n, 1e3)})


def test_the_rows_are_what_each_worker_runs_in_torchs_notation():
    plan = Plan(_table(), splits=(4,), chunks=2, schedule="1f1b", checkpoint="never")
    labels, rows, note = schedule_rows(plan)
    assert labels == ["rank 0: stage 0", "rank 1: stage 1"] and note == ""
    assert rows == [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]
    labels, rows, _ = schedule_rows(Plan(_table(), splits=(2, 4, 6), chunks=2, schedule="zbv", virtual_stages=2,
                                         checkpoint="never", devices=("cpu", "cpu")))
    assert labels == ["rank 0: stages 0, 3", "rank 1: stages 1, 2"]
    assert rows == [[f"{s}{k}{i}" for s, k, i in order] for order in worker_orders("zbv", 4, 2, 2)]
    assert rows[0][:4] == ["0F0", "0F1", "3F0", "3I0"]


def test_recomputed_micro_batches_show_their_recompute_before_the_backward():
    _, rows, _ = schedule_rows(Plan(_table(), splits=(4,), chunks=2, schedule="gpipe", checkpoint="except_last"))
    assert rows[0] == ["0F0", "0F1", "0B1", "0R0", "0B0"]


def test_a_large_schedule_shows_each_ranks_first_steps_and_says_so(monkeypatch):
    monkeypatch.setattr(schedule_grid, "MOST_CELLS", 10)
    _, rows, note = schedule_rows(Plan(_table(), splits=(4,), chunks=4, schedule="1f1b", checkpoint="never"))
    assert [len(row) for row in rows] == [5, 5]
    assert note == "the first 5 steps of each rank shown (16 actions in all): ex.export('schedule-csv') writes them all"


def test_the_page_fills_the_grid_when_opened_follows_the_plan_and_links_the_hovered_block():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
    ex = explore(model, torch.randn(8, 8), chunks=2, devices=["cpu", "cpu"], splits=[3], schedule="1f1b",
                 checkpoint="never", calibrate=False)
    grid, accordion = ex.schedule_grid, ex.w_schedule_grid
    assert grid.rows == [] and accordion.selected_index is None  # nothing drawn while closed
    accordion.selected_index = 0
    assert grid.rows == schedule_rows(ex.plan)[1] and grid.rows[1][:2] == ["1F0", "1B0"]
    ex.update(chunks=4)
    assert len(grid.rows[0]) == 8 and grid.rows == schedule_rows(ex.plan)[1]
    ex.update(schedule="gpipe")
    assert grid.rows[0] == ["0F0", "0F1", "0F2", "0F3", "0B3", "0B2", "0B1", "0B0"]
    accordion.selected_index = None
    assert grid.rows == []
    # the canvas's hovered action drives the grid's highlight in the page (a front-end link)
    link = ex.view.timelines._grid_link
    assert link.source == (ex.figure, "hovered") and link.target == (grid, "hover")


def test_a_csv_schedule_set_in_code_never_passes_through_another_plan(tmp_path, monkeypatch):
    from pipexplore.runs import roundtrip
    from pipexplore.schedules.csv_files import write_csv
    from pipexplore.schedules import rank_orders

    torch.manual_seed(0)
    ex = explore(nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)]), torch.randn(8, 8), chunks=2,
                 devices=["cpu", "cpu"], splits=[3], schedule="1f1b", checkpoint="never", calibrate=False)
    seen = []
    ex.state.subscribe(lambda change: seen.append(ex.plan.schedule) if change == "plan" else None)
    paths = [str(write_csv(rank_orders("1f1b", 2, 2), tmp_path / f"{name}.csv")) for name in ("a", "b")]
    for path in paths:  # (a new option list moves a dropdown to its first value: the plan must not follow)
        ex.state.update(schedule=path)
        assert ex.w_schedule.value == path and ex.plan.schedule == path
    assert set(seen) <= set(paths) and seen
    # the page's torchrun takes the file too: past the checks, to the launch
    monkeypatch.setattr(roundtrip, "launch", lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("launched")))
    with pytest.raises(RuntimeError, match="launched"):
        roundtrip.torchrun_result(ex.model, ex.sample, ex.plan, nodes=1)
