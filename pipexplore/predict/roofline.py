"""Planned layer costs: what each layer would cost on a device the user does not have, by roofline.

Each operator of a layer (counted once per kind of layer, on the meta device or by a dispatch
mode: the *ops* frame) costs the longer of its arithmetic at the device's reachable FLOP/s and
its memory traffic at the device's reachable bandwidth, and its launch. On a GPU of the catalogue
(a kind with :class:`~pipexplore.predict.kernels.GPUKernels`: :func:`~pipexplore.predict.kernels.gpu_kernels`)
as the GPU runs it (:mod:`pipexplore.predict.kernels`): each op's device seconds are::

    device = device_fixed + max(work / (peak[dtype] · eff_flops) + small_kernel, bytes / (bandwidth · eff_bw))

where a GEMM's ``work`` is the FLOPs its tiles and waves spend (≥ its FLOPs: tile and wave
quantisation, split-K, a short ``K``; its shape is the frame's ``gemm_*`` columns) and every other
op's its FLOPs; and the ops of a kind's phase run as the host issues them, ``launch`` seconds each
(:attr:`Efficiency.launch`): an op starts once issued and once the op before it is done, so the
phase takes ``max_j (j · launch + Σ device of ops j…n)`` (:func:`~pipexplore.predict.kernels.issued`) — the host's time
where small kernels outpace it (the launch floor), the device's where long ones leave the host time
to queue the next. On other specs (a CPU's, a custom device with no ``GPUKernels``) the plain roofline::

    seconds = kernel_overhead + max(flops / (peak[dtype] · eff_flops) + small_kernel,
                                    bytes / (bandwidth · eff_bw))

``small_kernel`` (seconds, :attr:`Efficiency.small_kernel`; 0 unless learnt) is what a kernel that
computes pays beyond its FLOPs at the large-kernel rate: the work a small kernel cannot hide (a
GEMM's tile and wave quantisation where its shape is not known, its prologue and epilogue, a CPU GEMM
packing its operands).
Equivalently, a kernel of ``f`` FLOPs reaches the FLOP/s fraction ``eff(f) = eff_flops · f / (f + f½)``
with ``f½ = small_kernel · peak · eff_flops``: half the large-kernel fraction at ``f½`` FLOPs, rising
to it for large kernels. Ops that compute nothing (flops 0) never pay it; an op pays it only where it is
compute-bound (the ``max``).

``overlap`` (:attr:`Efficiency.overlap`; 1 unless learnt) is how much of the shorter of the two
terms hides behind the longer: ``max(c, m) + (1 − overlap) · min(c, m)``. 1 is the roofline (a
GPU streams operands while its tensor cores compute); 0 adds them, as a CPU GEMM does that packs
its weight before it multiplies (a Linear of 32 rows on 2 CPU cores: ~0.4 ms of packing a 4 MB
weight beside 1.3 ms of arithmetic).

The ops frame, one row per operator of each kind and phase:

=============  ==================================================================================
``kind``       the layer kind (what the layer table's ``kind`` column names)
``phase``      ``"forward"`` or ``"backward"``
``op``         the operator (``"aten.mm"``): for reading only
``dtype``      its compute dtype (``"bfloat16"``, ``"float32"``, ``"tf32"``, …)
``flops``      FLOPs at the counted rows; NaN where uncountable (the cost is then unknown: NaN)
``fixed_bytes`` bytes that do not grow with the rows: parameter reads, gradient writes
``row_bytes``  bytes read and written that grow with the rows, at the counted rows
``grad``       optional: ``"input"`` or ``"weight"`` for backward ops (zero-bubble's I and W)
``kernels``    optional: launches per op (default 1; 0 for an op that moves nothing and computes
               nothing: a view)
``collective`` optional: ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"`` or ``"all_to_all"``
               for a collective a tensor-parallel rank runs (its bytes the whole tensor's), ``""``
               for a kernel. A collective costs what NCCL would run over its group's links
               (:func:`pipexplore.predict.collectives.ops_collective_seconds`), not the roofline (on
               a GPU, at least its launch).
``gemm_batch`` optional: a GEMM's shape at the counted rows (``batch × M × N × K``; 0 for other ops)
``gemm_m`` …   and ``gemm_rows``, the one of ``"batch"``, ``"m"``, ``"n"``, ``"k"`` that grows with
``gemm_rows``  the rows (:func:`pipexplore.models.opcount.gemm_rows`): on a GPU a GEMM costs its
               tiles and waves (:mod:`pipexplore.predict.kernels`)
=============  ==================================================================================

``ops.attrs["rows"]``: the rows of the micro-batch it was counted at; flops and row bytes scale
linearly with the rows from there.

Why one module: an op's cost and what is learnt of it are one formula read two ways —
:func:`op_seconds` sums its terms, :func:`fit_efficiency` solves the same terms for the fractions
that reproduce measured kinds — so they change together; how a GPU runs a kernel (tiles, waves,
the host's launches) is :mod:`pipexplore.predict.kernels`'s.

:func:`planned_layer_costs` turns a layer table (one row per layer, a ``kind`` column) into one
the simulator reads exactly as a profiled one (the fit columns, ``t(n) = a + b·n``)::

    spec = device_spec("H100")
    planned = planned_layer_costs(table, ops, spec, batch=256, microbatch_rows=32)
    simulate(planned, splits=[6, 12, 18], chunks=8, schedule="1f1b")
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import pandas as pd

from pipexplore.devices import DeviceSpec, device_spec, dtype_name
from pipexplore.predict.collectives import Group, collectives_of, ops_collective_seconds
from pipexplore.predict.kernels import element_bytes, gemm_work, gpu_kernels, issued, tensor_core_ratio

__all__ = ["OPS_COLUMNS", "Efficiency", "op_seconds", "kind_seconds", "planned_layer_costs", "fit_efficiency"]

#: The columns every ops frame holds (``grad`` and ``kernels`` are optional).
OPS_COLUMNS = ["kind", "phase", "op", "dtype", "flops", "fixed_bytes", "row_bytes"]
PHASES = ("forward", "backward")

SpecLike = Union[str, DeviceSpec]


@dataclass(frozen=True)
class Efficiency:
    """The fraction of a device's peak FLOP/s and of its memory bandwidth that operators reach,
    and the fixed seconds a kernel that computes pays beyond its FLOPs.

    ``flops``: one fraction, or one per dtype name (``{"bfloat16": 0.7, "float32": 0.9}``; the
    dtypes it does not name take the spec's). ``bandwidth``: one fraction. ``None``: the spec's
    defaults (``DeviceSpec.flops_efficiency``, ``bandwidth_efficiency``).
    ``small_kernel``: seconds (≥ 0) added to the arithmetic time of every op that computes
    (``flops > 0``): ``flops / (peak · eff) + small_kernel``, so that small kernels reach less of
    the peak than large ones (the module's docstring). ``None``: 0 — the catalogue's fractions are
    those of large kernels, and no spec says more; :func:`fit_efficiency` learns it.
    ``overlap``: the fraction (0 … 1) of the shorter of an op's arithmetic and memory time that
    hides behind the longer. ``None``: 1, the roofline's ``max``; :func:`fit_efficiency` learns 0
    (the two add) where that fits the measured kinds better.
    ``optimizer``: the fraction of memory bandwidth an optimizer step's kernels reach (several
    operands each, elementwise: :mod:`pipexplore.predict.planned_optimizer`). ``None``: the
    ``bandwidth`` fraction; :func:`~pipexplore.predict.planned_optimizer.optimizer_bandwidth`
    learns it on a device of the kind.
    ``launch``: seconds (≥ 0) every kernel of a GPU costs at least — the host's time to issue it
    (the launch floor of :mod:`pipexplore.predict.kernels`: a framework that spends more of the
    host on each operator raises it). ``None``: the kind's
    :attr:`~pipexplore.predict.kernels.GPUKernels.launch`, else the spec's ``kernel_overhead``.
    Specs without ``GPUKernels`` ignore it.
    """

    flops: Union[None, float, Mapping[str, float]] = None
    bandwidth: Optional[float] = None
    small_kernel: Optional[float] = None
    overlap: Optional[float] = None
    optimizer: Optional[float] = None
    launch: Optional[float] = None

    def __post_init__(self) -> None:
        values = dict(self.flops) if isinstance(self.flops, Mapping) else {"flops": self.flops}
        if isinstance(self.flops, Mapping):
            flops = {dtype_name(k): float(v) for k, v in self.flops.items()}
            object.__setattr__(self, "flops", MappingProxyType(flops))
        for key, value in {**values, "bandwidth": self.bandwidth, "optimizer": self.optimizer}.items():
            if value is not None and not 0 < float(value) <= 2:
                raise ValueError(f"efficiency {key} is a fraction of peak (0 < … ≤ 2), got {value}")
        if self.small_kernel is not None and not (math.isfinite(float(self.small_kernel))
                                                  and float(self.small_kernel) >= 0):
            raise ValueError(f"small_kernel is seconds per kernel (finite, ≥ 0), got {self.small_kernel}")
        if self.overlap is not None and not 0 <= float(self.overlap) <= 1:
            raise ValueError(f"overlap is the fraction of the shorter term hidden (0 … 1), got {self.overlap}")
        if self.launch is not None and not (math.isfinite(float(self.launch)) and float(self.launch) >= 0):
            raise ValueError(f"launch is seconds a kernel costs at least (finite, ≥ 0), got {self.launch}")

    def __hash__(self) -> int:
        flops = tuple(sorted(self.flops.items())) if isinstance(self.flops, Mapping) else self.flops
        return hash((flops, self.bandwidth, self.small_kernel, self.overlap, self.optimizer, self.launch))

    def flops_for(self, dtype: str, spec: DeviceSpec) -> float:
        if isinstance(self.flops, Mapping):
            return float(self.flops.get(dtype_name(dtype), spec.flops_efficiency))
        return float(self.flops) if self.flops is not None else spec.flops_efficiency

    def bandwidth_for(self, spec: DeviceSpec) -> float:
        return float(self.bandwidth) if self.bandwidth is not None else spec.bandwidth_efficiency

    def optimizer_for(self, spec: DeviceSpec) -> float:
        """The fraction of memory bandwidth an optimizer step reaches: as given (learnt), else the
        spec's documented ``optimizer_efficiency``, else ``bandwidth_for``."""
        if self.optimizer is not None:
            return float(self.optimizer)
        return float(spec.optimizer_efficiency) if spec.optimizer_efficiency is not None else self.bandwidth_for(spec)

    def small_kernel_for(self, spec: DeviceSpec) -> float:
        """Seconds per computing kernel beyond its FLOPs: as given, else 0 (no spec says more)."""
        return float(self.small_kernel) if self.small_kernel is not None else 0.0

    def overlap_for(self, spec: DeviceSpec) -> float:
        """The fraction of the shorter term hidden: as given, else 1 (the roofline)."""
        return float(self.overlap) if self.overlap is not None else 1.0

    def launch_for(self, spec: DeviceSpec) -> float:
        """Seconds a GPU kernel costs at least: as given, else the kind's
        :class:`~pipexplore.predict.kernels.GPUKernels` launch, else the spec's ``kernel_overhead``."""
        if self.launch is not None:
            return float(self.launch)
        kernels = gpu_kernels(spec)
        return kernels.launch_for(spec) if kernels is not None else float(spec.kernel_overhead)


def _combined(compute: np.ndarray, memory: np.ndarray, overlap: float) -> np.ndarray:
    """An op's seconds beyond its launch: the longer term and what of the shorter does not hide."""
    return np.maximum(compute, memory) + (1.0 - overlap) * np.minimum(compute, memory)


def _checked(ops: pd.DataFrame) -> float:
    """The rows ``ops`` was counted at, after checking its columns."""
    if not isinstance(ops, pd.DataFrame):
        raise TypeError(f"ops must be a DataFrame of operators, got {type(ops).__name__}")
    missing = [c for c in OPS_COLUMNS if c not in ops]
    if missing:
        raise ValueError(f"the ops frame lacks columns {missing}: it needs {OPS_COLUMNS}")
    rows = ops.attrs.get("rows")
    if rows is None or isinstance(rows, bool) or not np.isfinite(float(rows)) or float(rows) <= 0:
        raise ValueError(f"ops.attrs['rows'] must be the rows the ops were counted at (> 0), got {rows!r}")
    wrong = sorted(set(ops["phase"]) - set(PHASES))
    if wrong:
        raise ValueError(f"ops phases must be 'forward' or 'backward', got {wrong}")
    return float(rows)


def _terms(ops: pd.DataFrame, spec: DeviceSpec, rows: float,
           efficiency: Optional[Efficiency]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per op at ``rows`` rows: the host's seconds to issue it (a GPU kernel's launch; 0 elsewhere),
    the fixed seconds beside its work (a GPU kernel's ``device_fixed``; the spec's ``kernel_overhead``
    elsewhere), its arithmetic seconds (a GEMM's tiles and waves on a GPU, with the small-kernel
    seconds for an op that computes) and its memory seconds, at the efficiency given
    (``Efficiency(1, 1)``: at peak, no small-kernel cost). 0 for a collective (costed over its links)."""
    r0 = _checked(ops)
    eff = efficiency if efficiency is not None else Efficiency()
    scale = float(rows) / r0
    flops = ops["flops"].to_numpy(dtype=float)
    fixed = ops["fixed_bytes"].to_numpy(dtype=float)
    per_row = ops["row_bytes"].to_numpy(dtype=float)
    dtypes = [dtype_name(d) for d in ops["dtype"]]
    rates = {d: spec.peak(d) * eff.flops_for(d, spec) for d in dict.fromkeys(
        d for d, f in zip(dtypes, flops) if not f == 0)}  # an op that computes nothing needs no peak
    rate = np.array([rates.get(d, np.inf) for d in dtypes])
    bandwidth = spec.memory_bandwidth * eff.bandwidth_for(spec)
    work = flops * scale
    extra = np.zeros(len(ops))
    gpu = gpu_kernels(spec)
    if gpu is not None and "gemm_m" in ops:
        work, extra = _gemm_terms(ops, spec, gpu, scale, work, dtypes)
    compute = np.where(flops == 0, 0.0, work / rate + eff.small_kernel_for(spec))
    memory = (fixed + per_row * scale + extra) / bandwidth
    kernels = np.where((flops == 0) & (fixed == 0) & (per_row == 0), 0.0, 1.0)  # a view launches nothing
    if "kernels" in ops:  # where the frame says
        given = ops["kernels"].to_numpy(dtype=float)
        kernels = np.where(np.isnan(given), kernels, given)
    kernel = collectives_of(ops) == ""  # a collective is costed over its links (ops_collective_seconds)
    if gpu is not None:
        host, beside = kernels * eff.launch_for(spec), kernels * gpu.device_fixed
    else:
        host, beside = np.zeros(len(ops)), kernels * spec.kernel_overhead
    return host * kernel, beside * kernel, compute * kernel, memory * kernel


def _gemm_terms(ops: pd.DataFrame, spec: DeviceSpec, gpu: Any, scale: float, work: np.ndarray,
                dtypes: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """``work`` with each GEMM's FLOPs as its tiles and waves spend them at the rows (its dimension
    ``gemm_rows`` scaled by ``scale``), and the extra bytes of its split-K (0 for other ops). The
    tile and split are those fastest at the spec's documented fractions (a library's heuristic
    knows the device, not what was learnt of it), so that the seconds stay linear in the
    reciprocals of the fractions :func:`fit_efficiency` learns."""
    dims = {d: ops[f"gemm_{d}"].fillna(0).to_numpy(dtype=float) for d in ("batch", "m", "n", "k")}
    grows = ops["gemm_rows"].fillna("").astype(str).to_numpy() if "gemm_rows" in ops else np.full(len(ops), "")
    gemm = (dims["m"] > 0) & (dims["n"] > 0) & (dims["k"] > 0) & np.isfinite(work) & (work > 0)
    extra = np.zeros(len(ops))
    if not gemm.any():
        return work, extra
    for d in dims:
        dims[d] = np.where(grows == d, dims[d] * scale, dims[d])
    element = np.array([element_bytes(d) for d in dtypes])
    ratio = np.array([tensor_core_ratio(spec, d) if g else 1.0 for d, g in zip(dtypes, gemm)])
    rate = np.array([spec.peak(d) * spec.flops_efficiency if g else 1.0 for d, g in zip(dtypes, gemm)])
    spent, moved = gemm_work(dims["batch"][gemm], dims["m"][gemm], dims["n"][gemm], dims["k"][gemm], gpu,
                             rate[gemm], spec.memory_bandwidth * spec.bandwidth_efficiency, element[gemm], ratio[gemm])
    work = work.copy()
    work[gemm] = spent
    extra[gemm] = moved
    return work, extra


def op_seconds(ops: pd.DataFrame, spec: SpecLike, rows: float, *,
               efficiency: Optional[Efficiency] = None, group: Optional[Group] = None) -> pd.Series:
    """Each operator's seconds on ``spec`` at a micro-batch of ``rows`` rows (index of ``ops``):
    ``kernel_overhead + max(flops·(rows/r0) / (peak[dtype]·eff_flops) + small_kernel, (fixed_bytes +
    row_bytes·(rows/r0)) / (bandwidth·eff_bw))``, with ``r0 = ops.attrs["rows"]`` (``small_kernel`` only
    where ``flops > 0``; 0 by default), plus ``1 − overlap`` of the shorter term (0 by default). NaN
    where the flops (or bytes) are NaN. A collective (``collective`` column) costs the ring over
    ``group``'s links instead, its bytes the whole tensor's at ``rows``.

    On a GPU with :class:`~pipexplore.predict.kernels.GPUKernels` each op's device seconds are
    ``device_fixed + max(…)`` (a GEMM's FLOPs as its tiles and waves spend them), and the ops of a
    kind's phase run as the host issues them (:func:`~pipexplore.predict.kernels.issued`): an op's seconds are what it adds
    to its phase's end, its wait for the host included.

    Raises:
        ValueError: the frame lacks a column or ``attrs["rows"]``, an op's dtype has no peak
            on the device (float8 on an A100), or it has collectives and no ``group``.
    """
    spec = device_spec(spec)
    eff = efficiency if efficiency is not None else Efficiency()
    host, beside, compute, memory = _terms(ops, spec, rows, efficiency)
    comm = ops_collective_seconds(ops, rows, group)
    device = beside + _combined(compute, memory, eff.overlap_for(spec)) + comm
    if gpu_kernels(spec) is None:
        return pd.Series(device, index=ops.index, name="seconds")
    host = host + np.where((collectives_of(ops) != "") & (comm > 0), eff.launch_for(spec), 0.0)  # issued too
    return pd.Series(issued(_phase_groups(ops), host, device), index=ops.index, name="seconds")


def _phase_groups(ops: pd.DataFrame) -> np.ndarray:
    """Each op's (kind, phase), as one code."""
    pairs = ops["kind"].astype(str).to_numpy().astype(object) + "\x00" + ops["phase"].astype(str).to_numpy().astype(object)
    return pd.factorize(pairs, sort=False)[0]


def _sum_by_kind(ops: pd.DataFrame, seconds: np.ndarray) -> pd.DataFrame:
    """Per kind (in order of appearance) and phase, the sum of ``seconds`` (NaN if any is NaN; 0
    for a phase without ops)."""
    codes, kinds = pd.factorize(ops["kind"].to_numpy(), sort=False)
    phases = ops["phase"].to_numpy()
    values = np.asarray(seconds, dtype=float)
    out = np.zeros((len(kinds), len(PHASES)))
    for j, phase in enumerate(PHASES):
        mask = phases == phase
        out[:, j] = np.bincount(codes[mask], weights=values[mask], minlength=len(kinds))  # NaN where any is
    frame = pd.DataFrame(out, index=pd.Index(kinds, name="kind"), columns=list(PHASES))
    return frame.astype(float)


def kind_seconds(ops: pd.DataFrame, spec: SpecLike, rows: float, *,
                 efficiency: Optional[Efficiency] = None, group: Optional[Group] = None) -> pd.DataFrame:
    """Per layer kind (index ``kind``): ``forward`` and ``backward`` seconds at ``rows`` rows, the
    sums of :func:`op_seconds` (NaN where any op is; 0 for a phase with no ops)."""
    return _sum_by_kind(ops, op_seconds(ops, spec, rows, efficiency=efficiency, group=group).to_numpy())


def _sizes(microbatch_rows: Union[int, Sequence[int]], batch: int) -> list[int]:
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
        raise ValueError(f"batch must be a positive number of rows, got {batch!r}")
    given = [microbatch_rows] if isinstance(microbatch_rows, (int, np.integer)) else list(microbatch_rows)
    if not given or any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= batch
                        for n in given):
        raise ValueError(f"microbatch_rows must lie in 1…{batch} (the batch's rows), got {microbatch_rows!r}")
    return sorted({int(n) for n in given} | {int(batch)})


def _grad_ratios(ops: pd.DataFrame, seconds: np.ndarray, kinds: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Per kind: the shares of its backward seconds that produce input and weight gradients (ops
    marked ``grad == "weight"`` are the weight pass, the others the input pass); 0.5 each where the
    frame does not say (no ``grad`` column) or the kind has no backward."""
    half = np.full(len(kinds), 0.5)
    if "grad" not in ops:
        return half, half.copy()
    backward = (ops["phase"] == "backward").to_numpy()
    weight = (ops["grad"].astype(str).str.lower() == "weight").to_numpy()
    frame = pd.DataFrame({"kind": ops["kind"].to_numpy(), "all": np.where(backward, seconds, 0.0),
                          "weight": np.where(backward & weight, seconds, 0.0)})
    sums = frame.groupby("kind", sort=False)[["all", "weight"]].sum().reindex(list(kinds))
    total, w = sums["all"].to_numpy(dtype=float), sums["weight"].to_numpy(dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        w_ratio = np.where(total > 0, w / total, 0.5)
    i_ratio = np.where(total > 0, 1.0 - w_ratio, 0.5)
    return i_ratio, w_ratio


def planned_layer_costs(table: pd.DataFrame, ops: pd.DataFrame, spec: SpecLike, *, batch: int,
                        microbatch_rows: Union[int, Sequence[int]],
                        efficiency: Optional[Efficiency] = None, group: Optional[Group] = None) -> pd.DataFrame:
    """``table`` (one row per layer, a ``kind`` column naming kinds of ``ops``) with the cost
    columns the simulator reads, from the roofline on ``spec``: planned layers predict exactly
    like profiled ones (:func:`pipexplore.predict.costs.layer_seconds`).

    ``forward_a``/``forward_b``/``backward_a``/``backward_b``: per layer the line ``t(n) = a + b·n``
    through its kind's roofline seconds at the sizes ``microbatch_rows`` and ``batch`` — exactly
    through both points with two sizes, by least squares with more; with one (``microbatch_rows
    == batch``) through it and the roofline at zero rows (launches and fixed bytes). The roofline is
    piecewise linear in the rows (an op turns compute-bound as it grows), so between and beyond the
    fitted sizes the line approximates it; ``a`` may come out negative where small sizes are
    bandwidth-bound and large ones compute-bound. ``forward``/``backward``: seconds at the whole
    ``batch``. ``share_forward = share_backward = 1`` (a GPU kernel holds its device),
    ``input_grad_ratio``/``weight_grad_ratio`` from the ops' ``grad`` marks at the first size
    (0.5 each where unmarked), ``checkpointed_ratio`` 1, ``spread`` 0. The table's byte columns
    (``output_bytes``, ``saved_bytes``, ``param_bytes``, …) are kept as given.

    An ops frame counted on a tensor-parallel rank (:mod:`pipexplore.models.sharded`) holds its
    collectives: each costs the ring over ``group`` (the tensor-parallel group's links), on the
    critical path of its phase as Megatron-LM's and torch's tensor parallelism run them; the
    columns ``forward_comm``/``backward_comm`` hold those seconds at the whole ``batch`` (their
    share of ``forward``/``backward``).

    ``attrs``: ``batch``, ``rows`` (the sizes), ``device_spec`` (the spec's name), ``source = "planned"``.

    Raises:
        ValueError: the table lacks a ``kind`` column or names kinds the ops frame does not have.
    """
    spec = device_spec(spec)
    if "kind" not in table:
        raise ValueError("the layer table needs a 'kind' column naming each layer's kind in the ops frame")
    _checked(ops)
    # (a kind the count saw run no operator, ``ops.attrs["kinds"]``, costs nothing: a dropout of p = 0)
    operating = set(ops["kind"])
    known = operating | set(ops.attrs.get("kinds", ()))
    unknown = [k for k in dict.fromkeys(table["kind"]) if k not in known]
    if unknown:
        raise ValueError(f"layer kinds {unknown} are not in the ops frame (it has {sorted(map(str, known))})")
    sizes = _sizes(microbatch_rows, batch)
    points = sizes if len(sizes) > 1 else [0, sizes[0]]
    per_size = [kind_seconds(ops, spec, n, efficiency=efficiency, group=group) for n in points]
    kinds = list(per_size[0].index)
    x = np.asarray(points, dtype=float)
    out = table.copy()
    layer_kind = out["kind"].to_numpy()
    idle = ~np.isin(layer_kind, list(operating))  # layers whose kind runs no operator
    for phase in PHASES:
        t = np.stack([frame[phase].to_numpy(dtype=float) for frame in per_size], axis=1)  # kinds × sizes
        if len(points) == 2:
            b = (t[:, 1] - t[:, 0]) / (x[1] - x[0])
            a = t[:, 0] - b * x[0]
        else:
            design = np.stack([np.ones_like(x), x], axis=1)
            a, b = np.full(len(kinds), np.nan), np.full(len(kinds), np.nan)
            finite = np.isfinite(t).all(axis=1)
            if finite.any():
                coef, *_ = np.linalg.lstsq(design, t[finite].T, rcond=None)
                a[finite], b[finite] = coef[0], coef[1]
        fit_a, fit_b = pd.Series(a, index=kinds), pd.Series(b, index=kinds)
        out[f"{phase}_a"] = np.where(idle, 0.0, fit_a.reindex(layer_kind).to_numpy())
        out[f"{phase}_b"] = np.where(idle, 0.0, fit_b.reindex(layer_kind).to_numpy())
        out[phase] = out[f"{phase}_a"] + out[f"{phase}_b"] * batch
    out["share_forward"] = 1.0
    out["share_backward"] = 1.0
    first = op_seconds(ops, spec, sizes[0], efficiency=efficiency, group=group).to_numpy()
    comm = _sum_by_kind(ops, ops_collective_seconds(ops, batch, group))
    for phase in PHASES:
        out[f"{phase}_comm"] = np.where(idle, 0.0, comm[phase].reindex(layer_kind).fillna(0.0).to_numpy())
    i_ratio, w_ratio = _grad_ratios(ops, first, kinds)
    out["input_grad_ratio"] = np.where(idle, 0.5, pd.Series(i_ratio, index=kinds).reindex(layer_kind).to_numpy())
    out["weight_grad_ratio"] = np.where(idle, 0.5, pd.Series(w_ratio, index=kinds).reindex(layer_kind).to_numpy())
    out["checkpointed_ratio"] = 1.0
    out["spread"] = 0.0
    out.attrs = {**table.attrs, "batch": int(batch), "rows": tuple(sizes), "device_spec": spec.name,
                 "source": "planned"}
    return out


def fit_efficiency(ops: pd.DataFrame, measured_kind_seconds: Union[pd.DataFrame, Mapping[float, pd.DataFrame]],
                   spec: SpecLike, rows: Optional[float] = None, *, per_dtype: bool = False,
                   small_kernel: bool = True, additive: bool = True, launch: bool = True,
                   iterations: int = 25) -> Efficiency:
    """The efficiency that makes the roofline reproduce measured kinds: what a device of the same
    kind present here teaches the catalogue.

    ``measured_kind_seconds``: indexed by kind, ``forward`` and/or ``backward`` seconds measured
    at a micro-batch of ``rows`` rows (NaN: not measured); or, for several sizes, a mapping
    ``{rows: frame}`` (``rows`` then left out). Each measured (kind, phase, size) says
    ``measured − launches = Σ flops/peak · (1/eff_flops) + k · small_kernel + Σ bytes/bandwidth · (1/eff_bw)``
    (the first sum over its ``k`` compute-bound ops, the last over its bandwidth-bound ones), linear
    in the two reciprocals and the small-kernel seconds once each op is classified: least squares
    over the relative errors (each row divided by its measured seconds), then the ops reclassified
    with the new values, until the classification holds. A fraction no measured op depends on
    keeps the spec's default. The two fractions are learnt first alone, then with the small-kernel
    seconds from there; these are kept only where they lower the fit's error (the sum of squared
    relative errors of the roofline itself), so they stay 0 (``None``) where no measured op
    computes, where they come out negative, where the measurements cannot tell them from the
    FLOP/s fraction (every measured kind's FLOPs in proportion to its compute-bound kernels: one
    size of one kernel shape — measure kinds of several sizes, two micro-batch sizes at least),
    or where they do not fit better.
    ``per_dtype``: one FLOP/s fraction per dtype the compute-bound ops use. ``small_kernel=False``:
    learn the fractions only (the small-kernel seconds 0, as before they were modelled).
    ``additive``: also fit the form where each op's arithmetic and memory time add (``overlap`` 0:
    every op's FLOPs and bytes in its row, linear without classifying), and keep it, with its own
    fractions, where its error is lower than the roofline's (``overlap`` then 0, else ``None``).
    ``launch``: on a GPU with :class:`~pipexplore.predict.kernels.GPUKernels`, also learn the host's
    seconds to issue a kernel (:attr:`Efficiency.launch`) with the fractions: a phase whose small
    kernels wait for the host ends at ``j · launch + Σ device seconds of ops j…n``, linear in it
    once the op that waited last is found (reclassified with the rest); learnt only where some
    measured phase waits for the host beyond its first kernel, else the kind's default stands.

    Example::

        table = pipexplore.profile(model, sample)      # a sample of `rows` rows, on an H100 here
        measured = table.assign(kind=kinds).groupby("kind")[["forward", "backward"]].median()
        learnt = fit_efficiency(ops, measured, "H100", rows)     # ops: the same kinds, counted
        planned_layer_costs(table, ops, "H100", batch=…, microbatch_rows=…, efficiency=learnt)
    """
    spec = device_spec(spec)
    if isinstance(measured_kind_seconds, Mapping):
        sizes = {float(n): frame for n, frame in measured_kind_seconds.items()}
    elif rows is None:
        raise ValueError("fit_efficiency needs the rows the kinds were measured at (or a mapping {rows: frame})")
    else:
        sizes = {float(rows): measured_kind_seconds}
    kinds = ops["kind"].to_numpy()
    phases = ops["phase"].to_numpy()
    dtypes = np.array([dtype_name(d) for d in ops["dtype"]])
    computes = (ops["flops"].to_numpy(dtype=float) != 0)  # the ops that can pay the small-kernel seconds
    # One entry per measured (kind, phase, size): the kernels its ops issue (in the order they run),
    # their fixed, arithmetic and memory seconds at peak, their FLOP/s groups, which compute, and the
    # measured seconds.
    launch_seconds = Efficiency(1.0, 1.0).launch_for(spec) if gpu_kernels(spec) is not None else 0.0
    entries: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, float]] = []
    for n, frame in sizes.items():
        host, beside, compute, memory = _terms(ops, spec, n, Efficiency(1.0, 1.0))
        for kind in frame.index:
            for phase in PHASES:
                value = float(frame.at[kind, phase]) if phase in frame else math.nan
                mask = (kinds == kind) & (phases == phase)
                if not (np.isfinite(value) and value > 0 and mask.any()):
                    continue
                if np.isfinite(compute[mask]).all() and np.isfinite(memory[mask]).all():
                    issues = host[mask] / launch_seconds if launch_seconds > 0 else np.zeros(int(mask.sum()))
                    entries.append((issues, beside[mask], compute[mask], memory[mask], dtypes[mask],
                                    computes[mask], value))
    if not entries:
        raise ValueError("no measured kind to learn from: measured_kind_seconds names no kind of the ops frame "
                         "with a finite, positive forward or backward")
    groups = sorted({d for _, _, c, _, g, _, _ in entries for d in g[c > 0]}) if per_dtype else ["all"]
    # The reciprocals of the fractions, from the defaults, no small-kernel seconds, the kind's launch.
    start = np.array([*(1.0 / spec.flops_efficiency for _ in groups), 1.0 / spec.bandwidth_efficiency, 0.0,
                      launch_seconds])
    ky, ks, kl = len(groups), len(groups) + 1, len(groups) + 2
    best: Optional[tuple[np.ndarray, set[int], float, float]] = None
    for overlap in (1.0, 0.0) if additive else (1.0,):
        values, learnt, residual = _solve(entries, groups, per_dtype, start, False, iterations, overlap, launch)
        if small_kernel:  # the fractions alone, then the small-kernel seconds with them: kept where they fit better
            joint = _solve(entries, groups, per_dtype, values, True, iterations, overlap, launch)
            if joint[2] < residual and joint[0][ks] > 0:
                values, learnt, residual = joint[0], learnt | joint[1], joint[2]
        if best is None or residual < best[2] - max(1e-12, 1e-6 * best[2]):  # (a tie keeps the roofline)
            best = (values, learnt, residual, overlap)
    assert best is not None
    values, learnt, _, overlap = best
    # A fraction nothing measured depends on keeps the spec's default (exactly).
    flops = {g: 1.0 / values[k] for k, g in enumerate(groups) if k in learnt}
    return Efficiency(flops=flops if per_dtype else flops.get("all", spec.flops_efficiency),
                      bandwidth=1.0 / values[ky] if ky in learnt else spec.bandwidth_efficiency,
                      small_kernel=float(values[ks]) if ks in learnt and values[ks] > 0 else None,
                      overlap=None if overlap == 1.0 else overlap,
                      launch=float(values[kl]) if kl in learnt else None)


def _solve(entries: list, groups: list[str], per_dtype: bool, start: np.ndarray, small_kernel: bool,
           iterations: int, overlap: float = 1.0, launch: bool = False) -> tuple[np.ndarray, set[int], float]:
    """:func:`fit_efficiency`'s alternation from ``start`` (the FLOP/s reciprocals per group, the
    bandwidth's, the small-kernel seconds, the launch): classify the ops, solve the linear least squares,
    until the classification holds. The values, the columns learnt, and the sum of the squared
    relative errors of the model (the ``max``, not its linearisation) at the values. ``overlap``
    is 1 (the roofline) or 0 (every op counts both its terms). Where a GPU's host issues the ops
    (:func:`~pipexplore.predict.kernels.issued`), a phase ends at ``H_j + Σ_{k ≥ j} device_k`` for the ``j`` that waited last
    for the host: the ops before it hide behind the host's time, classified so; ``j`` (the kernels
    issued by then) is the launch's coefficient."""
    # the columns of the bandwidth reciprocal, the small-kernel seconds and the launch
    ky, ks, kl = len(groups), len(groups) + 1, len(groups) + 2
    current = np.array(start, dtype=float)
    previous, learnt = None, set()

    def times(issues, beside, compute, memory, group, does, value):  # type: ignore[no-untyped-def]
        of = group if per_dtype else np.full(len(group), "all")
        factor = np.array([current[groups.index(g)] if g in groups else 1.0 for g in of])
        arithmetic = compute * factor + np.where(does, current[ks], 0.0)
        return of, arithmetic, memory * current[ky]

    for _ in range(iterations):
        design, target, bounds = [], [], []
        for issues, beside, compute, memory, group, does, value in entries:
            of, arithmetic, traffic = times(issues, beside, compute, memory, group, does, value)
            device = beside + _combined(arithmetic, traffic, overlap)
            issued_by = np.cumsum(issues)
            issue = issued_by * current[kl]
            last = int(np.argmax(issue - (np.cumsum(device) - device)))  # the op that waited last for the host
            live = np.arange(len(device)) >= last  # the ops that end the phase; those before hide
            bound = arithmetic >= traffic  # the compute-bound ops
            additive = np.ones_like(bound)  # with overlap 0 every op counts its arithmetic and its traffic
            if overlap == 0.0:
                bound = additive
            bounds.append(np.concatenate([bound, live]))
            traffic_of = (additive if overlap == 0.0 else ~bound) & live
            bound = bound & live
            row = [float(compute[bound & (of == g)].sum()) for g in groups] + [float(memory[traffic_of].sum()),
                                                                              float((bound & does).sum()),
                                                                              float(issued_by[last])]
            design.append(np.array(row) / value)
            target.append((value - float(beside[live].sum())) / value)
        classified = np.concatenate(bounds)
        if previous is not None and np.array_equal(classified, previous):
            break
        previous = classified
        A, t = np.array(design), np.array(target)
        waits = (A[:, kl] * np.array([e[-1] for e in entries]) > 1.0 + 1e-9).any()  # beyond a phase's first kernel
        used = [k for k in range(kl + 1) if A[:, k].any() and (small_kernel or k != ks) and (k != kl or (launch
                                                                                                        and waits))]
        for k in (ks, kl):  # what the data cannot tell from the FLOP/s fraction (or each other) stays as it is
            if k in used and _rank_deficient(A[:, used]):
                used.remove(k)
        fixed = [k for k in range(kl + 1) if k not in used]
        while used:
            rhs = t - A[:, fixed] @ current[fixed] if fixed else t
            solution, *_ = np.linalg.lstsq(A[:, used], rhs, rcond=None)
            # A reciprocal below 0.5 is above 2× peak, negative seconds are no cost: not physical.
            bad = [k for k, v in zip(used, solution) if not (v >= 0 if k in (ks, kl) else v > 0.5)]
            if not bad:
                current[used] = solution
                break
            if ks in bad:
                current[ks] = 0.0
            used = [k for k in used if k not in bad]
            fixed = sorted(fixed + bad)
        learnt |= set(used)
    residual = 0.0
    for entry in entries:
        _, arithmetic, traffic = times(*entry)
        value = entry[-1]
        seconds = issued(np.zeros(len(arithmetic), dtype=int), entry[0] * current[kl],
                         entry[1] + _combined(arithmetic, traffic, overlap))
        residual += (float(seconds.sum()) / value - 1.0) ** 2
    return current, learnt, residual


def _rank_deficient(design: np.ndarray) -> bool:
    """Whether some column of ``design`` is (numerically) a combination of the others: its columns
    scaled to unit length, the smallest singular value below 1e-9 of the largest."""
    if design.shape[0] < design.shape[1]:
        return True
    scaled = design / np.linalg.norm(design, axis=0)
    singular = np.linalg.svd(scaled, compute_uv=False)
    return not singular[-1] > 1e-9 * singular[0]
