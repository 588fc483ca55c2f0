"""The cost model: what each layer and phase costs at a micro-batch size, corrected by runs.

A layer table (:func:`pipexplore.profile`) holds per layer ``t(n) = a + b·n`` for forward and
backward in the rows ``n`` of a micro-batch, and the share of its device each phase keeps busy. From it, for a
plan's split and micro-batch sizes, follow per stage and phase: seconds, the share of its device
it keeps busy (how much it slows the other stages on the same host or GPU) and bytes.
:class:`Corrections` hold what measured runs taught, per executor: a factor per layer and phase,
and the lane time each action costs beyond its span (the executor's own dispatch)::

    seconds = stage_seconds(table, splits=[4], rows=32, phase="forward")
    learnt = Corrections().learn(table, [4], "threads", predicted, measured)
    seconds = stage_seconds(table, [4], 32, "forward", learnt.scale("threads", "forward"))
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np
import pandas as pd

from pipexplore.timeline import step_time

__all__ = ["PHASE_SOURCE", "COST_SOURCE", "LEARNT_PHASES", "LEARNING_MEMORY", "Corrections", "microbatch_rows",
           "layer_seconds", "layer_times", "fresh_gradient_seconds",
           "stage_seconds", "stage_shares", "stage_bounds", "stage_sums", "has_fit", "handoff_gaps", "dispatch_gap",
           "lanes_of"]

#: Which profiled phase each simulated phase costs as, and the share of it.
PHASE_SOURCE = {"forward": ("forward", 1.0), "recompute": ("forward", 1.0), "backward": ("backward", 1.0),
                "input_grad": ("backward", 0.5), "weight_grad": ("backward", 0.5)}
#: What :func:`layer_seconds` costs: the phases, a checkpointed micro-batch's forward, which
#: keeps nothing for backward (it runs without autograd): the forward times the profiled
#: ``checkpointed_ratio`` (1 where the table does not say), and the optimizer step over the
#: layer's parameters (the table's ``optimizer`` column: the same at any micro-batch size; 0 where
#: the table has none).
COST_SOURCE = {**PHASE_SOURCE, "checkpointed": ("forward", 1.0), "optimizer": ("optimizer", 1.0)}
#: The phases a run teaches (:meth:`Corrections.learn`): the profiled compute phases and the
#: optimizer step.
LEARNT_PHASES = (*PHASE_SOURCE, "optimizer")


#: The most one run may scale a layer's cost, either way.
MAX_STEP = 4.0
#: From its third run on, a run of an executor weighs a third in what the runs taught
#: (:meth:`Corrections.fitted`): an average that follows a machine that changed within a few runs.
LEARNING_MEMORY = 3


def has_fit(table: pd.DataFrame) -> bool:
    """Whether the table holds costs as functions of the micro-batch size (``profile(microbatch_rows=…)``)."""
    return "forward_a" in table and "forward_b" in table and table.attrs.get("batch") is not None


def microbatch_rows(batch: int, chunks: int) -> list[int]:
    """The rows of each micro-batch, as ``torch.chunk`` splits ``batch`` rows into ``chunks``."""
    if batch < 1:
        raise ValueError(f"a batch needs at least one row, got {batch}")
    size = -(-batch // chunks)
    rows = [size] * (batch // size)
    if batch % size:
        rows.append(batch % size)
    return rows


def stage_bounds(splits: Sequence[int], layers: int) -> list[tuple[int, int]]:
    points = [0, *splits, layers]
    return list(zip(points, points[1:]))


def layer_seconds(table: pd.DataFrame, rows: float, phase: str) -> np.ndarray:
    """Each layer's seconds for ``phase`` on a micro-batch of ``rows`` rows.

    With a fit: ``a + b·rows``. Without one (a table of whole-batch seconds), proportional:
    ``rows`` is then the micro-batch's fraction of the profiled batch when the table says no batch.
    Zero-bubble's ``input_grad`` and ``weight_grad`` are the backward times the profiled
    ``input_grad_ratio``/``weight_grad_ratio`` (half each where the table does not say), and a
    ``checkpointed`` forward (without autograd) the forward times ``checkpointed_ratio``. The
    ``optimizer`` step is the table's ``optimizer`` column whatever the rows (it works on the
    parameters, not the batch; 0 where the table has no such column, or NaN).
    """
    if phase == "optimizer":
        if "optimizer" not in table:
            return np.zeros(len(table))
        return np.nan_to_num(table["optimizer"].to_numpy(dtype=float), nan=0.0)
    source = COST_SOURCE[phase][0]
    share = _source_share(table, phase)
    if has_fit(table):
        a = table[f"{source}_a"].to_numpy(dtype=float)
        b = table[f"{source}_b"].to_numpy(dtype=float)
        return share * (a + b * rows)
    whole = table[source].to_numpy(dtype=float)
    batch = table.attrs.get("batch")
    return share * whole * (rows / batch if batch else rows)


def layer_times(plan: Any) -> np.ndarray:
    """Each layer's forward + backward (+ recompute where the plan's runs recompute:
    ``plan.run_checkpoint``) at the plan's micro-batch, by the plan's own corrected costs: what a
    time-balanced split weighs (:func:`pipexplore.predict.sweep.plan_balanced_splits`, the search's splits)."""
    batch = plan.step_batch
    rows = microbatch_rows(int(batch), plan.chunks)[0] if batch else 1.0 / plan.chunks
    total = np.zeros(plan.num_layers)
    for phase in ("forward", "backward") + (("recompute",) if plan.run_checkpoint != "never" else ()):
        scale = plan.learnt.scale(plan.predict_executor, phase)
        seconds = layer_seconds(plan.layer_table, rows, phase)
        total += seconds * (scale if scale is not None and len(scale) == len(seconds) else 1.0)
    return total


def fresh_gradient_seconds(table: pd.DataFrame, scale: Optional[np.ndarray] = None) -> np.ndarray:
    """Each layer's seconds of allocating its gradients, once a step (the profile's ``fresh_grads``;
    0 where the table has none), times ``scale`` per layer (the backward's corrections)."""
    if "fresh_grads" not in table:
        return np.zeros(len(table))
    fresh = np.nan_to_num(table["fresh_grads"].to_numpy(dtype=float), nan=0.0)
    return fresh * scale if scale is not None else fresh


def _source_share(table: pd.DataFrame, phase: str) -> Union[float, np.ndarray]:
    """The share of its profiled phase a phase costs, per layer where the table says
    (zero-bubble's ``input_grad_ratio``/``weight_grad_ratio``), else :data:`PHASE_SOURCE`'s."""
    default = COST_SOURCE[phase][1]
    column = f"{phase}_ratio"
    return np.nan_to_num(table[column].to_numpy(dtype=float), nan=default) if column in table else default


def stage_seconds(table: pd.DataFrame, splits: Sequence[int], rows: float, phase: str,
                  scale: Optional[np.ndarray] = None) -> np.ndarray:
    """Per stage: the sum of its layers' seconds for ``phase`` at ``rows``, times ``scale`` per layer."""
    seconds = layer_seconds(table, rows, phase)
    if scale is not None:
        seconds = seconds * scale
    return stage_sums(seconds, [0, *splits, len(table)])


def stage_sums(values: np.ndarray, points: Sequence[int]) -> np.ndarray:
    """Per stage, the sum of ``values`` (one per layer) over its layers; ``points`` are the stage
    boundaries, ``[0, *splits, layers]`` (differences of running totals: one pass for all stages)."""
    total = np.concatenate([[0.0], np.cumsum(values)])
    bounds = np.asarray(points)
    return total[bounds[1:]] - total[bounds[:-1]]


def stage_shares(table: pd.DataFrame, splits: Sequence[int], rows: float, phase: str,
                 default: float) -> np.ndarray:
    """Per stage: the share of its device (0…1) a phase keeps busy when it runs alone, weighted by
    its layers' time. ``default`` when the table does not say (no ``share_*`` columns)."""
    source, _ = COST_SOURCE[phase]
    column = f"share_{source}"
    bounds = stage_bounds(splits, len(table))
    if column not in table:
        return np.full(len(bounds), float(default))
    seconds = layer_seconds(table, rows, phase)
    shares = table[column].to_numpy(dtype=float)
    out = []
    for a, b in bounds:
        total = seconds[a:b].sum()
        out.append(float((seconds[a:b] * shares[a:b]).sum() / total) if total > 0 else 0.0)
    return np.array(out)


@dataclass(frozen=True)
class Corrections:
    """What measured runs taught the cost model, per executor.

    ``scales[(executor, phase)]``: a factor per layer on its profiled seconds (1 where no run has
    told). ``gaps[executor]``: seconds a worker spends between two actions beyond waiting for
    inputs (its own dispatch, Python, mailboxes). ``runs``: how many runs were learnt from.
    """

    scales: Mapping[tuple[str, str], np.ndarray] = field(default_factory=dict)
    gaps: Mapping[str, float] = field(default_factory=dict)
    runs: int = 0
    #: ``overheads[executor]``: seconds each action's span costs beyond its layers (the executor's
    #: own bookkeeping inside the span), measured by :func:`pipexplore.executors.probe`: one
    #: number, or one per phase with ``"all"`` for the phases the probe did not run.
    overheads: Mapping[str, Union[float, Mapping[str, float]]] = field(default_factory=dict)
    #: ``transfers[executor]``: seconds from the end of an action to the start of the action on
    #: another stage that waits for it (mailbox hand-over, send/receive), beyond the copy itself.
    transfers: Mapping[str, float] = field(default_factory=dict)
    #: ``kinds[kind]``: what runs on devices of another kind taught (a catalogue name, ``"H100"``:
    #: runs of a cluster brought back), kept apart from this machine's (the fields above), so a
    #: cluster's run corrects plans for its devices and never this machine's, nor the other way.
    kinds: Mapping[str, "Corrections"] = field(default_factory=dict)
    #: ``counts[executor]``: the runs of that executor learnt from (what a next one weighs:
    #: :meth:`fitted`).
    counts: Mapping[str, int] = field(default_factory=dict)

    def for_kind(self, kind: Optional[str]) -> "Corrections":
        """The corrections a plan on devices of ``kind`` uses: this machine's own for None, else what
        runs on that kind taught (none yet: no correction; this machine's do not carry over)."""
        if kind is None:
            return self
        return self.kinds.get(kind) or NO_CORRECTIONS

    def with_kind(self, kind: Optional[str], learnt: "Corrections") -> "Corrections":
        """These corrections with ``learnt`` as what devices of ``kind`` taught (None: this machine's)."""
        if kind is None:
            return replace(learnt, kinds=self.kinds)
        return replace(self, kinds={**self.kinds, kind: replace(learnt, kinds={})})

    def scale(self, executor: str, phase: str) -> Optional[np.ndarray]:
        return self.scales.get((executor, phase))

    def gap(self, executor: str) -> float:
        return float(self.gaps.get(executor, 0.0))

    def overhead(self, executor: str, phase: Optional[str] = None) -> float:
        """Seconds an action of ``phase`` costs ``executor`` beyond its layers (its median over
        the phases probed where the phase was not, or where ``phase`` is ``None``)."""
        value = self.overheads.get(executor, 0.0)
        if isinstance(value, Mapping):
            return float(value.get(phase, value.get("all", 0.0)) if phase is not None else value.get("all", 0.0))
        return float(value)

    def transfer(self, executor: str) -> float:
        return float(self.transfers.get(executor, 0.0))

    def with_executor_costs(self, executor: str, overhead: Union[float, Mapping[str, float]], gap: float,
                            transfer: Optional[float] = None) -> "Corrections":
        """These corrections with an executor's own cost per action, as a probe measured it."""
        transfers = {**self.transfers, executor: transfer} if transfer is not None else dict(self.transfers)
        return replace(self, gaps={**self.gaps, executor: gap}, overheads={**self.overheads, executor: overhead},
                       transfers=transfers)

    def fitted(self, table: pd.DataFrame, splits: Sequence[int], executor: str,
               predict: Callable[["Corrections"], pd.DataFrame], measured: pd.DataFrame,
               iterations: int = 4, fit_step: bool = False) -> "Corrections":
        """Learn from one run until predicting it again reproduces it: :meth:`learn`, repeated
        against the same measurement (each round re-simulates, so the contention between stages
        is redistributed with the corrected costs); with ``fit_step``, then the hand-over that
        reproduces its step (:meth:`step_fitted`).

        The executor's first run is taken as it is; a later one is averaged with what the runs
        before taught (:meth:`blended`, weighing ``1 / min(runs + 1, LEARNING_MEMORY)``): the same
        plan run again on this machine moves by 10–20 %, and a model that reproduced each last
        run would predict the next with that whole error."""
        learnt: Corrections = self
        for k in range(iterations):
            learnt = learnt.learn(table, splits, executor, predict(learnt), measured, count=k == 0)
        if fit_step:
            learnt = learnt.step_fitted(executor, predict, measured)
        before = self.counts.get(executor, 0)
        return self.blended(learnt, executor, 1.0 / min(before + 1, LEARNING_MEMORY)) if before else learnt

    def blended(self, other: "Corrections", executor: str, weight: float) -> "Corrections":
        """``other`` (these corrections after a run of ``executor``) with what it learnt for the
        executor averaged with these: its factors geometrically (``self^(1−w)·other^w``), its gap and
        hand-over arithmetically; what these did not hold is taken from ``other`` as it is."""
        scales = dict(other.scales)
        for key, value in other.scales.items():
            old = self.scales.get(key)
            if key[0] == executor and old is not None and len(old) == len(value):
                scales[key] = np.exp((1 - weight) * np.log(np.maximum(old, 1e-12))
                                     + weight * np.log(np.maximum(value, 1e-12)))

        def mean(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
            out = dict(after)
            if executor in before and executor in after:
                out[executor] = (1 - weight) * before[executor] + weight * after[executor]
            return out

        return replace(other, scales=scales, gaps=mean(self.gaps, other.gaps),
                       transfers=mean(self.transfers, other.transfers))

    def step_fitted(self, executor: str, predict: Callable[["Corrections"], pd.DataFrame],
                    measured: pd.DataFrame, iterations: int = 24) -> "Corrections":
        """These corrections with the executor's hand-over chosen so that predicting the run
        again gives its measured step (bisection: a longer hand-over never shortens a step).

        Once every action's seconds are learnt, what a step spends beyond them is in its waits.
        Between processes the median hand-over (:func:`handoff_gaps`) leaves out their tail: a
        rank whose cores are taken by other ranks is woken late, its send or receive a few
        milliseconds instead of a few tenths, and the step's critical path runs through such
        hand-overs. The hand-over learnt here is the one that puts the measured step's waits on
        the critical path; it carries over to other plans of the executor as a cost per hand-over.
        Unchanged where no hand-over lies on the critical path (one stage) or the step does not say.
        """
        target = step_time(measured)
        base = self.transfer(executor)
        if not target > 0:
            return self

        def handing_over(transfer: float) -> "Corrections":
            return replace(self, transfers={**self.transfers, executor: transfer})

        def step(transfer: float) -> float:
            return step_time(predict(handing_over(transfer)))

        low_step = step_time(predict(self))
        if low_step <= 0 or abs(low_step - target) <= 1e-3 * target:
            return self
        if low_step > target:
            lo, hi = 0.0, base
            if step(0.0) >= target:  # nothing to take from the hand-overs
                return self
        else:
            lo, hi = base, base + (target - low_step)
            if step(hi) < target:  # the hand-overs are not on the critical path
                return self
        for _ in range(iterations):
            middle = (lo + hi) / 2
            if step(middle) < target:
                lo = middle
            else:
                hi = middle
        return handing_over((lo + hi) / 2)

    def learn(self, table: pd.DataFrame, splits: Sequence[int], executor: str, predicted: pd.DataFrame,
              measured: pd.DataFrame, count: bool = True) -> "Corrections":
        """These corrections updated from one run: ``measured`` against ``predicted`` (the
        prediction made with these corrections for the same plan), action by action.

        Per stage and phase, the measured seconds over the predicted seconds (both with the
        contention of that run) rescale the factor of every layer in the stage (a run of
        zero-bubble's I and W also rescales the whole backward B, and a run of B rescales I and W;
        the optimizer step, one per stage, rescales the layers' ``optimizer`` seconds);
        the executor's gap is the median time a worker spent between actions beyond waiting for
        inputs.
        """
        keys = ["stage", "microbatch", "phase"]
        both = _spans(predicted).merge(_spans(measured), on=keys, suffixes=("_p", "_m"))
        if (both["phase"] == "weight_grad").any():
            # Zero-bubble's first stage: its input needs no gradient, so its I is the whole backward
            # (B's cost, as simulated) and its W does nothing worth learning from.
            first = both["stage"] == 0
            both = both[~(first & (both["phase"] == "weight_grad"))]
            both.loc[first & (both["phase"] == "input_grad"), "phase"] = "backward"
        scales = {k: v.copy() for k, v in self.scales.items()}
        taught = {phase: np.zeros(len(table), dtype=bool) for phase in LEARNT_PHASES}
        for phase in LEARNT_PHASES:
            rows = both[both["phase"] == phase]
            if rows.empty:
                continue
            key = (executor, phase)
            factor = scales.get(key, np.ones(len(table)))
            if len(factor) != len(table):
                factor = np.ones(len(table))
            for stage, group in rows.groupby("stage"):
                predicted_seconds = float(group["seconds_p"].sum())
                measured_seconds = float(group["seconds_m"].sum())
                if predicted_seconds <= 0 or measured_seconds <= 0:
                    continue
                a, b = stage_bounds(splits, len(table))[int(stage)]
                # One run moves a cost by at most ×4 either way: a run disturbed by something else on
                # the machine must not throw the model off (later runs keep correcting).
                ratio = min(max(measured_seconds / predicted_seconds, MAX_STEP ** -1), MAX_STEP)
                factor[a:b] = factor[a:b] * ratio
                taught[phase][a:b] = True
            scales[key] = factor
        _share_backward_factors(scales, table, executor, taught)
        gaps, transfers = dict(self.gaps), dict(self.transfers)
        gap, transfer = handoff_gaps(measured, lanes_of(predicted))
        if gap is not None:
            gaps[executor] = gap
        if transfer is not None:
            transfers[executor] = transfer
        counts = {**self.counts, executor: self.counts.get(executor, 0) + 1} if count else self.counts
        return Corrections(scales, gaps, self.runs + int(count), self.overheads, transfers, self.kinds, counts)


def _share_backward_factors(scales: dict, table: pd.DataFrame, executor: str,
                            taught: dict[str, np.ndarray]) -> None:
    """A run of one backward family teaches the other on the layers where that one was not
    measured itself (``taught[phase]``: the layers a run measured): the whole backward (B) takes
    the input- and weight-gradient factors averaged by their profiled cost, and I and W take B's."""
    n = len(table)

    def ratio(phase: str) -> np.ndarray:
        return np.broadcast_to(_source_share(table, phase), (n,))

    def factor(phase: str) -> np.ndarray:
        return scales.get((executor, phase), np.ones(n))

    split = taught["input_grad"] & taught["weight_grad"] & ~taught["backward"]
    if split.any():
        r_i, r_w = ratio("input_grad"), ratio("weight_grad")
        total = np.where(r_i + r_w > 0, r_i + r_w, 1.0)
        backward = factor("backward").copy()
        backward[split] = ((factor("input_grad") * r_i + factor("weight_grad") * r_w) / total)[split]
        scales[(executor, "backward")] = backward
    whole = taught["backward"] & ~taught["input_grad"] & ~taught["weight_grad"]
    if whole.any():
        for phase in ("input_grad", "weight_grad"):
            f = factor(phase).copy()
            f[whole] = factor("backward")[whole]
            scales[(executor, phase)] = f


def _spans(frame: pd.DataFrame) -> pd.DataFrame:
    compute = frame[frame["phase"].isin(list(LEARNT_PHASES))]
    return compute.assign(seconds=compute["end"] - compute["start"])[["stage", "microbatch", "phase", "seconds"]]


def lanes_of(timeline: pd.DataFrame) -> Optional[dict[tuple[int, str, int], int]]:
    """The worker of each action (``(stage, phase, micro-batch) -> lane``) of a predicted timeline,
    or ``None`` when it does not say (no ``lane`` column)."""
    if "lane" not in timeline:
        return None
    compute = timeline[timeline["phase"].isin(list(PHASE_SOURCE))]
    return {(int(s), str(p), int(i)): int(q) for s, p, i, q in
            compute[["stage", "phase", "microbatch", "lane"]].itertuples(index=False, name=None)}


def handoff_gaps(measured: pd.DataFrame, lanes: Optional[Mapping[tuple[int, str, int], int]] = None
                 ) -> tuple[Optional[float], Optional[float]]:
    """What a measured step spent between actions, as medians: ``(dispatch, transfer)``.

    ``lanes`` says which worker ran each action (:func:`lanes_of` a prediction of the same plan:
    an interleaved worker runs several stages, autograd's engine thread the backward of every
    stage of a device); default: one worker per stage.

    ``dispatch``: seconds a stage's worker took to start an action whose inputs were already
    there when its previous action ended (the executor's own cost per action). ``transfer``:
    seconds from the end of the action on another stage that an action waited for (a
    forward's input, a backward's gradient) to its start — handing a tensor over a mailbox in
    threads, a send/receive between processes.
    """
    compute = measured[measured["phase"].isin(list(PHASE_SOURCE))].sort_values("start")
    if compute.empty:
        return None, None
    end = {(int(s), p, int(i)): float(e) for s, p, i, e in
           compute[["stage", "phase", "microbatch", "end"]].itertuples(index=False, name=None)}
    last_stage = int(compute["stage"].max())
    keys = list(zip(compute["stage"].astype(int), compute["phase"], compute["microbatch"].astype(int)))
    worker = [lanes.get(key, -1 - key[0]) if lanes else key[0] for key in keys]
    dispatch, transfer = [], []
    for _, lane in compute.assign(worker=worker).groupby("worker"):
        previous_end = None
        for stage, phase, i, start, _finish in lane[["stage", "phase", "microbatch", "start", "end"]].itertuples(
                index=False, name=None):
            stage, i = int(stage), int(i)
            local: list[Optional[float]] = [previous_end]
            remote: list[Optional[float]] = []
            if phase == "forward":
                remote = [end.get((stage - 1, "forward", i))] if stage else []
            elif phase == "weight_grad":
                local.append(end.get((stage, "input_grad", i)))
            else:
                local.append(end.get((stage, "forward", i)))
                if stage < last_stage:
                    remote = [end.get((stage + 1, p, i)) for p in ("input_grad", "backward")]
            ready_local = max([t for t in local if t is not None], default=None)
            ready_remote = max([t for t in remote if t is not None], default=None)
            if ready_remote is not None and (ready_local is None or ready_remote > ready_local):
                transfer.append(start - ready_remote)
            elif ready_local is not None and previous_end is not None:
                dispatch.append(start - ready_local)
            previous_end = _finish

    def median(values: list[float]) -> Optional[float]:
        values = [v for v in values if v >= 0]
        return float(np.median(values)) if values else None

    return median(dispatch), median(transfer)


def dispatch_gap(measured: pd.DataFrame) -> Optional[float]:
    """The median seconds a stage's worker spent between two of its actions while the second
    one's inputs were already there: what the executor itself costs per action."""
    return handoff_gaps(measured)[0]


#: What a kind of device no run has taught uses: one object, so that its identity (the page's
#: re-timing key) stays the same from one refresh to the next.
NO_CORRECTIONS = Corrections()
