"""Devices by name: ``as_device`` checks one, ``stage_devices`` picks them for a plan's stages, and
a catalogue of devices the user may not have (``DeviceSpec``: memory, bandwidths, peak FLOP/s, links)
to plan for them: ``"H100"`` names a planned device, ``"H100:3"`` the fourth GPU of a planned cluster.

Part of the vocabulary every layer shares; it imports only :mod:`pipexplore.validate`.

Example::

    spec = device_spec("H100")                     # the catalogue's H100 SXM 80GB
    devices = planned_devices(["H100"] * 16, gpus_per_node=8)   # ('H100:0', …, 'H100:15')
    link_seconds_per_byte("H100:7", "H100:8", 8)   # across nodes: 1 / 50e9 (InfiniBand NDR)
    register_device(DeviceSpec("MyGPU", 24 * GiB, 1e12, {"float32": 40e12, "bfloat16": 160e12}))
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from pipexplore import validate

__all__ = ["Device", "as_device", "stage_devices", "device_memory", "NO_GPU_NOTE", "DeviceSpec", "GiB", "CATALOGUE",
           "ALIASES", "device_spec", "register_device", "is_planned", "planned_devices", "node_of",
           "link_seconds_per_byte", "link_latency", "dtype_name", "present_device", "chosen_devices",
           "catalogue_kind", "device_kind"]

Device = Union[torch.device, int, str]

#: What the explorer says when the stages fall back to CPU devices.
NO_GPU_NOTE = "No GPU found: the stages run on CPU devices (one worker thread each)."


def as_device(device: Device) -> torch.device:
    """``device`` as a ``torch.device`` that exists here.

    Raises:
        ValueError: the name is not a device, or names a device this machine does not have.
    """
    return validate.device(device, "devices")


def stage_devices(stages: int) -> tuple[list[str], str]:
    """Devices for ``stages`` stages when the user names none, and a note to show (or ``""``):
    the visible GPUs in turn, else the CPU for every stage.

    Example::

        stage_devices(3)     # (['cuda:0', 'cuda:1', 'cuda:0'], '') on two GPUs
    """
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        return [f"cuda:{k % count}" for k in range(stages)], ""
    return ["cpu"] * stages, NO_GPU_NOTE


# --- The catalogue: devices to plan for ------------------------------------------------------------

GiB = 2 ** 30
#: Names of the dtypes a spec's ``peak_flops`` may hold, and the spellings read as each.
DTYPES = ("float64", "float32", "tf32", "bfloat16", "float16", "float8")
_DTYPE_SPELLINGS = {"fp64": "float64", "double": "float64", "fp32": "float32", "float": "float32",
                    "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp8": "float8",
                    "float8_e4m3fn": "float8", "float8_e5m2": "float8", "float8_e4m3fnuz": "float8",
                    "float8_e5m2fnuz": "float8"}
#: Names that are devices of this machine (torch's device types), never catalogue names.
_REAL_TYPES = ("cpu", "cuda", "mps", "xpu", "meta", "hip", "xla", "privateuseone")


def dtype_name(dtype: Union[str, torch.dtype]) -> str:
    """A dtype as a catalogue key: ``torch.bfloat16``, ``"bf16"`` and ``"torch.bfloat16"`` are all
    ``"bfloat16"``; every float8 format is ``"float8"``; other names come back as given (``"int64"``)."""
    name = str(dtype).lower().removeprefix("torch.")
    return _DTYPE_SPELLINGS.get(name, name)


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator as the planner sees it. Bandwidths are bytes per second, **per direction**.

    ``peak_flops``: dense (not 2:4-sparse) FLOP/s per dtype name (:data:`DTYPES`): ``"float32"``
    the plain FP32 rate, ``"tf32"`` FP32 matmuls on tensor cores where the device has them.
    ``kernel_overhead``: seconds each kernel costs beyond its work — an assumption of ~4–5 µs on
    GPUs (launch latency plus the tail of a kernel too small to fill the device, what eager PyTorch
    pays per op when the GPU keeps up with the host).
    ``intra_node_bandwidth``: one GPU to another GPU of its node (``intra_node_link``: NVLink
    through NVSwitch, AMD xGMI, or PCIe), per pair. ``inter_node_bandwidth``: one GPU to a GPU of
    another node, per GPU (its share of the node's NICs: InfiniBand or RoCE; 400 Gb/s NDR = 50 GB/s).
    ``pcie_bandwidth``: host ⇄ device. ``intra_node_latency``/``inter_node_latency``: seconds per
    message beyond the bytes (a send/receive's setup: a few µs).
    ``flops_efficiency``/``bandwidth_efficiency``: the fraction of peak FLOP/s a large matmul and
    of memory bandwidth a large streaming copy typically reach on the device (defaults of the
    roofline, :class:`pipexplore.predict.roofline.Efficiency`; :func:`~pipexplore.predict.roofline.fit_efficiency`
    learns them from layers measured on a device of the same kind).
    """

    name: str
    memory_bytes: int
    memory_bandwidth: float
    peak_flops: Mapping[str, float]
    kernel_overhead: float = 4.5e-6
    intra_node_bandwidth: float = 32e9
    intra_node_link: str = "PCIe Gen4 x16"
    inter_node_bandwidth: float = 12.5e9
    inter_node_link: str = "100 Gb/s Ethernet"
    pcie_bandwidth: float = 32e9
    flops_efficiency: float = 0.7
    bandwidth_efficiency: float = 0.85
    intra_node_latency: float = 3e-6
    inter_node_latency: float = 8e-6
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip() or ":" in self.name or "," in self.name:
            raise ValueError(f"a device spec needs a name without ':' or ',' (an index follows ':'), got {self.name!r}")
        if self.name.lower() in _REAL_TYPES:
            raise ValueError(f"{self.name!r} names a device type of this machine; give the spec another name")
        peaks = {dtype_name(k): float(v) for k, v in dict(self.peak_flops).items()}
        positive = {"memory_bytes": self.memory_bytes, "memory_bandwidth": self.memory_bandwidth,
                    "intra_node_bandwidth": self.intra_node_bandwidth,
                    "inter_node_bandwidth": self.inter_node_bandwidth, "pcie_bandwidth": self.pcie_bandwidth,
                    **{f"peak_flops[{k!r}]": v for k, v in peaks.items()}}
        at_least_zero = {"kernel_overhead": self.kernel_overhead, "intra_node_latency": self.intra_node_latency,
                         "inter_node_latency": self.inter_node_latency}
        for key, value in {**positive, **at_least_zero}.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    value > 0 or (key in at_least_zero and value == 0)) or value == float("inf"):
                kind = "non-negative" if key in at_least_zero else "positive"
                raise ValueError(f"{self.name}: {key} must be a {kind} finite number, got {value!r}")
        if "float32" not in peaks:
            raise ValueError(f"{self.name}: peak_flops needs at least 'float32', got {sorted(peaks)}")
        for key, value in (("flops_efficiency", self.flops_efficiency),
                           ("bandwidth_efficiency", self.bandwidth_efficiency)):
            if not 0 < value <= 2:
                raise ValueError(f"{self.name}: {key} is a fraction of peak (0 < … ≤ 2), got {value}")
        object.__setattr__(self, "peak_flops", MappingProxyType(peaks))
        object.__setattr__(self, "memory_bytes", int(self.memory_bytes))

    def __hash__(self) -> int:
        return hash((self.name, self.memory_bytes, self.memory_bandwidth, tuple(sorted(self.peak_flops.items()))))

    def peak(self, dtype: Union[str, torch.dtype]) -> float:
        """Dense FLOP/s in ``dtype``. Integer and bool dtypes run at the float32 rate (they rarely
        count FLOPs); a float dtype the spec does not list is refused.

        Raises:
            ValueError: the device has no peak for that dtype (float8 on an A100, say).
        """
        name = dtype_name(dtype)
        if name in self.peak_flops:
            return self.peak_flops[name]
        if name.startswith(("int", "uint", "bool")):
            return self.peak_flops["float32"]
        raise ValueError(f"{self.name} has no {name} peak: it lists {', '.join(self.peak_flops)}")


_NV_DATASHEET_NOTE = "dense = half the datasheet's 'with sparsity' tensor-core figures"

#: The catalogue. Each number with its public source; bandwidths per direction (the datasheets'
#: NVLink/PCIe figures are both directions together: halved). Memory as marketed, in GiB (the
#: driver reports slightly less usable). Efficiency defaults: typical large bf16 GEMM
#: (cuBLAS/hipBLASLt) over dense peak and a large device-to-device copy over peak bandwidth —
#: rough, to be corrected by :func:`pipexplore.predict.roofline.fit_efficiency`.
CATALOGUE: dict[str, DeviceSpec] = {
    # NVIDIA H100 SXM5 80GB — https://www.nvidia.com/en-us/data-center/h100/ (datasheet table,
    # "H100 SXM"): FP32 67 TF; TF32 989 TF*, BF16/FP16 1,979 TF*, FP8 3,958 TF* (*with sparsity:
    # dense is half); 80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s; PCIe Gen5 128 GB/s. DGX H100: eight
    # ConnectX-7 400 Gb/s (NDR) per node, one per GPU:
    # https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html
    "H100": DeviceSpec(
        "H100", 80 * GiB, 3.35e12,
        {"float32": 67e12, "tf32": 494.5e12, "bfloat16": 989.5e12, "float16": 989.5e12, "float8": 1979e12},
        kernel_overhead=4.5e-6, intra_node_bandwidth=450e9, intra_node_link="NVLink 4 (NVSwitch)",
        inter_node_bandwidth=50e9, inter_node_link="InfiniBand NDR 400 Gb/s", pcie_bandwidth=64e9,
        flops_efficiency=0.70, bandwidth_efficiency=0.90,
        source="https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM; " + _NV_DATASHEET_NOTE + ")"),
    # NVIDIA H200 SXM 141GB — https://www.nvidia.com/en-us/data-center/h200/ : the H100's compute
    # (FP32 67 TF; TF32 989 TF*, BF16/FP16 1,979 TF*, FP8 3,958 TF*, *with sparsity); 141 GB HBM3e at
    # 4.8 TB/s; NVLink 900 GB/s; PCIe Gen5 128 GB/s. Networking as DGX H200: 400 Gb/s NDR per GPU.
    "H200": DeviceSpec(
        "H200", 141 * GiB, 4.8e12,
        {"float32": 67e12, "tf32": 494.5e12, "bfloat16": 989.5e12, "float16": 989.5e12, "float8": 1979e12},
        kernel_overhead=4.5e-6, intra_node_bandwidth=450e9, intra_node_link="NVLink 4 (NVSwitch)",
        inter_node_bandwidth=50e9, inter_node_link="InfiniBand NDR 400 Gb/s", pcie_bandwidth=64e9,
        flops_efficiency=0.70, bandwidth_efficiency=0.90,
        source="https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM; " + _NV_DATASHEET_NOTE + ")"),
    # NVIDIA A100 SXM4 (datasheet):
    # https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
    # FP32 19.5 TF; TF32 156 TF, BF16/FP16 312 TF (dense; twice with sparsity); no FP8. 40GB: HBM2
    # 1,555 GB/s; 80GB: HBM2e 2,039 GB/s; NVLink 600 GB/s; PCIe Gen4 64 GB/s. DGX A100: eight
    # ConnectX-6 200 Gb/s (HDR) per node, one per GPU (25 GB/s).
    "A100-40GB": DeviceSpec(
        "A100-40GB", 40 * GiB, 1.555e12, {"float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12, "float16": 312e12},
        kernel_overhead=4.5e-6, intra_node_bandwidth=300e9, intra_node_link="NVLink 3 (NVSwitch)",
        inter_node_bandwidth=25e9, inter_node_link="InfiniBand HDR 200 Gb/s", pcie_bandwidth=32e9,
        flops_efficiency=0.80, bandwidth_efficiency=0.88,
        source="https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
               "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (A100 40GB SXM)"),
    "A100-80GB": DeviceSpec(
        "A100-80GB", 80 * GiB, 2.039e12, {"float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12, "float16": 312e12},
        kernel_overhead=4.5e-6, intra_node_bandwidth=300e9, intra_node_link="NVLink 3 (NVSwitch)",
        inter_node_bandwidth=25e9, inter_node_link="InfiniBand HDR 200 Gb/s", pcie_bandwidth=32e9,
        flops_efficiency=0.80, bandwidth_efficiency=0.88,
        source="https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
               "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (A100 80GB SXM)"),
    # NVIDIA L4 24GB (PCIe, 72 W) — https://www.nvidia.com/en-us/data-center/l4/ (datasheet:
    # https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet): FP32 30.3 TF; TF32
    # 120 TF*, BF16/FP16 242 TF*, FP8 485 TF* (*with sparsity: dense is half); 24 GB GDDR6 at 300
    # GB/s; PCIe Gen4 x16 64 GB/s, no NVLink: GPUs of a node talk over PCIe. Across nodes an
    # assumption: 100 Gb/s Ethernet, the NIC to one pipeline boundary (cloud L4 machines).
    # Sustained clocks are power-capped: a lower FLOP/s fraction.
    "L4": DeviceSpec(
        "L4", 24 * GiB, 300e9, {"float32": 30.3e12, "tf32": 60e12, "bfloat16": 121e12, "float16": 121e12,
                                "float8": 242.5e12},
        kernel_overhead=4.5e-6, intra_node_bandwidth=32e9, intra_node_link="PCIe Gen4 x16",
        inter_node_bandwidth=12.5e9, inter_node_link="Ethernet 100 Gb/s", pcie_bandwidth=32e9,
        flops_efficiency=0.60, bandwidth_efficiency=0.85,
        source="https://www.nvidia.com/en-us/data-center/l4/ (" + _NV_DATASHEET_NOTE + ")"),
    # AMD Instinct MI300X 192GB (OAM) (datasheet):
    # https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/amd-instinct-mi300x-data-sheet.pdf
    # FP32 (vector and matrix) 163.4 TF; TF32 653.7 TF, BF16/FP16 1,307.4 TF, FP8 2,614.9 TF (dense;
    # twice with sparsity); 192 GB HBM3 at 5.3 TB/s; 7 Infinity Fabric (xGMI) links of 128 GB/s
    # (both directions) in a fully connected 8-GPU platform: one link, 64 GB/s per direction, between
    # any two GPUs (not the 448 GB/s aggregate); PCIe Gen5 x16 128 GB/s. 400 Gb/s NIC per GPU assumed.
    # Kernel launch on ROCm assumed slower (~6 µs); measured GEMMs reach about half of peak.
    "MI300X": DeviceSpec(
        "MI300X", 192 * GiB, 5.3e12,
        {"float32": 163.4e12, "tf32": 653.7e12, "bfloat16": 1307.4e12, "float16": 1307.4e12, "float8": 2614.9e12},
        kernel_overhead=6e-6, intra_node_bandwidth=64e9, intra_node_link="Infinity Fabric (xGMI), one link",
        inter_node_bandwidth=50e9, inter_node_link="400 Gb/s (InfiniBand NDR or RoCE)", pcie_bandwidth=64e9,
        flops_efficiency=0.50, bandwidth_efficiency=0.80,
        source="https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/"
               "amd-instinct-mi300x-data-sheet.pdf"),
}
#: Other names of catalogue devices.
ALIASES: dict[str, str] = {"A100": "A100-80GB", "H100-SXM": "H100", "H100-80GB": "H100", "H200-SXM": "H200",
                           "A100-SXM-80GB": "A100-80GB", "A100-SXM-40GB": "A100-40GB"}

_INDEXED = re.compile(r"^(?P<base>[^:,]+?)(?::(?P<index>\d+))?$")


def _catalogued(base: str) -> str | None:
    """The catalogue key of a base name (no index), by name or alias, case-insensitively; else None."""
    if base in CATALOGUE:
        return base
    if base in ALIASES:
        return ALIASES[base]
    folded = base.lower()
    for key in CATALOGUE:
        if key.lower() == folded:
            return key
    for alias, key in ALIASES.items():
        if alias.lower() == folded:
            return key
    return None


@functools.lru_cache(maxsize=4096)
def _indexed(device: str) -> bool:
    """Whether ``device`` reads as a name with an optional ``:index``."""
    return _INDEXED.match(device.strip()) is not None


@functools.lru_cache(maxsize=4096)
def _split(device: str) -> tuple[str, int | None]:
    """``"H100:3"`` → ``("H100", 3)``; ``"H100"`` → ``("H100", None)`` (cached: a plan's simulation
    asks for every stage boundary's devices)."""
    match = _INDEXED.match(device.strip())
    if match is None:
        return device.strip(), None
    index = match.group("index")
    return match.group("base").strip(), None if index is None else int(index)


def _known() -> str:
    aliases = {}
    for alias, key in ALIASES.items():
        aliases.setdefault(key, []).append(alias)
    return ", ".join(f"{k} (also {', '.join(aliases[k])})" if k in aliases else k for k in CATALOGUE)


def device_spec(name_or_spec: Union[str, DeviceSpec]) -> DeviceSpec:
    """The spec of a catalogue device (``"H100"``, ``"A100"``, ``"H100:3"``: the index is ignored),
    or ``name_or_spec`` itself when it is a :class:`DeviceSpec` (a custom device).

    Raises:
        ValueError: the name is not in the catalogue (the message lists it).
    """
    if isinstance(name_or_spec, DeviceSpec):
        return name_or_spec
    if not isinstance(name_or_spec, str):
        raise TypeError(f"a device to plan for is a catalogue name or a DeviceSpec, got {name_or_spec!r} "
                        f"({type(name_or_spec).__name__})")
    base, _ = _split(name_or_spec)
    key = _catalogued(base)
    if key is None:
        raise ValueError(f"unknown device {name_or_spec!r}: the catalogue has {_known()}; "
                         "register_device(DeviceSpec(...)) adds one")
    return CATALOGUE[key]


def register_device(spec: DeviceSpec, *, replace: bool = False) -> DeviceSpec:
    """Add a custom device to the catalogue under ``spec.name`` (then ``"MyGPU:0"`` plans with it).

    Raises:
        ValueError: the name is taken by another spec (``replace=True`` replaces it), or is an alias.
    """
    if not isinstance(spec, DeviceSpec):
        raise TypeError(f"register_device needs a DeviceSpec, got {type(spec).__name__}")
    taken = _catalogued(spec.name)
    if taken is not None and taken != spec.name:
        raise ValueError(f"{spec.name!r} already names {taken} in the catalogue; give the spec another name")
    if taken is not None and CATALOGUE[taken] != spec and not replace:
        raise ValueError(f"the catalogue already has a different {spec.name!r}; register_device(spec, replace=True) "
                         "replaces it")
    CATALOGUE[spec.name] = spec
    return spec


def is_planned(name: object) -> bool:
    """Whether ``name`` is a planned device: a catalogue name, possibly indexed (``"H100"``,
    ``"H100:3"``). Devices of this machine (``"cpu"``, ``"cuda:0"``, ``torch.device``, ints) are not."""
    if not isinstance(name, str):
        return False
    base, _ = _split(name)
    return _indexed(name) and _catalogued(base) is not None


def _gpus_per_node(value: object) -> int:
    return validate.integer(value, "gpus_per_node")


def planned_devices(names: Sequence[str], gpus_per_node: int = 8) -> tuple[str, ...]:
    """Planned devices with their place in the cluster: ``["H100"] * 16`` →
    ``("H100:0", …, "H100:15")``; GPU ``k`` sits on node ``k // gpus_per_node``.

    The index is the GPU's place among all planned GPUs (so ``["H100"] * 8 + ["A100"] * 8`` puts
    the A100s at 8–15, on the second node). Names already indexed are kept (a repeated one is a
    device that several stages share); the others take the lowest places not named.

    Raises:
        ValueError: a name is not planned (``"cpu"``, ``"cuda:0"``: a plan mixes devices of this
            machine with planned ones, or names none from the catalogue), or one node would hold
            devices of different kinds.
    """
    per_node = _gpus_per_node(gpus_per_node)
    if isinstance(names, str):
        names = [part.strip() for part in names.split(",") if part.strip()]
    names = list(names)
    if not names:
        raise ValueError("planned_devices needs at least one device name, e.g. ['H100'] * 8")
    real = [str(n) for n in names if not is_planned(n)]
    if real:
        planned = [n for n in names if is_planned(n)]
        if planned:
            raise ValueError(f"a plan cannot mix planned devices ({', '.join(dict.fromkeys(planned))}) with devices of "
                             f"this machine ({', '.join(dict.fromkeys(real))}): plan all stages on catalogue devices, "
                             "or run them all here")
        raise ValueError(f"{', '.join(dict.fromkeys(real))}: not planned devices; the catalogue has {_known()}")
    split = [_split(n) for n in names]
    taken = {index for _, index in split if index is not None}
    out, next_free = [], 0
    for (base, index), name in zip(split, names):
        if index is None:
            while next_free in taken:
                next_free += 1
            index = next_free
            taken.add(index)
            out.append(f"{base}:{index}")
        else:
            out.append(name.strip())
    kinds: dict[int, str] = {}
    for device in dict.fromkeys(out):
        node, kind = node_of(device, per_node), device_spec(device).name
        if kinds.setdefault(node, kind) != kind:
            raise ValueError(f"node {node} (GPUs {node * per_node}–{node * per_node + per_node - 1}) would hold "
                             f"{kinds[node]} and {kind}: one node holds one kind of device; place each kind on "
                             f"nodes of its own (indices in multiples of gpus_per_node={per_node})")
    return tuple(out)


def _index(device: str) -> int:
    base, index = _split(device)
    if index is None:
        raise ValueError(f"{device!r} has no place in the cluster: name it with an index ('{base}:0'), "
                         "or let planned_devices number the devices")
    return index


def node_of(device: Device, gpus_per_node: int = 8) -> int:
    """The node a planned device sits on: its index ``// gpus_per_node``. A device of this machine
    (``"cpu"``, ``"cuda:3"``) is on node 0, this machine.

    Raises:
        ValueError: a planned device without an index.
    """
    per_node = _gpus_per_node(gpus_per_node)
    if not is_planned(device):
        return 0
    return _index(str(device)) // per_node


def _pair(a: str, b: str, gpus_per_node: int) -> tuple[bool, bool, DeviceSpec, DeviceSpec]:
    """Whether ``a`` and ``b`` are the same device, the same node, and their specs."""
    for device in (a, b):
        if not is_planned(device):
            raise ValueError(f"{device!r} is not a planned device: link costs are for catalogue devices "
                             "('H100:0'); devices of this machine are measured, not planned")
    x, y = device_spec(a), device_spec(b)
    if a.strip() == b.strip() or (x.name == y.name and _index(a) == _index(b)):
        return True, True, x, y
    return False, node_of(a, gpus_per_node) == node_of(b, gpus_per_node), x, y


def link_seconds_per_byte(a: str, b: str, gpus_per_node: int = 8) -> float:
    """Seconds per byte sent from planned device ``a`` to ``b``: 0 on the same device,
    ``1 / intra_node_bandwidth`` on the same node (NVLink, xGMI or PCIe; the slower of the two
    ends), ``1 / inter_node_bandwidth`` across nodes (the GPU's share of InfiniBand/RoCE)."""
    same, same_node, x, y = _pair(a, b, gpus_per_node)
    if same:
        return 0.0
    if same_node:
        return 1.0 / min(x.intra_node_bandwidth, y.intra_node_bandwidth)
    return 1.0 / min(x.inter_node_bandwidth, y.inter_node_bandwidth)


def link_latency(a: str, b: str, gpus_per_node: int = 8) -> float:
    """Seconds per message from planned device ``a`` to ``b`` beyond its bytes: 0 on the same
    device, the spec's ``intra_node_latency`` (~3 µs: a peer-to-peer send's setup over NVLink) on
    the same node, its ``inter_node_latency`` (~8 µs: RDMA plus the send/receive's handshake)
    across nodes; the larger of the two ends'."""
    same, same_node, x, y = _pair(a, b, gpus_per_node)
    if same:
        return 0.0
    if same_node:
        return max(x.intra_node_latency, y.intra_node_latency)
    return max(x.inter_node_latency, y.inter_node_latency)


def device_memory(device: Device) -> float:
    """Bytes of memory a stage's device holds: a planned device's from the catalogue, a CUDA
    device's total; NaN for the CPU (what it may use is the host's, shared by every stage)."""
    if is_planned(device):
        return float(device_spec(str(device)).memory_bytes)
    resolved = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if resolved.type == "cuda" and torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(resolved.index or 0).total_memory)
    return math.nan


def _same_kind(spec: Union[str, DeviceSpec], gpu_name: str) -> bool:
    """Whether a GPU's name (``torch.cuda.get_device_name``) holds every part of the catalogue
    spec's name: ``'A100-80GB'`` matches ``'NVIDIA A100-SXM4-80GB'``."""
    parts = [p.lower() for p in device_spec(spec).name.split("-") if p]
    return all(part in gpu_name.lower() for part in parts)


def present_device(spec: Union[str, DeviceSpec]) -> Optional[torch.device]:
    """A device of this machine of the same kind as catalogue ``spec`` (a CUDA device whose name
    holds every part of the spec's: ``'A100-80GB'`` matches ``'NVIDIA A100-SXM4-80GB'``), or None:
    where one is here, the explorer times the model's blocks on it and learns the catalogue's
    efficiency (:func:`pipexplore.predict.roofline.fit_efficiency`)."""
    if not torch.cuda.is_available():
        return None
    for index in range(torch.cuda.device_count()):
        if _same_kind(spec, torch.cuda.get_device_name(index)):
            return torch.device("cuda", index)
    return None


def catalogue_kind(gpu_name: str) -> Optional[str]:
    """The catalogue's name for a GPU by its name as torch gives it (``'NVIDIA H100 80GB HBM3'`` →
    ``'H100'``; the most specific entry whose every part it holds), or None (not catalogued).

    Example::

        catalogue_kind("NVIDIA A100-SXM4-40GB")   # 'A100-40GB'
    """
    matches = [name for name in CATALOGUE if _same_kind(name, gpu_name)]
    return max(matches, key=lambda name: len(name.split("-")), default=None)


def device_kind(devices: Sequence[Any]) -> Optional[str]:
    """The kind of devices a plan runs on, as corrections learnt from runs are kept
    (:meth:`pipexplore.predict.costs.Corrections.for_kind`): None for this machine's own devices,
    else the catalogue names of planned ones (``'H100'``; a mix joined by ``+``, sorted)."""
    kinds = sorted({device_spec(str(d)).name for d in devices if is_planned(d)})
    return "+".join(kinds) if kinds else None


def chosen_devices(devices: Sequence[Any], gpus_per_node: int) -> tuple[str, ...]:
    """The devices a user names: all of this machine (checked to exist) or all planned from the
    catalogue (``["H100"] * 16`` → ``"H100:0"`` … ``"H100:15"``, ``gpus_per_node`` a node).

    Raises:
        ValueError: a device that is neither here nor in the catalogue (the catalogue listed), or
            a mix of both.
    """
    names = [d.strip() for d in devices.split(",")] if isinstance(devices, str) else devices
    if isinstance(names, Sequence) and any(is_planned(d) for d in names):
        return planned_devices(names, gpus_per_node)
    try:
        return validate.devices(devices)
    except ValueError as exc:
        raise ValueError(f"{exc}; or plan devices you do not have by name from the catalogue: "
                         f"{', '.join(CATALOGUE)} (e.g. devices=['H100'] * 16, gpus_per_node=8)") from None
