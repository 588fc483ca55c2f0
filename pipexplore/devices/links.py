"""The links between planned devices: seconds a byte and a message's latency, inside a node and across.

Example::

    link_seconds_per_byte("H100:7", "H100:8", 8)   # across nodes: 1 / 50e9 (InfiniBand NDR)
"""
from __future__ import annotations

from pipexplore.devices.catalogue import ALIASES, CATALOGUE, DeviceSpec, GiB, dtype_name  # noqa: F401 (re-exported)
from pipexplore.devices.names import _index, device_spec, is_planned, node_of

__all__ = ["link_seconds_per_byte", "link_latency"]


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
