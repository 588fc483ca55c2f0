"""The catalogue of devices to plan for: each a :class:`DeviceSpec` (memory, bandwidths, peak FLOP/s
per dtype, links inside and across nodes) with the datasheets it is read from, and the aliases
users type. :mod:`pipexplore.devices` looks names up in it (``device_spec``, ``register_device``,
``planned_devices``) and re-exports what is here.

Part of the vocabulary every layer shares; it imports no other part of pipexplore.

Example::

    CATALOGUE["H100"].memory_bytes / GiB     # 80.0
    dtype_name("bf16")                        # 'bfloat16'
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping, Optional, Union

import torch

__all__ = ["DeviceSpec", "CATALOGUE", "ALIASES", "GiB", "DTYPES", "dtype_name"]

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
    pays per op when the GPU keeps up with the host). On a GPU kind that
    :mod:`pipexplore.predict.kernels` knows, it is the host's time to issue a kernel (the launch
    floor: kernels shorter than it wait for the host), the device's own fixed time being the kind's.
    ``intra_node_bandwidth``: one GPU to another GPU of its node (``intra_node_link``: NVLink
    through NVSwitch, AMD xGMI, or PCIe), per pair. ``inter_node_bandwidth``: one GPU to a GPU of
    another node, per GPU (its share of the node's NICs: InfiniBand or RoCE; 400 Gb/s NDR = 50 GB/s).
    ``pcie_bandwidth``: host ⇄ device. ``intra_node_latency``/``inter_node_latency``: seconds per
    message beyond the bytes (a send/receive's setup: a few µs).
    ``flops_efficiency``/``bandwidth_efficiency``: the fraction of peak FLOP/s a large matmul and
    of memory bandwidth a large streaming copy typically reach on the device (defaults of the
    roofline, :class:`pipexplore.predict.roofline.Efficiency`; :func:`~pipexplore.predict.roofline.fit_efficiency`
    learns them from layers measured on a device of the same kind).
    ``optimizer_efficiency``: the fraction of memory bandwidth an optimizer step's kernels reach
    (``torch.optim``'s foreach kernels: several operands each, bf16 computed in fp32), below a
    copy's; ``None``: ``bandwidth_efficiency``
    (:func:`~pipexplore.predict.planned_optimizer.optimizer_bandwidth` learns it on a device of the kind).
    ``chip``: for the same GPU in other nodes (AWS's p5: ``"H100"``), the kind whose GPU it is: its
    kernels are that kind's, and a device of that kind here teaches it (``None``: the spec's own name).
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
    optimizer_efficiency: Optional[float] = None
    chip: Optional[str] = None
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
        fractions: tuple[tuple[str, Optional[float]], ...] = (
            ("flops_efficiency", self.flops_efficiency), ("bandwidth_efficiency", self.bandwidth_efficiency),
            ("optimizer_efficiency", self.optimizer_efficiency))
        for key, fraction in fractions:
            if fraction is not None and not 0 < fraction <= 2:
                raise ValueError(f"{self.name}: {key} is a fraction of peak (0 < … ≤ 2), got {fraction}")
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

#: ``torch.optim.Adam``'s foreach step on an H200 (torch 2.11, bf16 blocks of 47M, 218M and 856M
#: parameters): its counted bytes moved at 3.31 TB/s beyond a fixed ~0.24 ms a step, 69 % of the
#: datasheet's 4.8 TB/s (``benchmarks/gpu_checks.py``; benchmarks/README.md). Assumed alike on the
#: H100 (the same chip and kernels); other kinds keep their bandwidth efficiency until measured.
_FOREACH_H200 = 0.69

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
        flops_efficiency=0.70, bandwidth_efficiency=0.90, optimizer_efficiency=_FOREACH_H200,
        source="https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM; " + _NV_DATASHEET_NOTE + ")"),
    # NVIDIA H200 SXM 141GB — https://www.nvidia.com/en-us/data-center/h200/ : the H100's compute
    # (FP32 67 TF; TF32 989 TF*, BF16/FP16 1,979 TF*, FP8 3,958 TF*, *with sparsity); 141 GB HBM3e at
    # 4.8 TB/s; NVLink 900 GB/s; PCIe Gen5 128 GB/s. Networking as DGX H200: 400 Gb/s NDR per GPU.
    "H200": DeviceSpec(
        "H200", 141 * GiB, 4.8e12,
        {"float32": 67e12, "tf32": 494.5e12, "bfloat16": 989.5e12, "float16": 989.5e12, "float8": 1979e12},
        kernel_overhead=4.5e-6, intra_node_bandwidth=450e9, intra_node_link="NVLink 4 (NVSwitch)",
        inter_node_bandwidth=50e9, inter_node_link="InfiniBand NDR 400 Gb/s", pcie_bandwidth=64e9,
        flops_efficiency=0.70, bandwidth_efficiency=0.90, optimizer_efficiency=_FOREACH_H200,
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
# AWS p5.48xlarge — https://aws.amazon.com/ec2/instance-types/p5/ : eight H100 SXM5 80 GB (the H100
# above) on NVSwitch, 3,200 Gb/s of EFA v2 a node (32 interfaces of 100 Gb/s: four, 400 Gb/s, a
# GPU), 3rd-generation AMD EPYC hosts. An EFA message's latency is aws-ofi-nccl's (the plugin that
# runs NCCL over EFA): 20 µs a network step in its tuner's model of the p5 (src/tuner/nccl_ofi_model.cpp
# and nccl_ofi_param.h, TUNER_NET_LATENCY), where the other kinds' InfiniBand takes 8 µs here. How
# NCCL's collectives run across these nodes (each step at the 75 µs the plugin reports to NCCL):
# pipexplore.predict.fabrics.FABRICS["H100-p5"].
CATALOGUE["H100-p5"] = replace(
    CATALOGUE["H100"], name="H100-p5", chip="H100", inter_node_link="EFA v2 400 Gb/s (4 x 100 Gb/s)",
    inter_node_latency=20e-6,
    source="https://aws.amazon.com/ec2/instance-types/p5/ (p5.48xlarge: H100 SXM5, EFA v2); the H100's datasheet; "
           "EFA latency: aws-ofi-nccl's tuner (TUNER_NET_LATENCY, 20 µs)")
#: Other names of catalogue devices.
ALIASES: dict[str, str] = {"A100": "A100-80GB", "H100-SXM": "H100", "H100-80GB": "H100", "H200-SXM": "H200",
                           "p5": "H100-p5", "p5.48xlarge": "H100-p5",
                           "A100-SXM-80GB": "A100-80GB", "A100-SXM-40GB": "A100-40GB"}
