"""The canvas timelines' scene: lanes, blocks and memory as the page receives them."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pipexplore.predict.simulator import simulate
from pipexplore.widgets.timeline_figure import PHASE_COLORS, PHASES, STAGE_COLORS, TimelineView
from pipexplore.widgets.timeline_canvas import TimelineCanvas, block_panel, blocks_of, lane_of, memory_panel


def _timeline(rows):
    return pd.DataFrame(rows, columns=["stage", "device", "microbatch", "phase", "start", "end"])


def test_lanes_are_stage_then_device_in_order_of_appearance():
    frame = _timeline([(1, "cuda:1", 0, "forward", 0.2, 0.3), (0, "cuda:0", 0, "forward", 0.0, 0.1),
                       (1, "cpu", 0, "copy", 0.1, 0.2), (0, "cuda:0", 0, "backward", 0.5, 0.7),
                       (1, "cuda:1", 0, "backward", 0.3, 0.5)])
    pairs, lane = lane_of(frame)
    expected = frame[["stage", "device"]].drop_duplicates().sort_values("stage", kind="stable")
    assert pairs == [tuple(p) for p in expected.itertuples(index=False)] == [(0, "cuda:0"), (1, "cuda:1"), (1, "cpu")]
    assert lane.tolist() == [1, 0, 2, 0, 1]


def test_a_block_panel_reads_back_as_the_timeline_in_lane_then_start_order():
    frame = _timeline([(1, "cpu", 0, "forward", 0.2, 0.3), (0, "cpu", 1, "forward", 0.1, 0.2),
                       (0, "cpu", 0, "forward", 0.0, 0.1), (1, "cpu", 0, "backward", 0.3, 0.5),
                       (0, "cpu", 0, "mystery", 0.6, 0.7)])
    other = frame.assign(end=frame["start"] + 0.05)  # another timeline of the same plan
    panel = block_panel(frame, PHASES, title="t", stage_layers=[(0, 3), (4, 7)], other=other, other_name="other")
    assert panel["lanes"] == ["stage 0 · cpu", "stage 1 · cpu"] and panel["offsets"] == [0, 3, 5]
    blocks = blocks_of(panel)
    assert blocks["stage"].tolist() == [0, 0, 0, 1, 1]
    assert blocks["start"].tolist() == pytest.approx([0.0, 100.0, 600.0, 200.0, 300.0], abs=1e-4)  # ms
    assert blocks["end"].tolist() == pytest.approx([100.0, 200.0, 700.0, 300.0, 500.0], abs=1e-4)
    assert blocks["phase"].tolist() == [0, 0, len(PHASES), 0, PHASES.index("backward")]  # unknown: after all
    assert blocks["other"].tolist() == pytest.approx([50.0] * 5, abs=1e-4)
    assert blocks["microbatch"].tolist() == [0, 1, 0, 0, 0] and blocks["lane"].tolist() == [0, 0, 0, 1, 1]
    # 11 bytes a block: two float32 times, a phase byte, a 2-byte micro-batch (lanes as bounds)
    assert sum(len(panel[k]) for k in ("start", "end", "phase", "micro")) == 11 * 5 and panel["micro_bytes"] == 2
    many = frame.assign(microbatch=[70_000, 1, 2, 3, 4])  # more micro-batches than 2 bytes count
    wide = block_panel(many, PHASES)
    assert wide["micro_bytes"] == 4 and blocks_of(wide)["microbatch"].tolist() == [2, 1, 4, 70_000, 3]
    empty = block_panel(None, PHASES, empty="no run yet")
    assert empty["lanes"] == [] and len(blocks_of(empty)) == 0 and empty["empty"] == "no run yet"


def test_a_memory_panel_holds_each_stages_steps_peaks_and_cap_in_its_unit():
    table = pd.DataFrame({"forward": [1e-3] * 4, "backward": [2e-3] * 4, "output_bytes": 4096.0})
    predicted = simulate(table, [2], chunks=4, batch=4)
    view = TimelineView(predicted, samples=4, memory_cap=1.5 * 4096)
    memory, peaks = view._memory(), view.peaks()
    panel = memory_panel(memory, peaks, STAGE_COLORS, scale=1024.0, unit="KiB", cap=1.5 * 4096)
    assert [s["stage"] for s in panel["series"]] == [0, 1]
    for line in panel["series"]:
        rows = memory[memory["stage"] == line["stage"]]
        assert np.frombuffer(line["v"], np.float32).tolist() == pytest.approx((rows["bytes"] / 1024).tolist())
    assert [p["v"] for p in panel["peaks"]] == pytest.approx((peaks["bytes"] / 1024).tolist())
    assert [p["over"] for p in panel["peaks"]] == peaks["over_cap"].tolist()
    assert panel["cap"] == pytest.approx(6.0) and panel["y_max"] >= 6.0


def test_the_view_redraws_only_the_panels_whose_timeline_changed():
    table = pd.DataFrame({"forward": [1e-3] * 4, "backward": [2e-3] * 4, "output_bytes": 0.0})
    first, second = (simulate(table, [s], chunks=4, batch=4) for s in (1, 3))
    view = TimelineView(first, samples=4)
    assert isinstance(view.figure, TimelineCanvas)
    kept = view._panels[2]
    view.show(predicted=second, splits=[3])
    assert view._panels[2] is kept  # the measured panel (empty) was not rebuilt
    scene = view.figure.scene
    assert scene["splits"] == "3" and scene["phases"][0] == {"name": "forward", "color": PHASE_COLORS["forward"],
                                                             "letter": "F"}
    assert len(blocks_of(scene["panels"][0])) == len(second)
