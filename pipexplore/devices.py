"""Devices by name: ``as_device`` checks one, ``stage_devices`` picks them for a plan's stages.

Part of the vocabulary every layer shares; it imports only :mod:`pipexplore.validate`.
"""
from __future__ import annotations

from typing import Union

import torch

from pipexplore import validate

__all__ = ["Device", "as_device", "stage_devices", "NO_GPU_NOTE"]

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
