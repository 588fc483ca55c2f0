"""The explorer's header: the figures that decide a split, for the current plan and the last run."""
from __future__ import annotations

import html
import math
from typing import Any, Mapping, Optional

import pandas as pd

from pipexplore import timeline as tl
from pipexplore.devices import device_spec, devices_text
from pipexplore.plan import Plan
from pipexplore.predict.basis import prediction_basis
from pipexplore.predict.costs import microbatch_rows
from pipexplore.predict.memory import activation_peaks
from pipexplore.schedules import checkpointed

__all__ = ["plan_figures", "header_html", "format_bytes", "STEAL_NOTED", "steal_note", "plan_text", "short_plan_text",
           "splits_text", "parse_bytes", "plan_difference", "mesh_text", "plan_devices_text", "model_flops_utilisation",
           "hardware_flops_utilisation", "recomputed_share"]


def format_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB ('–' for NaN).

    Example::

        format_bytes(3 * 2**20)   # '3.0 MiB'
    """
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def plan_text(plan: Plan) -> str:
    """The plan in one line: splits, chunks, schedule, checkpoint, executor and devices (a count
    of planned ones), and its mesh where it has one.

    Example::

        plan_text(explorer.plan)
        # 'splits [4, 8] · chunks 4 · gpipe · checkpoint except_last · threads on cpu,cpu,cpu'
    """
    devices = plan_devices_text(plan)
    return (f"splits {splits_text(plan.splits)} · chunks {plan.chunks} · {plan.schedule} · "
            f"checkpoint {plan.checkpoint}{_not_run(plan)}{mesh_text(plan, ' · ')} · {plan.executor} on {devices}")


def plan_devices_text(plan: Plan) -> str:
    """The devices the plan uses: all of its mesh's, else one a pipeline rank; planned ones as a count."""
    used = plan.devices if plan.mesh is not None else plan.devices[: plan.num_devices]
    return devices_text(used, plan.gpus_per_node)


def mesh_text(plan: Plan, before: str = "") -> str:
    """``'tp 4 · pp 8 · dp 2 (fsdp)'`` for a plan with a mesh (after ``before``), else ''."""
    mesh = plan.mesh
    if mesh is None:
        return ""
    return f"{before}{mesh.describe()} ({plan.data_parallel})"


def _not_run(plan: Any) -> str:
    """Where the executor recomputes nothing whatever the plan says (torch's runtime): say so."""
    return f" (runs {plan.run_checkpoint})" if plan.run_checkpoint != plan.checkpoint else ""


def splits_text(splits: Any, shown: int = 8) -> str:
    """Split points in short: all of them, or the first and last few with how many in all.

    Example::

        splits_text(range(4, 256, 4))   # '[4, 8, 12, 16, …, 244, 248, 252] (63 splits)'
    """
    splits = list(splits)
    if len(splits) <= shown:
        return str(splits)
    half = shown // 2
    return (f"[{', '.join(map(str, splits[:half]))}, …, {', '.join(map(str, splits[-half + 1:]))}] "
            f"({len(splits)} splits)")


def short_plan_text(plan: Plan) -> str:
    """What tells two plans apart, in a few words: splits, chunks, schedule.

    Example::

        short_plan_text(explorer.plan)   # 'splits [4, 8] · 4 chunks · gpipe'
    """
    return f"splits {splits_text(plan.splits)} · {plan.chunks} chunks · {plan.schedule}{mesh_text(plan, ' · ')}"


def plan_figures(plan: Plan, samples: Optional[int] = None, tokens_per_sample: int = 1) -> dict[str, Any]:
    """The predicted figures of a plan: ``step_time`` (s), ``bubble`` (fraction; by device for
    interleaved), ``throughput`` (samples/s), ``prediction_basis`` (what the prediction rests on and
    the error the benchmarks measured for that kind: :func:`pipexplore.predict.basis.prediction_basis`),
    ``activation_bytes_per_stage`` (bytes, one per stage,
    at its peak on one GPU: :func:`pipexplore.predict.memory.activation_peaks`, the stage table's
    ``activation_bytes``). A plan for catalogue devices adds, a GPU: ``gpus`` (all of its mesh's),
    ``mfu`` (model FLOPs utilisation: the model's FLOPs a step, forward and backward without
    recomputation — PaLM's 6N a token and attention — over the step and the GPUs' peak in the
    model's compute dtype: :func:`model_flops_utilisation`), ``hfu`` (hardware FLOPs utilisation:
    the same with the forwards that activation checkpointing runs again, as Megatron-LM and PaLM
    count it: :func:`hardware_flops_utilisation`) and ``tokens_per_second_per_gpu``
    (``tokens_per_sample`` a sample).

    Example::

        plan_figures(explorer.plan, samples=64)["predicted_step_time"]
    """
    predicted = plan.predicted
    step = tl.step_time(predicted)
    samples = samples if samples is not None else plan.batch
    figures = {
        "predicted_step_time": step,
        "bubble": tl.bubble_fraction(predicted, by=tl.bubble_by(plan.schedule)),
        "throughput": (samples / step) if samples and step > 0 else math.nan,
        "activation_bytes_per_stage": activation_peaks(predicted, plan.num_stages),
        "prediction_basis": prediction_basis(plan).text(),
    }
    if plan.planned:
        mesh = plan.mesh_or_pipeline
        gpus = mesh.size
        replicas_samples = (samples or 0) * mesh.dp
        figures["gpus"] = gpus
        figures["mfu"] = model_flops_utilisation(plan, step)
        figures["hfu"] = hardware_flops_utilisation(plan, step)
        figures["tokens_per_second_per_gpu"] = (replicas_samples * tokens_per_sample / step / gpus
                                                if step > 0 else math.nan)
    return figures


def model_flops_utilisation(plan: Plan, step: float) -> float:
    """Model FLOPs utilisation (MFU): the model's FLOPs of a step (the layer table's forward and
    backward, at the plan's batch, for every replica; no recomputation: PaLM's ``6N`` a token and
    its attention) over ``step`` seconds and the peak of all the mesh's GPUs in the model's compute
    dtype (the dtype of its costliest operators); NaN where the table has no FLOPs."""
    return _utilisation(plan, step, recomputed=0.0)


def hardware_flops_utilisation(plan: Plan, step: float) -> float:
    """Hardware FLOPs utilisation (HFU): :func:`model_flops_utilisation`'s FLOPs plus the forward
    FLOPs activation checkpointing runs again (:func:`recomputed_share` of the forward), over the
    same seconds and peak, as Megatron-LM and PaLM tell HFU from MFU. Equal to the MFU without
    recomputation; with every micro-batch recomputed ``(2F + B) / (F + B)`` times it (``8/6`` where
    a backward costs two forwards)."""
    return _utilisation(plan, step, recomputed=recomputed_share(plan))


def recomputed_share(plan: Plan) -> float:
    """The share of a step's rows whose forward runs again before their backward: the checkpointed
    micro-batches' (:attr:`pipexplore.plan.Plan.run_checkpoint`: 1 for ``always``, the rows of all
    but the last micro-batch for ``except_last``, 0 for ``never``)."""
    batch = plan.step_batch
    rows = microbatch_rows(batch, plan.chunks) if batch else [1] * plan.chunks
    return sum(rows[: checkpointed(plan.run_checkpoint, len(rows))]) / sum(rows)


def _utilisation(plan: Plan, step: float, recomputed: float) -> float:
    table = plan.layer_table
    if "forward_flops" not in table:
        return math.nan
    forward = float(table["forward_flops"].sum())
    flops = forward * (1.0 + recomputed) + float(table["backward_flops"].sum())
    own = table.attrs.get("batch")
    if own and plan.batch:
        flops *= plan.batch / own
    ops = table.attrs.get("ops")
    dtype = "bfloat16"
    if isinstance(ops, pd.DataFrame) and len(ops) and ops["flops"].sum() > 0:
        dtype = str(ops.groupby("dtype")["flops"].sum().idxmax())
    mesh = plan.mesh_or_pipeline
    spec = device_spec(plan.devices[0])
    try:
        peak = spec.peak(dtype)
    except ValueError:
        return math.nan
    return flops * mesh.dp / step / (peak * mesh.size) if step > 0 and math.isfinite(flops) else math.nan


def _card(label: str, value: str, note: str = "", cls: str = "") -> str:
    return (f"<div class='pipexplore-card {cls}'><div class='pipexplore-card-label'>{html.escape(label)}</div>"
            f"<div class='pipexplore-card-value'>{value}</div>"
            + (f"<div class='pipexplore-card-note'>{note}</div>" if note else "") + "</div>")


_MFU = "model FLOPs utilisation: the model's forward and backward FLOPs (6N a token), no recomputation"
_HFU = "hardware FLOPs utilisation: the FLOPs run, the forwards activation checkpointing recomputes too"


def _gpu_card(figures: Mapping[str, Any]) -> str:
    """What a planned GPU does: its MFU and HFU (each named), tokens a second and peak memory."""
    mfu, hfu = figures["mfu"], figures.get("hfu", math.nan)
    if math.isnan(mfu):
        value = "–"
    else:
        value = f"<span title='{html.escape(_MFU)}'>MFU {mfu * 100:.1f} %</span>"
        if not math.isnan(hfu):
            value += f" · <span title='{html.escape(_HFU)}'>HFU {hfu * 100:.1f} %</span>"
    recomputes = not math.isnan(hfu) and not math.isnan(mfu) and hfu > mfu
    what = ("MFU: model FLOPs, no recomputation; HFU: with the recomputed forwards · " if recomputes
            else "MFU: model FLOPs (nothing recomputed: HFU = MFU) · ")
    return _card(f"a GPU of {figures['gpus']}", value,
                 f"{what if not math.isnan(mfu) else ''}{figures['tokens_per_second_per_gpu']:,.0f} tokens/s · "
                 f"peak memory {format_bytes(figures.get('peak_bytes_per_gpu', math.nan))}")


def header_html(title: str, figures: Mapping[str, Any], last_run: Optional[Mapping[str, Any]] = None,
                memory_cap: Optional[float] = None, planned: str = "") -> str:
    """The header: a title line and one card per figure (predicted step, bubble, throughput, peak
    activation memory per stage; last measured step and the prediction's error). ``planned``:
    the planned devices ('' for devices here), said where a measured step would stand.

    Example::

        header_html("12 layers · batch 64", plan_figures(plan, 64), last_run=explorer.runs.iloc[-1])
    """
    peaks = list(figures["activation_bytes_per_stage"])
    over = [k for k, v in enumerate(peaks) if memory_cap is not None and v > memory_cap]
    largest = max(peaks, default=math.nan)
    if len(peaks) <= 8:
        per_stage = " · ".join(f"<span class='{'pipexplore-over' if k in over else ''}'>{format_bytes(v)}</span>"
                               for k, v in enumerate(peaks))
    else:
        per_stage = f"largest {format_bytes(largest)} (stage {peaks.index(largest)}) of {len(peaks)} stages"
    cap_note = ("" if memory_cap is None else
                f"<span class='pipexplore-over'>⚠ stage{'s' if len(over) > 1 else ''} {', '.join(map(str, over))} over "
                f"the cap of {format_bytes(memory_cap)}</span>"
                if over else f"under the cap of {format_bytes(memory_cap)}")
    cards = [
        _card("predicted step" + (" (planned)" if planned else ""), f"{figures['predicted_step_time'] * 1e3:.2f} ms",
              html.escape(figures.get("prediction_basis", ""))),
        _card("bubble", f"{figures['bubble'] * 100:.1f} %"),
        _card("throughput, samples/s", "–" if math.isnan(figures["throughput"]) else f"{figures['throughput']:,.0f}"),
        _card("peak activations per stage" + (", a GPU" if "gpus" in figures else ""), per_stage, cap_note,
              "pipexplore-card-wide"),
    ]
    if "mfu" in figures:  # planned GPUs: what each of them does
        cards.append(_gpu_card(figures))
    if last_run is not None:
        error = last_run.get("prediction_error", math.nan)
        bad = isinstance(error, float) and not math.isnan(error) and abs(error) > 0.25
        known = isinstance(error, float) and not math.isnan(error)
        said = (f"predicted {last_run['predicted_step_time'] * 1e3:.2f} ms then ({error * 100:+.0f} %)"
                if known else "prediction error –")
        stolen = steal_note(last_run.get("host_steal"))
        if stolen:
            said += f"; {html.escape(stolen)}"
        cards.append(_card(f"measured · run {last_run['run']}", f"{last_run['step_time'] * 1e3:.2f} ms", said,
                           "pipexplore-bad" if bad else ""))
    elif planned:
        cards.append(_card("measured", "planned", f"{html.escape(planned)} are not here: export the plan and run it "
                           "there"))
    else:
        cards.append(_card("measured", "no run yet", "press Run step"))
    return ("<div class='pipexplore-header'>"
            f"<div class='pipexplore-title'><b>pipexplore</b> · {html.escape(title)}</div>"
            f"<div class='pipexplore-cards'>{''.join(cards)}</div></div>")


#: The share of the host's CPU time taken by other guests while a run was measured from which the
#: page says so beside the run (``host_steal``, :class:`~pipexplore.host.StealMeter`).
STEAL_NOTED = 0.05


def steal_note(share: Any) -> str:
    """What the page says of a run measured while other guests held ``share`` of the host's CPU time:
    nothing ('') below :data:`STEAL_NOTED`, or where it was not measured (nan, absent)."""
    if not (isinstance(share, float) and share >= STEAL_NOTED):
        return ""
    return (f"other guests on this machine held {share * 100:.0f} % of its CPU time while it was measured: "
            "the step is slower than this machine runs it")


_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20, "g": 1e9, "gb": 1e9,
          "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def parse_bytes(value: Any, name: str = "memory_cap", *, strict: bool = True) -> Optional[float]:
    """Bytes from a number or a string such as ``'2 GiB'``, ``'512MB'`` or ``'1e9'``; None stays None.

    A bad value raises a ``ValueError`` naming ``name`` (or gives None when ``strict`` is false).

    Example::

        parse_bytes("2 GiB")     # 2147483648.0
    """
    if value is None:
        return None
    number: Optional[float] = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(digits):]
        try:
            number = float(digits) * _UNITS[unit] if digits else None
        except (ValueError, KeyError):
            number = None
    if number is None or not math.isfinite(number) or number <= 0:
        if not strict:
            return None
        raise ValueError(f"{name} must be a number of bytes > 0 or a size such as '2 GiB' or '512 MiB' (or None for no "
                         f"cap), got {value!r}")
    return number


def plan_difference(plan: Plan, other: Plan) -> str:
    """'' when ``other`` is ``plan``, else what differs (for the measured panel's title)."""
    changes = [f"{name} {theirs} → {ours}" for name, theirs, ours in (
        ("splits", splits_text(other.splits), splits_text(plan.splits)), ("chunks", other.chunks, plan.chunks),
        ("schedule", other.schedule, plan.schedule), ("checkpoint", other.checkpoint, plan.checkpoint),
        ("executor", other.executor, plan.executor), ("mesh", mesh_text(other) or "none", mesh_text(plan) or "none"),
        ("devices", plan_devices_text(other), plan_devices_text(plan)))
        if theirs != ours]
    return ("not the current plan: " + ", ".join(changes)) if changes else ""
