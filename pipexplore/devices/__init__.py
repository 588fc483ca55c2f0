"""Devices: this machine's and those planned from the catalogue, the links between them.

:mod:`~pipexplore.devices.names` reads a device's name (present or planned, ``"H100:3"``),
:mod:`~pipexplore.devices.catalogue` holds the specs to plan for (:class:`DeviceSpec`), and
:mod:`~pipexplore.devices.links` what a byte or a message costs between two planned devices, and
:mod:`~pipexplore.devices.mesh` how ranks sit on a mesh of tensor, context, data and pipeline parallelism.
Part of the vocabulary every layer shares; it imports only :mod:`pipexplore.validate`.

Example::

    planned_devices(["H100"] * 16, gpus_per_node=8)    # ('H100:0', …, 'H100:15')
    link_seconds_per_byte("H100:7", "H100:8", 8)        # across nodes: 1 / 50e9
"""
from pipexplore.devices.catalogue import ALIASES, CATALOGUE, DTYPES, DeviceSpec, GiB, dtype_name
from pipexplore.devices.links import link_latency, link_seconds_per_byte
from pipexplore.devices.mesh import Mesh
from pipexplore.devices.names import (NO_GPU_NOTE, Device, as_device, catalogue_kind, chosen_devices, device_kind,
                                      device_memory, device_spec, devices_text, is_planned, node_of, planned_devices,
                                      present_device, register_device, stage_devices)

__all__ = [
    "Device", "as_device", "stage_devices", "device_memory", "NO_GPU_NOTE", "DeviceSpec", "GiB", "CATALOGUE",
    "ALIASES", "DTYPES", "device_spec", "register_device", "is_planned", "planned_devices", "node_of",
    "link_seconds_per_byte", "link_latency", "dtype_name", "present_device", "chosen_devices", "catalogue_kind",
    "device_kind", "Mesh", "devices_text",
]

