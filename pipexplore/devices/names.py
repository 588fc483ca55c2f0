"""Devices by name: ``as_device`` checks one of this machine, ``stage_devices`` picks them for a plan's
stages, and devices the user may not have are planned from the catalogue: ``"H100"`` names a planned
device, ``"H100:3"`` the fourth GPU of a planned cluster (:func:`planned_devices` numbers them, node by node).

Example::

    spec = device_spec("H100")                     # the catalogue's H100 SXM 80GB
    devices = planned_devices(["H100"] * 16, gpus_per_node=8)   # ('H100:0', …, 'H100:15')
    register_device(DeviceSpec("MyGPU", 24 * GiB, 1e12, {"float32": 40e12, "bfloat16": 160e12}))
"""
from __future__ import annotations

import functools
import math
import re
from typing import Any, Optional, Sequence, Union
import torch
from pipexplore import validate
from pipexplore.devices.catalogue import ALIASES, CATALOGUE, DeviceSpec

__all__ = [
    "Device", "as_device", "stage_devices", "device_memory", "NO_GPU_NOTE", "device_spec", "register_device",
    "is_planned", "planned_devices", "node_of", "present_device", "chosen_devices", "catalogue_kind", "device_kind",
    "devices_text"
]

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
    aliases: dict[str, list[str]] = {}
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


def device_memory(device: Device) -> float:
    """Bytes of memory a stage's device holds: a planned device's from the catalogue, a CUDA
    device's total; NaN for the CPU (what it may use is the host's, shared by every stage) and for
    a CUDA device this machine does not have (a plan drawn for GPUs elsewhere)."""
    if is_planned(device):
        return float(device_spec(str(device)).memory_bytes)
    resolved = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if resolved.type == "cuda" and torch.cuda.is_available() and (resolved.index or 0) < torch.cuda.device_count():
        return float(torch.cuda.get_device_properties(resolved.index or 0).total_memory)
    return math.nan


def _same_kind(spec: Union[str, DeviceSpec], gpu_name: str) -> bool:
    """Whether a GPU's name (``torch.cuda.get_device_name``) holds every part of the catalogue
    spec's name (its chip's, for a node variant: ``DeviceSpec.chip``): ``'A100-80GB'`` matches
    ``'NVIDIA A100-SXM4-80GB'``, ``'H100-p5'`` an H100's."""
    spec = device_spec(spec)
    parts = [p.lower() for p in (spec.chip or spec.name).split("-") if p]
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
    ``'H100'``; the most specific entry whose every part it holds, never a node variant such as
    ``'H100-p5'``: a GPU's name says its chip, not its node), or None (not catalogued).

    Example::

        catalogue_kind("NVIDIA A100-SXM4-40GB")   # 'A100-40GB'
    """
    matches = [name for name, spec in CATALOGUE.items() if spec.chip is None and _same_kind(name, gpu_name)]
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
    counted = re.fullmatch(r"\s*(\d+)\s*[×x*]\s*([\w.-]+)\s*(,.*)?", devices) if isinstance(devices, str) else None
    if counted is not None:  # '64 × H100' (what the page shows of many planned devices; ', 8 nodes' ignored)
        devices = [counted.group(2)] * int(counted.group(1))
    names = [d.strip() for d in devices.split(",")] if isinstance(devices, str) else devices
    if isinstance(names, Sequence) and any(is_planned(d) for d in names):
        return planned_devices(names, gpus_per_node)
    try:
        return validate.devices(devices)
    except ValueError as exc:
        raise ValueError(f"{exc}; or plan devices you do not have by name from the catalogue: "
                         f"{', '.join(CATALOGUE)} (e.g. devices=['H100'] * 16, gpus_per_node=8)") from None


def devices_text(devices: Sequence[str], gpus_per_node: int = 8) -> str:
    """Devices as a person reads them: planned ones of one kind as a count (``'64 × H100, 8 nodes'``),
    others as their list (``'cpu,cpu'``).

    Example::

        devices_text(planned_devices(["H100"] * 64, 8), 8)   # '64 × H100, 8 nodes'
    """
    names = [str(d) for d in devices]
    kinds = {d.split(":")[0] for d in names}
    if len(names) > 1 and len(kinds) == 1 and all(is_planned(d) for d in names):
        nodes = len({node_of(d, gpus_per_node) for d in names})
        return f"{len(names)} × {kinds.pop()}" + (f", {nodes} nodes" if nodes > 1 else "")
    return ",".join(names)
