"""What a collective costs over a group of planned devices: the ring algorithm over the group's links.

NCCL's ring moves, per rank, ``2(n−1)/n`` of the tensor for an all-reduce (a reduce-scatter, then an
all-gather) and ``(n−1)/n`` for an all-gather or a reduce-scatter (``bytes`` is the whole tensor:
the gathered output, the scattered input), in ``2(n−1)`` or ``(n−1)`` steps, each paying the link's
latency. A ring is as fast as its slowest hop: a group inside one node runs at the intra-node link
(NVLink), one across nodes at the inter-node link (InfiniBand: the GPU's share of its node's NICs)::

    seconds = factor · bytes · seconds_per_byte(slowest hop) + steps · latency(slowest hop)

    all_reduce       factor 2(n−1)/n   steps 2(n−1)
    all_gather       factor  (n−1)/n   steps  (n−1)
    reduce_scatter   factor  (n−1)/n   steps  (n−1)

Example::

    collective_seconds("all_reduce", 64 * 2**20, ["H100:0", "H100:1", "H100:2", "H100:3"], gpus_per_node=8)
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import numpy as np
import pandas as pd

from pipexplore.devices import is_planned, link_latency, link_seconds_per_byte

__all__ = ["KINDS", "HOST_LINK", "Group", "ring_seconds", "collective_seconds", "slowest_hop", "collectives_of",
           "ops_collective_seconds"]

#: The collectives costed, with the ring's share of the tensor each rank moves and its steps, per n.
KINDS = {
    "all_reduce": (lambda n: 2 * (n - 1) / n, lambda n: 2 * (n - 1)),
    "all_gather": (lambda n: (n - 1) / n, lambda n: n - 1),
    "reduce_scatter": (lambda n: (n - 1) / n, lambda n: n - 1),
}


def ring_seconds(kind: str, nbytes: float, ranks: int, seconds_per_byte: float, latency: float = 0.0) -> float:
    """Seconds of ``kind`` over a ring of ``ranks`` on links of ``seconds_per_byte`` and ``latency``
    a step (the module docstring's formula); 0 on one rank.

    Raises:
        ValueError: an unknown kind (the known ones named), a negative size, fewer than one rank.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}: {', '.join(KINDS)}")
    if nbytes < 0 or ranks < 1:
        raise ValueError(f"a collective moves bytes ≥ 0 over ranks ≥ 1, got {nbytes} bytes over {ranks}")
    if ranks == 1:
        return 0.0
    share, steps = KINDS[kind]
    return share(ranks) * nbytes * seconds_per_byte + steps(ranks) * latency


#: A ring of ranks of this machine (gloo over loopback): seconds a byte and latency a step, as measured
#: on the 2-core machine the benchmarks run on (torch 2.13 gloo, two ranks: a 16 MiB all-reduce in
#: 18.9 ms, a 1 KiB one in 1.3 ms). A run here corrects what they leave out (benchmarks/README.md).
HOST_LINK = (1.05e-9, 6.5e-4)


def slowest_hop(devices: Sequence[str], gpus_per_node: int = 8) -> tuple[float, float]:
    """The seconds a byte and the latency of the slowest hop of a ring through ``devices`` (planned
    devices, in ring order, the last back to the first); for devices of this machine, gloo's
    over loopback (:data:`HOST_LINK`)."""
    if len(devices) < 2:
        return 0.0, 0.0
    if not all(is_planned(d) for d in devices):
        return HOST_LINK
    hops = list(zip(devices, [*devices[1:], devices[0]]))
    return (max(link_seconds_per_byte(a, b, gpus_per_node) for a, b in hops),
            max(link_latency(a, b, gpus_per_node) for a, b in hops))


def collective_seconds(kind: str, nbytes: float, devices: Sequence[str], gpus_per_node: int = 8) -> float:
    """Seconds of ``kind`` moving ``nbytes`` over the group of planned ``devices`` (a ring in their order)."""
    per_byte, latency = slowest_hop(devices, gpus_per_node)
    return ring_seconds(kind, nbytes, len(devices), per_byte, latency)


class Group(NamedTuple):
    """The group an ops frame's collectives run over: its ranks and its slowest hop's seconds a byte
    and latency (:func:`pipexplore.predict.collectives.slowest_hop`)."""

    ranks: int
    seconds_per_byte: float
    latency: float


def collectives_of(ops: pd.DataFrame) -> np.ndarray:
    """Each op's collective (``""`` for a kernel)."""
    if "collective" not in ops:
        return np.full(len(ops), "", dtype=object)
    return ops["collective"].fillna("").astype(str).to_numpy()


def ops_collective_seconds(ops: pd.DataFrame, rows: float, group: Optional[Group]) -> np.ndarray:
    """Each collective's ring seconds at ``rows`` rows over ``group`` (0 for a kernel).

    Raises:
        ValueError: the frame has collectives and no group is given.
    """
    names = collectives_of(ops)
    out = np.zeros(len(ops))
    if not (names != "").any():
        return out
    if group is None:
        raise ValueError("the ops frame has collectives (a tensor-parallel rank's) but no group to cost them over: "
                         "give group=Group(ranks, seconds_per_byte, latency)")
    scale = float(rows) / float(ops.attrs["rows"])
    nbytes = ops["fixed_bytes"].to_numpy(dtype=float) + ops["row_bytes"].to_numpy(dtype=float) * scale
    for i in np.flatnonzero(names != ""):
        kind = "all_reduce" if names[i] == "all_to_all" else names[i]
        share = 0.5 if names[i] == "all_to_all" else 1.0  # an all-to-all moves (n−1)/n of its tensor, once
        out[i] = ring_seconds(kind, share * nbytes[i], group.ranks, group.seconds_per_byte, group.latency)
    return out
