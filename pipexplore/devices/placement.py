"""Where a plan's stages run, resolved once: the devices a user names (or none), as one value everything reads.

A :class:`Placement` says whether the devices are planned from the catalogue or present here, which
device layers are timed on, how many GPUs a node holds and so how many nodes the plan spans, and each
device's spec; the profile, the plan and the page read it rather than interpreting the names again.

Example::

    place(["H100"] * 16, gpus_per_node=8)       # planned: 'H100:0' … 'H100:15', 2 nodes
    place(None)                                  # present: the GPUs here in turn, else the CPU (with a note)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from pipexplore import validate
from pipexplore.devices.catalogue import DeviceSpec
from pipexplore.devices.names import chosen_devices, device_spec, is_planned, node_of, planned_devices, stage_devices

__all__ = ["Placement", "place", "devices_for"]


@dataclass(frozen=True)
class Placement:
    """The devices of a plan, resolved once (see the module docstring)."""

    #: One name per device: planned ones numbered (``'H100:3'``), present ones checked to exist.
    devices: tuple[str, ...]
    #: Whether they are catalogue devices, costed but never run here.
    planned: bool
    #: Planned GPUs a node (which copies cross nodes).
    gpus_per_node: int = 8
    #: Whether the user named them (else they are this machine's default for the stages).
    given: bool = True
    #: What to tell the user of the choice ('' when nothing): the stages fell back to the CPU.
    note: str = ""

    @property
    def profiling_device(self) -> torch.device:
        """Where layers are timed: the first named device, else the first GPU, else the CPU. A
        planned device is not here: its layers are counted, and timed where a device of its kind is."""
        if self.given and not self.planned:
            return torch.device(self.devices[0])
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")

    @property
    def nodes(self) -> int:
        """How many nodes the devices span (1 for this machine's)."""
        return len({node_of(d, self.gpus_per_node) for d in self.devices}) if self.planned else 1

    @property
    def specs(self) -> tuple[Optional[DeviceSpec], ...]:
        """Each planned device's catalogue spec (None for devices of this machine)."""
        return tuple(device_spec(d) if self.planned else None for d in self.devices)

    @property
    def kind(self) -> Optional[str]:
        """The catalogue kind of planned devices (one kind a plan), else None."""
        specs = self.specs
        return specs[0].name if specs and specs[0] is not None else None

    def for_stages(self, stages: int) -> tuple[tuple[str, ...], str]:
        """The devices for ``stages`` stages and a note: the named ones as they are; this machine's
        default for that count where none were named."""
        if self.given:
            return self.devices, ""
        chosen, note = stage_devices(stages)
        return tuple(chosen), note


def place(devices: Optional[Sequence[Any]] = None, *, gpus_per_node: int = 8) -> Placement:
    """Resolve the devices a user names (a list, or a comma-separated string), or none.

    Raises:
        ValueError: a device that is neither here nor in the catalogue, a mix of both, or a
            ``gpus_per_node`` that is not a whole number from 1.
    """
    per_node = validate.integer(gpus_per_node, "gpus_per_node")
    if devices is None:
        chosen, note = stage_devices(max(2, torch.cuda.device_count()))
        return Placement(tuple(chosen), planned=False, gpus_per_node=per_node, given=False, note=note)
    named = chosen_devices(devices, per_node)
    return Placement(tuple(named), planned=is_planned(named[0]), gpus_per_node=per_node)


def devices_for(pool: Sequence[str], needed: int, *, stages: int,
                gpus_per_node: int = 8) -> tuple[tuple[str, ...], str]:
    """``needed`` devices for ``stages`` stages from a plan's ``pool``: extra ones dropped, missing
    ones repeated from the last (planned ones: more GPUs of the kind, numbered on); and a note saying
    which ('' when none).

    Example::

        devices_for(["cpu", "cpu"], 3, stages=3)    # (('cpu',) * 3, '3 stages: cpu repeated for 1 more device')
    """
    pool = list(pool)
    if is_planned(pool[-1]) and len(pool) < needed:  # more GPUs of the kind, numbered on
        added = needed - len(pool)
        kind = pool[-1].split(":")[0]
        return planned_devices(pool + [kind] * added, gpus_per_node), f"{stages} stages: {added} more {kind} planned"
    if len(pool) >= needed:
        dropped = pool[needed:]
        return tuple(pool[:needed]), (f"{stages} stages: {', '.join(dropped)} dropped" if dropped else "")
    added = needed - len(pool)
    return (tuple(pool + [pool[-1]] * added),
            f"{stages} stages: {pool[-1]} repeated for {added} more device{'s' if added > 1 else ''}")
