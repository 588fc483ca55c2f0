"""What a collective costs over a group of planned devices, as NCCL runs it.

NCCL splits a collective into channels, each a ring (or a tree) through the GPUs of every node in
the group: inside a node over NVLink, from node to node through a NIC — each channel its own NIC,
so a ring that crosses nodes moves at the bandwidth of every NIC the group's GPUs have on a node,
not at one GPU's share. For each call NCCL's tuner (``src/graph/tuning.cc``) predicts every
algorithm and protocol and runs the fastest; this module does the same with its own model::

    seconds = latency(algorithm, protocol) + W + 2·√(steps · ramp · W),    W = factor · bytes / bus_bandwidth

    algorithm   collectives                    bus bandwidth
    ring        all_reduce, all_gather,        min(NVLink ring inside a node, the node's NICs the
                reduce_scatter                 group uses across nodes)
    tree        all_reduce across nodes        double binary tree between nodes (a chain inside
                                               each): a node sends 2(N−1)/N of the tensor, not ~2;
                                               beyond two nodes at what NCCL's per-channel caps
                                               leave each protocol (Fabric.tree_beyond_two)
    nvls        all_reduce inside a node       NVLink SHARP (NVSwitch reduces; Hopper and later)
    nvls_tree   all_reduce across nodes        NVLink SHARP inside, the tree between nodes (beyond
                                               two nodes at half its bandwidth across them, as NCCL's
                                               tuner costs it: the ring runs large ones there)

    protocol    bandwidth              latency (NCCL's base + per hop, µs)
    LL          min(½ B, LL's cap)     lowest: 8-byte stores with a flag, no fences
    LL128       0.92 · 120/128 · B     128-byte lines with a flag
    Simple      B                      highest: a fence and a flag each step

A tree's (and NVLS Tree's) bandwidth is further scaled by NCCL's own correction for medium sizes
(``treeCorrectionFactor``: 0.5–0.9 from 64 B to 512 MiB), which its tuner applies because trees
run below their model there.

``factor`` is nccl-tests' bus factor (``2(n−1)/n`` for an all-reduce, ``(n−1)/n`` for an
all-gather or a reduce-scatter, whose ``bytes`` is the whole tensor: the gathered output, the
scattered input), so that ``bus_bandwidth`` is what nccl-tests prints as ``busbw``. The latency is
NCCL's: a base per algorithm and protocol plus a hop latency per step over NVLink or the network
(the ring pays one a step, ``2(n−1)`` steps for an all-reduce; the tree ``2·log2(N)`` network hops
and a chain inside each node); a step across nodes adds the latency the network's plugin reports to
NCCL (75 µs over AWS's EFA, none over InfiniBand), and a ring that crosses nodes pays at least the
host's cost of posting a network operation at each of its steps (:class:`Fabric`); a ring Simple
all-reduce across nodes pays 1.4 times its latency (NCCL's "plateau effect of ring"). The last term
is the time a message's pipeline takes to fill through its ``steps`` (chunks cut at their best
size, the classic pipelined transfer: ``(√(steps·ramp) + √W)²``), which NCCL's model leaves out:
published nccl-tests curves reach their plateau only at hundreds of MiB, more slowly than a latency
alone gives (:class:`Fabric`).

``all_to_all`` (experts' token exchange) is NCCL's grouped send/receive: each rank sends ``(n−1)/n``
of its tensor, the part for ranks of its node over NVLink, the rest through its own NIC, at the
slower of the two. ``send_recv`` is one point-to-point message (a pipeline's activations).

The bandwidths, efficiencies and network latencies of each node kind are in
:data:`~pipexplore.predict.fabrics.FABRICS` (:mod:`pipexplore.predict.fabrics`), with their sources;
``benchmarks/nccl_tests.py`` holds the model against published nccl-tests figures. Devices of this
machine (gloo over loopback) are costed by a plain ring at :data:`HOST_LINK` instead.

Example::

    collective_seconds("all_reduce", 64 * 2**20, [f"H100:{i}" for i in range(16)], gpus_per_node=8)
    collective_cost("all_reduce", 2**20, [f"A100:{i}" for i in range(32)]).algorithm    # 'tree'
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import numpy as np
import pandas as pd

from pipexplore.devices import is_planned, link_latency, link_seconds_per_byte, node_of
from pipexplore.predict.fabrics import FABRICS, HOP_NVLINK, PROTOCOLS, Fabric, fabric_of

__all__ = ["KINDS", "COLLECTIVES", "ALGORITHMS", "PROTOCOLS", "HOST_LINK", "Fabric", "FABRICS", "fabric_of", "Cost",
           "Group", "ring_seconds", "nccl_cost", "collective_cost", "collective_seconds", "linear_cost",
           "bus_factor", "bus_bandwidth", "slowest_hop", "collectives_of", "ops_collective_seconds"]

#: The collectives :func:`ring_seconds` costs, with the ring's share of the tensor each rank moves
#: and its steps, per n.
KINDS = {
    "all_reduce": (lambda n: 2 * (n - 1) / n, lambda n: 2 * (n - 1)),
    "all_gather": (lambda n: (n - 1) / n, lambda n: n - 1),
    "reduce_scatter": (lambda n: (n - 1) / n, lambda n: n - 1),
}
#: What :func:`collective_cost` costs: the ring's three, experts' all-to-all, and a point-to-point message.
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
ALGORITHMS = ("ring", "tree", "nvls", "nvls_tree", "p2p")

# NCCL's tuning constants (src/graph/tuning.cc, NCCL 2.18–2.29, unchanged across them), µs: the base
# latency of an algorithm and protocol (a step's: HOP_NVLINK over NVLink, Fabric.hop_across across nodes).
_BASE = {"ring": (6.6, 14.0, 8.4), "tree": (6.8, 14.0, 8.4), "p2p": (6.6, 14.0, 8.4)}
_NVLS_LATENCY = 25.0  # NVLink SHARP, Simple only: its NVLink hop latency (tuning.cc, NVLS/NVLS Tree)
# Beyond two nodes NCCL's tuner costs NVLS Tree's inter-node part at half the bandwidth it gives it on two
# (tuning.cc, NCCL 2.19–2.28: ``bw = min(bwIntra, nNodes <= 2 ? bwInter : bwInter/2)``), so that it runs the
# ring (or the tree) for large all-reduces on 4 and more H100 nodes: there NVLink SHARP on or off gives the
# same bus bandwidth, where on one or two nodes it adds ~30 % (NVIDIA/nccl#1221, NCCL 2.19.3).
_NVLS_TREE_BEYOND_TWO = 0.5
# "Plateau effect of ring": NCCL's tuner (ncclTopoGetAlgoTime, NCCL 2.19–2.27) costs a ring Simple
# all-reduce across nodes at 1.4 times its latency (1.9 before Ampere) once each channel's share of
# each rank is 64 bytes or more; taken here at NCCL's most channels, 32 (from 64 KiB a rank).
_RING_PLATEAU = 1.4
_CHANNELS = 32
# The LL128 protocol's payload (120 of 128 bytes) at 92 % of Simple's rate, and the tree's 92 % (tuning.cc).
_LL128 = 0.92 * 120 / 128
_TREE = 0.92
# "Trees are not perfectly sticking to the model for medium sizes": NCCL's static correction of a tree
# all-reduce's bandwidth by size, per protocol (LL, LL128, Simple), indexed by log2(bytes / 64), 64 B
# to 512 MiB; 1 beyond (tuning.cc treeCorrectionFactor, NCCL 2.19–2.29). NCCL applies it to the tree
# and, on Blackwell, to NVLS Tree; here to both, whose inter-node part is the same tree: on HGX H100
# nodes the NVLS Tree all-reduce dips so at 16–512 MiB (NVIDIA/nccl-tests#309, benchmarks/nccl_tests.py).
_TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
)


def _tree_correction(protocol: int, nbytes: float) -> float:
    """NCCL's correction of a tree's bandwidth at ``nbytes`` (:data:`_TREE_CORRECTION`)."""
    if nbytes < 64:
        return 1.0
    log = int(nbytes) >> 6
    log = log.bit_length() - 1
    return _TREE_CORRECTION[protocol][log] if log < len(_TREE_CORRECTION[protocol]) else 1.0


class Cost(NamedTuple):
    """A collective's predicted seconds, the algorithm and protocol NCCL would choose for it, and
    its bus bandwidth as nccl-tests prints it (bytes/s; 0 where nothing moves)."""

    seconds: float
    algorithm: str
    protocol: str
    bus_bandwidth: float


def bus_factor(kind: str, ranks: int) -> float:
    """nccl-tests' bus factor: ``busbw = algbw · factor`` (``2(n−1)/n`` all-reduce, ``(n−1)/n``
    all-gather, reduce-scatter and all-to-all, 1 a send)."""
    if kind == "all_reduce":
        return 2 * (ranks - 1) / ranks
    if kind == "send_recv":
        return 1.0
    return (ranks - 1) / ranks


def bus_bandwidth(kind: str, nbytes: float, seconds: float, ranks: int) -> float:
    """The bus bandwidth nccl-tests prints for ``kind`` of ``nbytes`` over ``ranks`` in ``seconds``."""
    return nbytes / seconds * bus_factor(kind, ranks) if seconds > 0 else 0.0


def _check(kind: str, nbytes: float, ranks: int) -> None:
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}: {', '.join(COLLECTIVES)}")
    if nbytes < 0 or ranks < 1:
        raise ValueError(f"a collective moves bytes ≥ 0 over ranks ≥ 1, got {nbytes} bytes over {ranks}")


def _timed(latency_us: float, work: float, ramp: float) -> float:
    """Seconds of a collective: its latency (µs), the bytes' time ``work`` and its pipeline's fill
    (``ramp``: seconds, all its steps')."""
    return latency_us * 1e-6 + work + 2.0 * math.sqrt(ramp * work)


def nccl_cost(kind: str, nbytes: float, *, ranks: int, nodes: int, fabric: Fabric, per_node: Optional[int] = None,
              algorithm: Optional[str] = None) -> Cost:
    """``kind`` of ``nbytes`` over ``ranks`` on ``nodes`` nodes of ``fabric`` (``per_node``: the fewest
    of them on one node, ``ranks // nodes`` unless given), with the algorithm and protocol NCCL would
    choose (the fastest predicted: the module docstring), or the given ``algorithm`` (as
    ``NCCL_ALGO`` forces it; ``ValueError`` where it cannot run). 0 on one rank.

    Raises:
        ValueError: an unknown kind, a negative size, fewer ranks than nodes, an algorithm that does
            not run ``kind`` on this group.
    """
    _check(kind, nbytes, ranks)
    if nodes < 1 or nodes > ranks:
        raise ValueError(f"{ranks} ranks cannot sit on {nodes} nodes")
    if ranks == 1:
        return Cost(0.0, "", "", 0.0)
    least = per_node if per_node is not None else ranks // nodes
    most = -(-ranks // nodes)
    nic = fabric.nics_per_gpu * fabric.nic_bandwidth * (fabric.lone_nic_efficiency if least == 1
                                                         else fabric.nic_efficiency)
    net = least * nic  # the node's NICs the group uses: each channel through its own
    nvlink = fabric.nvlink_busbw if most > 1 else math.inf
    factor = bus_factor(kind, ranks)
    reducing = kind in ("all_reduce", "reduce_scatter")
    ll_cap = fabric.ll_busbw[min(nodes, 3) - 1]
    options: list[tuple[float, str, str]] = []

    def add(name: str, protocol: int, latency: float, busbw: float, ramp: float) -> None:
        if busbw <= 0 or not math.isfinite(busbw):
            return
        bw = {0: min(0.5 * busbw, ll_cap), 1: _LL128 * busbw, 2: busbw}[protocol]
        if name in ("tree", "nvls_tree"):
            bw *= _tree_correction(protocol, nbytes)
        work = nbytes * factor / bw
        options.append((_timed(latency, work, ramp), name, PROTOCOLS[protocol]))

    if kind in ("all_to_all", "send_recv"):
        if kind == "send_recv":  # one message: over NVLink inside a node, through the GPU's own NIC across
            inter, intra = (nbytes, 0.0) if nodes > 1 else (0.0, nbytes)
        else:  # each rank's (n−1)/n: the part for its node's ranks over NVLink, the rest through its NIC
            intra, inter = nbytes * (most - 1) / ranks, nbytes * (ranks - most) / ranks
        for p in range(3):
            hop = fabric.hop_across("p2p", p) if inter > 0 else HOP_NVLINK["p2p"][p]
            scale = {0: 0.5, 1: _LL128, 2: 1.0}[p]
            work = max(intra / (fabric.nvlink_busbw * scale), inter / (nic * scale))
            if p == 0:  # LL's cap on its own rate
                work = max(work, (intra + inter) / ll_cap)
            rounds = 1 if kind == "send_recv" else ranks - 1  # NCCL sends to the n−1 peers in rounds
            options.append((_timed(_BASE["p2p"][p] + hop, work, rounds * fabric.ramp), "p2p", PROTOCOLS[p]))
    else:
        steps, crossings = (2 * (ranks - 1), 2 * (nodes - 1)) if kind == "all_reduce" else (ranks - 1, nodes - 1)
        efficiency = fabric.reduce_efficiency if reducing else 1.0
        ring = min(nvlink * efficiency, net if nodes > 1 else math.inf)
        for p in range(3):
            inside = fabric.ring_step(p) if nodes > 1 else HOP_NVLINK["ring"][p]
            across = fabric.hop_across("ring", p, lone=most == 1)
            latency = _BASE["ring"][p] + (steps - crossings) * inside + crossings * across
            if p == 2 and kind == "all_reduce" and nodes > 1 and nbytes / (_CHANNELS * ranks) >= 64:
                latency *= _RING_PLATEAU
            add("ring", p, latency, ring, steps * fabric.ramp)
        if kind == "all_reduce" and nodes > 1:
            # a double binary tree: a node sends 2(N−1)/N of the tensor through its NICs, where a ring's send ~2
            tree_net = net * factor / (2 * (nodes - 1) / nodes)
            def kept(p: int) -> float:
                return _TREE * (1.0 if nodes <= 2 else fabric.tree_beyond_two(p))

            levels = math.ceil(math.log2(nodes))
            depth = 2 * (most - 1 + levels)  # up the chain and the tree, and down again
            for p in range(3):
                chain, across = (most - 1) * HOP_NVLINK["tree"][p], levels * fabric.hop_across("tree", p)
                latency = _BASE["tree"][p] + 2 * (chain + across)
                add("tree", p, latency, kept(p) * min(nvlink * efficiency, tree_net), depth * fabric.ramp)
            if fabric.nvls_busbw and most > 1:
                add("nvls_tree", 2, _NVLS_LATENCY + 2 * levels * fabric.hop_across("tree", 2),
                    min(fabric.nvls_busbw, kept(2) * tree_net * (1.0 if nodes <= 2 else _NVLS_TREE_BEYOND_TWO)),
                    fabric.nvls_ramp + 2 * levels * fabric.ramp)
        if kind == "all_reduce" and nodes == 1 and fabric.nvls_busbw:
            add("nvls", 2, _NVLS_LATENCY, fabric.nvls_busbw, fabric.nvls_ramp)
    if algorithm is not None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}: {', '.join(ALGORITHMS)}")
        options = [o for o in options if o[1] == algorithm]
        if not options:
            raise ValueError(f"NCCL runs no {kind} over {ranks} ranks on {nodes} node(s) with {algorithm!r}")
    seconds, name, protocol = min(options)
    return Cost(seconds, name, protocol, bus_bandwidth(kind, nbytes, seconds, ranks))


def _layout(devices: Sequence[str], gpus_per_node: int) -> tuple[int, int, Fabric]:
    """The nodes a group of planned devices spans, the fewest of them on one node, and the fabric
    that bounds them (a group of several kinds: each bandwidth the lowest of theirs)."""
    counts: dict[int, int] = {}
    for d in devices:
        counts[node_of(d, gpus_per_node)] = counts.get(node_of(d, gpus_per_node), 0) + 1
    fabrics = list(dict.fromkeys(fabric_of(d) for d in devices))
    fabric = fabrics[0]
    if len(fabrics) > 1:
        fabric = Fabric(
            nvlink_busbw=min(f.nvlink_busbw for f in fabrics), nic_bandwidth=min(f.nic_bandwidth for f in fabrics),
            reduce_efficiency=min(f.reduce_efficiency for f in fabrics),
            nvls_busbw=None if any(f.nvls_busbw is None for f in fabrics) else min(f.nvls_busbw or 0 for f in fabrics),
            nics_per_gpu=min(f.nics_per_gpu for f in fabrics), nic_efficiency=min(f.nic_efficiency for f in fabrics),
            lone_nic_efficiency=min(f.lone_nic_efficiency for f in fabrics),
            ll_busbw=tuple(min(f.ll_busbw[i] for f in fabrics) for i in range(3)),  # type: ignore[arg-type]
            tree_caps=(min(f.tree_caps[0] for f in fabrics), min(f.tree_caps[1] for f in fabrics)),
            tree_ll128_caps=(min(f.tree_ll128_caps[0] for f in fabrics), min(f.tree_ll128_caps[1] for f in fabrics)),
            ramp=max(f.ramp for f in fabrics), nvls_ramp=max(f.nvls_ramp for f in fabrics),
            net_latency=max(f.net_latency for f in fabrics), net_post=max(f.net_post for f in fabrics))
    return len(counts), min(counts.values()), fabric


def collective_cost(kind: str, nbytes: float, devices: Sequence[str], gpus_per_node: int = 8,
                    algorithm: Optional[str] = None) -> Cost:
    """``kind`` of ``nbytes`` over the group of planned ``devices`` (their nodes by index //
    ``gpus_per_node``), as NCCL runs it (:func:`nccl_cost`); over devices of this machine, gloo's
    ring at :data:`HOST_LINK` (algorithm ``'ring'``, protocol ``'gloo'``).

    Raises:
        ValueError: as :func:`nccl_cost`.
    """
    _check(kind, nbytes, max(len(devices), 1))
    if len(devices) < 2:
        return Cost(0.0, "", "", 0.0)
    if not all(is_planned(d) for d in devices):
        seconds = _host_seconds(kind, nbytes, len(devices))
        return Cost(seconds, "ring", "gloo", bus_bandwidth(kind, nbytes, seconds, len(devices)))
    nodes, least, fabric = _layout(devices, gpus_per_node)
    return nccl_cost(kind, nbytes, ranks=len(devices), nodes=nodes, fabric=fabric, per_node=least,
                     algorithm=algorithm)


def collective_seconds(kind: str, nbytes: float, devices: Sequence[str], gpus_per_node: int = 8) -> float:
    """Seconds of ``kind`` moving ``nbytes`` over the group ``devices`` (:func:`collective_cost`)."""
    return collective_cost(kind, nbytes, devices, gpus_per_node).seconds


def linear_cost(kind: str, nbytes: float, devices: Sequence[str], gpus_per_node: int = 8) -> tuple[float, float]:
    """The collective of ``nbytes`` as ``(latency, seconds_per_byte)``: its predicted seconds split
    into the part one call pays whatever its size (the chosen algorithm's, as at one byte) and the
    rest per byte, so that a table costing it by rows scales it linearly around ``nbytes``."""
    whole = collective_cost(kind, nbytes, devices, gpus_per_node)
    if whole.seconds <= 0 or nbytes <= 0:
        return whole.seconds, 0.0
    fixed = collective_cost(kind, 1.0, devices, gpus_per_node, algorithm=whole.algorithm or None).seconds
    fixed = min(fixed, whole.seconds)
    return fixed, (whole.seconds - fixed) / nbytes


def ring_seconds(kind: str, nbytes: float, ranks: int, seconds_per_byte: float, latency: float = 0.0) -> float:
    """Seconds of ``kind`` over a plain ring of ``ranks`` on links of ``seconds_per_byte`` and
    ``latency`` a step: ``factor · bytes · seconds_per_byte + steps · latency`` (:data:`KINDS`); 0
    on one rank. What gloo runs over this machine's loopback; planned devices are costed as NCCL
    runs them (:func:`collective_cost`).

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


def _host_seconds(kind: str, nbytes: float, ranks: int) -> float:
    """gloo over loopback: the plain ring at :data:`HOST_LINK` (an all-to-all as half an
    all-reduce's bytes: ``(n−1)/n`` of the tensor, once; a send as one step)."""
    if kind == "all_to_all":
        return ring_seconds("all_reduce", 0.5 * nbytes, ranks, *HOST_LINK)
    if kind == "send_recv":
        return nbytes * HOST_LINK[0] + HOST_LINK[1]
    return ring_seconds(kind, nbytes, ranks, *HOST_LINK)


def slowest_hop(devices: Sequence[str], gpus_per_node: int = 8) -> tuple[float, float]:
    """The seconds a byte and the latency of the slowest hop of a ring through ``devices`` (planned
    devices, in ring order, the last back to the first); for devices of this machine, gloo's
    over loopback (:data:`HOST_LINK`). A plain ring's links, one GPU's: NCCL's cost over planned
    devices is :func:`collective_cost`'s."""
    if len(devices) < 2:
        return 0.0, 0.0
    if not all(is_planned(d) for d in devices):
        return HOST_LINK
    hops = list(zip(devices, [*devices[1:], devices[0]]))
    return (max(link_seconds_per_byte(a, b, gpus_per_node) for a, b in hops),
            max(link_latency(a, b, gpus_per_node) for a, b in hops))


class Group(NamedTuple):
    """The group an ops frame's collectives run over: its ranks, the plain ring's seconds a byte and
    latency a step (:func:`slowest_hop`; what a group of this machine's ranks is costed by), and,
    for a group of planned devices, the devices and their node size, costed as NCCL runs them
    (:meth:`over` builds it)."""

    ranks: int
    seconds_per_byte: float
    latency: float
    devices: tuple[str, ...] = ()
    gpus_per_node: int = 8

    @classmethod
    def over(cls, devices: Sequence[str], gpus_per_node: int = 8) -> "Group":
        """The group of ``devices`` (planned: costed as NCCL runs them; of this machine: gloo's ring)."""
        per_byte, latency = slowest_hop(list(devices), gpus_per_node)
        planned = tuple(devices) if devices and all(is_planned(d) for d in devices) else ()
        return cls(len(devices), per_byte, latency, planned, gpus_per_node)

    def seconds(self, kind: str, nbytes: float) -> float:
        """Seconds of ``kind`` moving ``nbytes`` over the group."""
        if self.devices:
            return collective_seconds(kind, nbytes, self.devices, self.gpus_per_node)
        if kind == "all_to_all":  # (n−1)/n of the tensor, once: half an all-reduce's bytes
            return ring_seconds("all_reduce", 0.5 * nbytes, self.ranks, self.seconds_per_byte, self.latency)
        return ring_seconds(kind, nbytes, self.ranks, self.seconds_per_byte, self.latency)


def collectives_of(ops: pd.DataFrame) -> np.ndarray:
    """Each op's collective (``""`` for a kernel)."""
    if "collective" not in ops:
        return np.full(len(ops), "", dtype=object)
    return ops["collective"].fillna("").astype(str).to_numpy()


def ops_collective_seconds(ops: pd.DataFrame, rows: float, group: Optional[Group]) -> np.ndarray:
    """Each collective's seconds at ``rows`` rows over ``group`` (0 for a kernel): as NCCL runs it
    over a group of planned devices, the plain ring otherwise (:meth:`Group.seconds`).

    Raises:
        ValueError: the frame has collectives and no group is given.
    """
    names = collectives_of(ops)
    out = np.zeros(len(ops))
    if not (names != "").any():
        return out
    if group is None:
        raise ValueError("the ops frame has collectives (a tensor-parallel rank's) but no group to cost them over: "
                         "give group=Group(ranks, seconds_per_byte, latency) or Group.over(devices)")
    scale = float(rows) / float(ops.attrs["rows"])
    nbytes = ops["fixed_bytes"].to_numpy(dtype=float) + ops["row_bytes"].to_numpy(dtype=float) * scale
    for i in np.flatnonzero(names != ""):
        out[i] = group.seconds(str(names[i]), float(nbytes[i]))
    return out
