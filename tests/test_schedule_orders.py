"""Every schedule's order per rank equals torch's own (torch.distributed.pipelining 2.13).

``actions()`` is compared, rank by rank, with the compute actions of torch's
``_schedule_visualizer.get_schedule_ops`` (its ``pipeline_order`` without the idle steps) for 2, 4
and 8 ranks and several micro-batch counts. Where torch's listing and what torch runs differ, the
test follows what torch runs, read from the schedule's own ``_step_microbatches`` on a recording
stage: in torch 2.13, ``Schedule1F1B._get_pipeline_order`` numbers the last rank's forwards from 1
(it lists ``F1 … Fm``, and ``Fm`` does not exist) while its ``_step_microbatches`` runs ``F0 …
F(m−1)``. DualPipeV's ``OVERLAP_F_B`` pairs are compared as their two sub-actions, forward then
backward, the order torch runs them in without a custom overlap function.
"""
from __future__ import annotations

import functools
from typing import Optional
from unittest import mock

import pytest

from pipexplore import schedules
from pipexplore.schedules import actions, check_schedule, rank_orders, stage_ranks, worker_orders



def _torch_schedules():
    """torch's pipelining schedules, imported by the tests that compare with them (not at collection,
    where every worker of a parallel run would import them: ~1.5 s of CPU each)."""
    from torch.distributed.pipelining import schedules

    return schedules

RANKS = (2, 4, 8)
MICROBATCHES = (1, 2, 3, 4, 6, 8, 12, 16)


@functools.lru_cache(maxsize=None)
def _torch_outcome(schedule: str, ranks: int, m: int, v: int) -> tuple[Optional[list[list[str]]], Optional[Exception]]:
    """What :func:`_torch_compute` gives, or the error it raises, worked out once per case (torch's
    visualiser mocks a stage per rank: ~30 ms a case, asked twice by most tests)."""
    try:
        return _torch_compute(schedule, ranks, m, v), None
    except (ValueError, AssertionError) as exc:
        return None, exc


def _torch_compute(schedule: str, ranks: int, m: int, v: int) -> list[list[str]]:
    """torch's get_schedule_ops for our schedule, compute actions only, overlapped pairs unrolled."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    cls = getattr(_torch_schedules(), schedules.TORCH_CLASSES[schedule])
    ops = get_schedule_ops(cls, ranks, m, num_stages_per_rank=v)
    out = []
    for row in ops:
        listed = []
        for action in row:
            if action is None:
                continue
            for a in (action.sub_actions or (action,)):
                if a.computation_type.name == "REDUCE_GRAD":
                    continue
                listed.append(str(a))
        out.append(listed)
    return out


def _torch_refuses(schedule: str, ranks: int, m: int, v: int) -> bool:
    return _torch_outcome(schedule, ranks, m, v)[1] is not None


CASES = [(s, p, m, v) for s, vs in [("gpipe", (1,)), ("looped-bfs", (2, 3)), ("interleaved", (2, 3)),
                                    ("interleaved-zero-bubble", (2, 3)), ("zbv", (2,)), ("dualpipev", (2,))]
         for p in RANKS for m in MICROBATCHES for v in vs]


@pytest.mark.parametrize("schedule,ranks,m,v", CASES)
def test_actions_equal_torchs_schedule_ops(schedule, ranks, m, v):
    if _torch_refuses(schedule, ranks, m, v):
        with pytest.raises(ValueError):
            actions(schedule, ranks, m, v)
        return
    assert actions(schedule, ranks, m, v) == _torch_outcome(schedule, ranks, m, v)[0]


def _recorded_run(cls_name: str, ranks: int, m: int) -> list[list[str]]:
    """What a one-stage-per-rank torch schedule runs, rank by rank: its ``_step_microbatches`` on
    a stage that records its forward and backward calls."""
    from torch.distributed.pipelining.stage import PipelineStage

    cls = getattr(_torch_schedules(), cls_name)
    out = []
    for rank in range(ranks):
        ran: list[str] = []
        stage = mock.create_autospec(PipelineStage, instance=True)
        stage.group_rank, stage.group_size, stage.num_stages, stage.stage_index = rank, ranks, ranks, rank
        stage.is_first, stage.is_last, stage.submod = rank == 0, rank == ranks - 1, None
        for name in ("get_fwd_recv_ops", "get_fwd_send_ops", "get_bwd_recv_ops", "get_bwd_send_ops"):
            getattr(stage, name).return_value = []
        stage.forward_one_chunk.side_effect = lambda i, *a, **k: ran.append(f"{rank}F{i}")
        stage.backward_one_chunk.side_effect = lambda i, *a, **k: ran.append(f"{rank}B{i}")
        schedule = cls(stage, m)
        with mock.patch.object(schedule, "_initialize_stage"), mock.patch.object(schedule, "_maybe_compute_loss"), \
                mock.patch.object(schedule, "_maybe_get_loss"), mock.patch.object(schedule, "_update_losses"):
            schedule._step_microbatches([()] * m, [{}] * m)
        out.append(ran)
    return out


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("m", MICROBATCHES)
def test_one_f_one_b_equals_what_torch_runs(ranks, m):
    if m < ranks:
        with pytest.raises(ValueError, match="Schedule1F1B needs at least as many micro-batches as stages"):
            actions("1f1b", ranks, m)
        return
    assert actions("1f1b", ranks, m) == _recorded_run("Schedule1F1B", ranks, m)
    # torch 2.13's listing agrees but for the last rank, whose forwards it numbers from 1
    listed = _torch_compute("1f1b", ranks, m, 1)
    assert listed[:-1] == actions("1f1b", ranks, m)[:-1]
    assert [a.replace("F", "F+") for a in listed[-1]] != actions("1f1b", ranks, m)[-1]


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("m", (1, 3, 8))
def test_gpipe_equals_what_torch_runs(ranks, m):
    assert actions("gpipe", ranks, m) == _recorded_run("ScheduleGPipe", ranks, m) == _torch_compute("gpipe", ranks,
                                                                                                       m, 1)


def _one_stage_zero_bubble(ranks: int, m: int) -> list[list[str]]:
    """torch's ScheduleInterleavedZeroBubble with one stage per rank (get_schedule_ops asks for two)."""
    from torch.distributed.pipelining.stage import PipelineStage

    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.num_stages, stage.submod = 0, ranks, ranks, None
    order = _torch_schedules().ScheduleInterleavedZeroBubble([stage], m).pipeline_order
    return [[str(a) for a in order[r] if a is not None] for r in range(ranks)]


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("m", MICROBATCHES)
def test_zero_bubble_is_torchs_interleaved_zero_bubble_with_one_stage_per_rank(ranks, m):
    try:
        expected = _one_stage_zero_bubble(ranks, m)
    except ValueError:
        with pytest.raises(ValueError, match="multiple of its rounds"):
            actions("zero-bubble", ranks, m)
        return
    assert actions("zero-bubble", ranks, m) == expected


@pytest.mark.parametrize("schedule", schedules.SCHEDULES)
def test_what_the_workers_run_is_torchs_order(schedule):
    """The simulator and the in-process executors run torch's orders (gpipe: its backward last
    micro-batch first, as one backward() runs it; interleaved: Megatron's, chunks a multiple of ranks)."""
    compared = 0
    for ranks in RANKS:
        for m in MICROBATCHES:
            for v in (1, 2, 3):
                try:
                    torchs = rank_orders(schedule, ranks, m, v)
                except ValueError:
                    continue
                if schedule == "interleaved" and m % ranks:
                    continue  # ours needs chunks a multiple of the devices (Megatron's); torch has more rounds
                ours = worker_orders(schedule, ranks * v, m, v)
                if schedule == "gpipe":
                    torchs = [[a for a in order if a[1] == "F"] + [a for a in reversed(order) if a[1] == "B"]
                              for order in torchs]
                assert ours == torchs, (ranks, m, v)
                compared += 1
    assert compared >= 8


@pytest.mark.parametrize("schedule,ranks,m,v,reason", [
    ("1f1b", 4, 2, 1, r"Schedule1F1B needs at least as many micro-batches as stages: chunks 2 < 4 stages"),
    ("zbv", 2, 4, 3, r"ScheduleZBVZeroBubble\) needs exactly two stages per rank \(virtual_stages=2\), got 3"),
    ("dualpipev", 2, 4, 1, r"ScheduleDualPipeV\) needs exactly two stages per rank"),
    ("dualpipev", 4, 6, 2, r"needs at least as many micro-batches as stages \(2 × 4 ranks\): chunks 6 < 8"),
    ("interleaved", 4, 9, 2, r"multiple of its rounds \(max\(1, chunks // ranks\) = 2 rounds over 4 ranks\): "
                             r"chunks 9 is not"),
    ("interleaved-zero-bubble", 2, 5, 2, r"multiple of its rounds"),
    ("gpipe", 2, 4, 2, r"ScheduleGPipe\) runs one stage per rank, not 2"),
    ("pipedream", 2, 4, 1, r"unknown schedule 'pipedream': choose one of gpipe, 1f1b, interleaved, zero-bubble, "
                           r"looped-bfs, interleaved-zero-bubble, zbv, dualpipev"),
])
def test_torchs_constraints_are_refused_with_its_reason(schedule, ranks, m, v, reason):
    with pytest.raises(ValueError, match=reason):
        check_schedule(schedule, ranks, m, v)
    with pytest.raises(ValueError, match=reason):
        actions(schedule, ranks, m, v)


def test_stage_layouts():
    assert stage_ranks("zbv", 8, 4) == [0, 1, 2, 3, 3, 2, 1, 0]
    assert stage_ranks("dualpipev", 4, 2) == [0, 1, 1, 0]
    assert stage_ranks("looped-bfs", 6, 2) == [0, 1, 0, 1, 0, 1]
    # each rank's actions stay on its stages
    for schedule in ("zbv", "dualpipev", "interleaved-zero-bubble", "looped-bfs"):
        layout = stage_ranks(schedule, 8, 4)
        for rank, order in enumerate(rank_orders(schedule, 4, 8, 2)):
            assert {layout[s] for s, _, _ in order} == {rank}, schedule


def test_every_stage_and_micro_batch_runs_its_whole_backward_once():
    for schedule in schedules.SCHEDULES:
        for ranks, m in ((2, 4), (4, 8), (8, 16)):
            v = 2 if schedule in schedules.MULTI_STAGE else 1
            ran = [a for order in rank_orders(schedule, ranks, m, v) for a in order]
            assert len(ran) == len(set(ran)), schedule
            for s in range(ranks * v):
                for i in range(m):
                    assert (s, "F", i) in ran
                    assert ((s, "B", i) in ran) != ((s, "I", i) in ran and (s, "W", i) in ran), (schedule, s, i)
