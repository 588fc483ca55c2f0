"""Kernels as a GPU runs them: a matmul's cost from its shape (tiles, waves), each kernel's launch,
memory-bound operators at a fraction of the memory's bandwidth — per kind of GPU.

**A GEMM** ``C[M, N] = A[M, K] · B[K, N]`` (``batch`` of them for a batched GEMM) runs as NVIDIA's
"Matrix Multiplication Background User's Guide" describes it
(https://docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication/index.html):
``C`` is cut into tiles of ``Mt × Nt``, each computed by one thread block (CTA) on one
streaming multiprocessor (SM); the tiles run in *waves* of as many as the SMs hold at once, and
a wave that is not full costs as long as a full one (*wave quantisation*); a tile that hangs over
the edge of ``C`` computes as much as a whole one (*tile quantisation*). Larger tiles reuse each
operand byte more, so they run closer to the SM's peak; cuBLAS and CUTLASS
(https://github.com/NVIDIA/cutlass/blob/main/media/docs/efficient_gemm.md) pick the tile among a
few shapes (256×128 … 64×64) and, where the tiles are too few to fill the SMs, split ``K`` across
CTAs (*split-K*: each CTA a slice of ``K``, the fp32 partial sums reduced after). Here each
candidate (tile, split) is costed and the fastest taken, as a good heuristic would::

    tiles  = batch · ⌈M / Mt⌉ · ⌈N / Nt⌉ · split          slots = SMs · ctas (CTAs an SM holds at once)
    waves  = ⌈tiles / slots⌉
    work   = waves · slots · 2 · Mt · Nt · (⌈K / split⌉ + tile_k) / reuse(Mt, Nt)      (FLOPs, as the device spends them)
    bytes  = the operands and the output once, + 2 · 4 · split · batch · M · N for split > 1 (the partial sums)
    GEMM s = device_fixed + max(work / (peak[dtype] · eff_flops), bytes / (bandwidth · eff_bw))

``tile_k`` (K-equivalent) is what a tile pays beyond its main loop — filling the software
pipeline, writing the tile out — so a GEMM with a short ``K`` (attention's scores, ``K`` = the head
dimension) stays far below peak. ``reuse(Mt, Nt) = min(1, (2·Mt·Nt / ((Mt + Nt)·bytes)) /
tile_reuse)``: the FLOPs a tile makes of each operand byte it loads, against what an SM needs to
run at its peak from L2 (``tile_reuse``); larger tiles are at 1, 64×64 below. ``eff_flops`` is the
fraction of peak a large GEMM reaches (the catalogue's ``flops_efficiency``, or learnt:
:class:`pipexplore.predict.roofline.Efficiency`): a GEMM large in every dimension is at that
rate, a small one (few tiles, a partial wave, short ``K``) far below.

**Every kernel** takes on the device a fixed time beyond its work (``device_fixed``: start,
drain), and the host's time to issue it (``launch``): the device runs a kernel once the host has
issued it and once the kernel before it is done, so where kernels are shorter than their launch
the device waits for the host (the launch floor), and where they are longer the host queues the
next ones meanwhile (:func:`issued`)::

    kernel seconds (on the device) = device_fixed + max(arithmetic, memory)
    a phase of kernels 1…n         = max_j (j · launch + Σ kernel seconds of j…n)

**Memory-bound operators** (elementwise, softmax, layernorm, dropout) are the ``memory`` term:
their bytes at the fraction ``eff_bw`` of HBM's bandwidth (the catalogue's
``bandwidth_efficiency``, or learnt). :mod:`pipexplore.predict.roofline` costs every operator of
a catalogue GPU so (:func:`gpu_kernels` says which kinds have a :class:`GPUKernels`); devices of
this machine and specs without one keep the plain roofline.

Example::

    gemm_work(1, 1024, 768, 2048, gpu_kernels("A100-80GB"), 312e12 * 0.8)
    # (3.85e9 FLOPs spent for 3.2e9 counted: 48 tiles of 128×128 would fill 48 of the 108 SMs; K split in two)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np

from pipexplore.devices import DeviceSpec, device_spec, dtype_name

__all__ = ["GPUKernels", "KERNELS", "TILES", "gpu_kernels", "issued", "register_gpu_kernels", "gemm_work",
           "gemm_seconds", "waves"]

#: CTA tiles ``(Mt, Nt)`` of tensor-core GEMMs that cuBLAS and CUTLASS choose among (CUTLASS's
#: default threadblock shapes for Ampere and Hopper; the guide's 256×128 … 64×64).
TILES: tuple[tuple[int, int], ...] = ((256, 128), (128, 256), (128, 128), (256, 64), (64, 256), (128, 64),
                                      (64, 128), (64, 64))
#: Splits of ``K`` considered (1: none).
SPLITS: tuple[int, ...] = (1, 2, 3, 4, 6, 8)
#: A tile of at least this area holds an SM alone; smaller ones share it (2 of 128×64, 4 of 64×64).
_SM_AREA = 128 * 128


@dataclass(frozen=True)
class GPUKernels:
    """How one kind of GPU runs kernels (the module docstring's terms).

    ``sms``: streaming multiprocessors (compute units) of the device as sold. ``tile_reuse``: FLOPs an
    SM must make of each operand byte it loads from L2 to run at its 16-bit tensor-core peak (other
    dtypes in proportion to their peak). ``tile_k``: the K-equivalent a tile pays beyond its main
    loop. ``device_fixed``: seconds a kernel takes on the device beyond its work. ``launch``:
    seconds the host takes to issue a kernel — a run of kernels shorter than it takes that long
    each, the launch floor (None: the spec's ``kernel_overhead``; a framework's own is learnt:
    :attr:`pipexplore.predict.roofline.Efficiency.launch`). ``tiles``, ``splits``: the tile shapes
    and K splits a GEMM chooses among.
    ``source``: where the numbers come from.
    """

    name: str
    sms: int
    tile_reuse: float = 43.2
    tile_k: float = 64.0
    device_fixed: float = 2e-6
    launch: Optional[float] = None
    tiles: tuple[tuple[int, int], ...] = TILES
    splits: tuple[int, ...] = SPLITS
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.sms, bool) or not isinstance(self.sms, int) or self.sms < 1:
            raise ValueError(f"{self.name}: sms is a whole number of streaming multiprocessors from 1, got {self.sms!r}")
        for key in ("tile_reuse", "tile_k", "device_fixed"):
            value = getattr(self, key)
            if not (math.isfinite(float(value)) and float(value) >= 0):
                raise ValueError(f"{self.name}: {key} must be a finite number ≥ 0, got {value!r}")
        if self.launch is not None and not (math.isfinite(float(self.launch)) and float(self.launch) >= 0):
            raise ValueError(f"{self.name}: launch is seconds a kernel (≥ 0) or None, got {self.launch!r}")
        if not self.tiles or any(len(t) != 2 or min(t) < 1 for t in self.tiles):
            raise ValueError(f"{self.name}: tiles are (Mt, Nt) pairs of positive sizes, got {self.tiles!r}")
        if not self.splits or any(int(s) < 1 for s in self.splits):
            raise ValueError(f"{self.name}: splits are whole numbers from 1, got {self.splits!r}")

    def launch_for(self, spec: DeviceSpec) -> float:
        """Seconds the host takes to issue a kernel: as given, else the spec's ``kernel_overhead``."""
        return float(self.launch) if self.launch is not None else float(spec.kernel_overhead)


_GUIDE = "https://docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication/index.html"
#: A100's tile reuse, from its whitepaper (https://images.nvidia.com/aem-dam/en-zz/Solutions/data-center/
#: nvidia-ampere-architecture-whitepaper.pdf): 108 SMs at 1,410 MHz boost, L2 read bandwidth 5,120
#: bytes a clock: 66.8 GB/s an SM against 312 TFLOP/s / 108 = 2.89 TFLOP/s an SM (16-bit, dense): 43.2
#: FLOPs a byte. A 128×64 tile of 16-bit operands makes 42.7, a 64×64 one 32 (74 % of the rate).
_A100_REUSE = 312e12 / 108 / (5120 * 1.41e9 / 108)

#: The kinds the catalogue holds. ``tile_k`` (64: two k-slices of 32, a pipeline's fill and the
#: epilogue) and ``device_fixed`` (2 µs: an empty kernel's start and drain on the device) are
#: assumptions, the same on every kind; the launch floor is the spec's ``kernel_overhead`` (what eager
#: PyTorch pays the host per operator) unless learnt.
KERNELS: dict[str, GPUKernels] = {
    "A100-40GB": GPUKernels("A100-40GB", 108, _A100_REUSE,
                            source="108 SMs: NVIDIA A100 Tensor Core GPU Architecture whitepaper; tiles and waves: "
                                   + _GUIDE),
    "A100-80GB": GPUKernels("A100-80GB", 108, _A100_REUSE,
                            source="108 SMs: NVIDIA A100 Tensor Core GPU Architecture whitepaper; tiles and waves: "
                                   + _GUIDE),
    # H100 SXM5: 132 SMs (NVIDIA H100 Tensor Core GPU Architecture whitepaper,
    # https://resources.nvidia.com/en-us-tensor-core/gtc22-whitepaper-hopper); the tile reuse is
    # assumed the A100's (no L2 bandwidth is published; Hopper's clusters multicast operands to
    # the CTAs that share them, halving what each loads, as its tensor cores double an SM's rate).
    "H100": GPUKernels("H100", 132, _A100_REUSE,
                       source="132 SMs (H100 SXM5): NVIDIA H100 Tensor Core GPU Architecture whitepaper; tiles and "
                              "waves: " + _GUIDE),
    # H200: the H100's GH100 with 132 SMs and faster memory (https://www.nvidia.com/en-us/data-center/h200/).
    "H200": GPUKernels("H200", 132, _A100_REUSE,
                       source="132 SMs (GH100 as in H100 SXM5); tiles and waves: " + _GUIDE),
    # L4: AD104 with 7,424 CUDA cores, 128 an SM (NVIDIA Ada GPU Architecture whitepaper): 58 SMs.
    "L4": GPUKernels("L4", 58, _A100_REUSE,
                     source="58 SMs (7,424 CUDA cores, 128 an SM: NVIDIA Ada GPU Architecture whitepaper); tiles "
                            "and waves: " + _GUIDE),
    # MI300X: 304 compute units (AMD Instinct MI300X data sheet); hipBLASLt's tiles taken as cuBLAS's.
    "MI300X": GPUKernels("MI300X", 304, _A100_REUSE,
                         source="304 compute units: AMD Instinct MI300X data sheet; tiles and waves as " + _GUIDE),
}


def register_gpu_kernels(name: str, kernels: GPUKernels, *, replace: bool = False) -> GPUKernels:
    """Say how a device spec named ``name`` (a custom one: :func:`pipexplore.devices.register_device`)
    runs kernels — a catalogue kind's :class:`GPUKernels` for a variant of it (the same GPU with
    other links, say). Its operators are then costed as the module docstring says.

    Raises:
        ValueError: ``name`` already has another one (``replace=True`` replaces it).
    """
    if not isinstance(kernels, GPUKernels):
        raise TypeError(f"register_gpu_kernels needs a GPUKernels, got {type(kernels).__name__}")
    if name in KERNELS and KERNELS[name] != kernels and not replace:
        raise ValueError(f"{name!r} already runs kernels as {KERNELS[name]}; replace=True replaces it")
    KERNELS[name] = kernels
    return kernels


def gpu_kernels(spec: Union[str, DeviceSpec]) -> Optional[GPUKernels]:
    """How the device ``spec`` (a spec or its catalogue name) runs kernels — a node variant's
    (``DeviceSpec.chip``) as its chip's; None where nothing says (a spec of this machine's CPU, a
    custom device never registered here): the plain roofline."""
    name = spec.name if isinstance(spec, DeviceSpec) else str(spec)
    if name in KERNELS:
        return KERNELS[name]
    if isinstance(spec, str):
        try:
            spec = device_spec(spec)
        except ValueError:
            return None
    return KERNELS.get(spec.name) or (KERNELS.get(spec.chip) if spec.chip else None)  # (a node variant: its chip's)


def waves(tiles: Union[int, np.ndarray], slots: int) -> np.ndarray:
    """Waves of ``tiles`` over ``slots`` tiles at once: ``⌈tiles / slots⌉`` (a partial wave is a wave)."""
    return np.ceil(np.asarray(tiles, dtype=float) / slots)


def _reuse(mt: int, nt: int, element_bytes: np.ndarray, needed: np.ndarray) -> np.ndarray:
    """The fraction of an SM's rate a tile of ``mt × nt`` reaches by its operand reuse."""
    made = 2.0 * mt * nt / ((mt + nt) * element_bytes)
    return np.minimum(1.0, made / needed)


def gemm_work(batch: Union[float, np.ndarray], m: Union[float, np.ndarray], n: Union[float, np.ndarray],
              k: Union[float, np.ndarray], kernels: GPUKernels, rate: Union[float, np.ndarray],
              bandwidth: float = math.inf, element_bytes: Union[float, np.ndarray] = 2.0,
              reference_peak: Union[float, np.ndarray, None] = None) -> tuple[np.ndarray, np.ndarray]:
    """The FLOPs the device spends on each GEMM of ``batch × (m × n × k)`` (tiles and waves as the
    module docstring says: ≥ ``2·batch·m·n·k``) and the extra bytes its split-K moves, for the
    fastest (tile, split) at ``rate`` FLOP/s (the reachable rate: peak × the large-GEMM fraction)
    and ``bandwidth`` bytes/s. ``reference_peak``: the dtype's peak over the 16-bit tensor-core
    peak (the reuse a tile needs scales with it; default 1). Arrays broadcast; a dimension ≤ 0
    costs nothing."""
    b, mm, nn, kk = (np.atleast_1d(np.asarray(x, dtype=float)) for x in (batch, m, n, k))
    b, mm, nn, kk = np.broadcast_arrays(b, mm, nn, kk)
    size = np.broadcast_arrays(b, np.atleast_1d(np.asarray(rate, dtype=float)))[0].shape
    elem = np.broadcast_to(np.asarray(element_bytes, dtype=float), size)
    speed = np.broadcast_to(np.asarray(rate, dtype=float), size)
    needed = kernels.tile_reuse * np.broadcast_to(
        np.asarray(1.0 if reference_peak is None else reference_peak, dtype=float), size)
    best_time = np.full(size, np.inf)
    best_work = np.zeros(size)
    best_extra = np.zeros(size)
    operands = (b * (mm * kk + kk * nn + mm * nn)) * elem
    for mt, nt in kernels.tiles:
        ctas = max(1, _SM_AREA // (mt * nt))
        slots = kernels.sms * ctas
        reuse = _reuse(mt, nt, elem, needed)
        base_tiles = b * np.ceil(mm / mt) * np.ceil(nn / nt)
        for split in kernels.splits:
            if split > 1 and not (kk >= 2 * split * 32).any():  # a split slice shorter than two k-slices never helps
                continue
            tiles = base_tiles * split
            work = waves(tiles, slots) * slots * 2.0 * mt * nt * (np.ceil(kk / split) + kernels.tile_k) / reuse
            extra = 2.0 * 4.0 * split * b * mm * nn if split > 1 else np.zeros(size)
            seconds = np.maximum(work / speed, (operands + extra) / bandwidth)
            better = seconds < best_time * (1 - 1e-12)
            if split > 1:
                better &= kk >= 2 * split * 32
            best_time = np.where(better, seconds, best_time)
            best_work = np.where(better, work, best_work)
            best_extra = np.where(better, extra, best_extra)
    nothing = (b <= 0) | (mm <= 0) | (nn <= 0) | (kk <= 0)
    return np.where(nothing, 0.0, best_work), np.where(nothing, 0.0, best_extra)


def gemm_seconds(m: int, n: int, k: int, dtype: str, spec: Union[str, DeviceSpec], *, batch: int = 1,
                 flops_efficiency: Optional[float] = None, bandwidth_efficiency: Optional[float] = None,
                 launch: Optional[float] = None) -> float:
    """Seconds of one GEMM ``batch × (m × n × k)`` in ``dtype`` on ``spec`` in a stream of like
    kernels (the module docstring): ``max(launch, device_fixed + max(work / (peak · eff_flops),
    bytes / (bandwidth · eff_bw)))`` — the host's launch where the device is faster — its operands
    and output read and written once (the fractions: the spec's defaults unless given).

    Raises:
        ValueError: the spec has no :class:`GPUKernels` (a CPU's: use the roofline), or no peak in ``dtype``.
    """
    spec = device_spec(spec)
    kernels = gpu_kernels(spec)
    if kernels is None:
        raise ValueError(f"{spec.name} has no GPUKernels: its operators are costed by the plain roofline")
    name = dtype_name(dtype)
    eff = spec.flops_efficiency if flops_efficiency is None else float(flops_efficiency)
    bw = spec.memory_bandwidth * (spec.bandwidth_efficiency if bandwidth_efficiency is None else float(bandwidth_efficiency))
    element = element_bytes(name)
    rate = spec.peak(name) * eff
    # (the tile and split chosen at the spec's own fractions, as the roofline chooses them)
    work, extra = gemm_work(batch, m, n, k, kernels, spec.peak(name) * spec.flops_efficiency,
                            spec.memory_bandwidth * spec.bandwidth_efficiency, element, tensor_core_ratio(spec, name))
    traffic = (batch * (m * k + k * n + m * n)) * element + float(extra[0])
    floor = kernels.launch_for(spec) if launch is None else float(launch)
    return max(floor, kernels.device_fixed + max(float(work[0]) / rate, traffic / bw))


def issued(groups: np.ndarray, host: np.ndarray, device: np.ndarray) -> np.ndarray:
    """Each op's share of its group's time when the host issues the group's ops one after another
    (``host`` seconds each) and the device runs each once issued and once the op before is done
    (``device`` seconds each); every group starts with host and device idle together. With
    ``H_k`` the host's time to issue ops 1…k and ``C_k`` the device's seconds of ops 1…k, op k
    ends at ``E_k = C_k + max_{j ≤ k} (H_j − C_{j−1})``; its share is ``E_k − E_{k−1}``. A group's
    shares sum to its end: ``max_j (H_j + device seconds of ops j…n)`` — the host's time where
    small kernels outpace it (the launch floor), the device's where it has a queue to work on."""
    out = np.empty(len(device))
    host, device = np.asarray(host, dtype=float), np.asarray(device, dtype=float)
    for g in np.unique(groups):
        at = np.flatnonzero(groups == g)
        issue = np.cumsum(host[at])
        done = np.cumsum(device[at])
        end = done + np.maximum.accumulate(issue - (done - device[at]))
        out[at] = np.diff(end, prepend=0.0)
    return out


_ELEMENT_BYTES = {"float64": 8.0, "float32": 4.0, "tf32": 4.0, "bfloat16": 2.0, "float16": 2.0, "float8": 1.0}


def element_bytes(dtype: str) -> float:
    """Bytes an element of ``dtype`` (a catalogue dtype name) takes; 4 for others."""
    return _ELEMENT_BYTES.get(dtype_name(dtype), 4.0)


def tensor_core_ratio(spec: DeviceSpec, dtype: str) -> float:
    """``dtype``'s peak over the spec's 16-bit peak (bfloat16, else float16, else float32): how much
    more or less reuse a tile needs than at the 16-bit rate :attr:`GPUKernels.tile_reuse` is given for."""
    ref = next((spec.peak_flops[d] for d in ("bfloat16", "float16", "float32") if d in spec.peak_flops))
    try:
        return spec.peak(dtype) / ref
    except ValueError:
        return 1.0
