"""What a node of each kind gives NCCL: its fabric (:class:`Fabric`) — the bandwidth NCCL's rings
reach over NVLink and with NVLink SHARP, the node's NICs and what NCCL reaches of them, NCCL's caps per
protocol, and the latency of a step across nodes — for the catalogue's kinds with their sources
(:data:`FABRICS`), else read from a kind's spec (:func:`fabric_of`). What a collective costs over
them: :mod:`pipexplore.predict.collectives`.

Example::

    fabric_of("H100").nvls_busbw                  # 480e9: NVLink SHARP on eight H100s
    fabric_of("H100-p5").hop_across("ring", 2)    # 164.0 µs: a Simple step over EFA, as NCCL costs it
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from pipexplore.devices import device_spec
from pipexplore.devices.catalogue import DeviceSpec

__all__ = ["PROTOCOLS", "HOP_NVLINK", "Fabric", "FABRICS", "fabric_of"]

PROTOCOLS = ("LL", "LL128", "Simple")
# NCCL's latency of a step (src/graph/tuning.cc hwLat, NCCL 2.18–2.29), µs per protocol, by algorithm:
# over NVLink, and across nodes before the network's own latency (Fabric.net_latency) is added.
HOP_NVLINK = {"ring": (0.6, 1.9, 3.4), "tree": (0.6, 1.25, 4.0), "p2p": (0.6, 1.9, 3.4)}
_HOP_NET = {"ring": (2.7, 4.0, 14.0), "tree": (5.0, 8.5, 14.0), "p2p": (2.7, 4.0, 14.0)}


@dataclass(frozen=True)
class Fabric:
    """What a node of one device kind gives NCCL, bandwidths in bytes per second per direction.

    ``nvlink_busbw``: the bus bandwidth NCCL's ring reaches inside a node on large messages that move
    data (an all-gather's), below the NVLink line rate by NCCL's protocol overhead;
    ``reduce_efficiency``: the fraction of it a reducing collective (all-reduce, reduce-scatter)
    keeps (the GPU adds as it forwards); ``nvls_busbw``: an all-reduce's bus bandwidth with NVLink
    SHARP (``None`` where the NVSwitch has none). ``nics_per_gpu`` NICs of ``nic_bandwidth`` each
    (line rate) per GPU, ``nic_efficiency`` of it reached by NCCL: a group with ``k`` GPUs on a node
    crosses nodes at ``k · nics_per_gpu · nic_bandwidth · nic_efficiency``; a group with one GPU on
    a node (a data-parallel group beside tensor parallelism 8, a send between stages) reaches only
    ``lone_nic_efficiency`` of its NIC (NCCL opens fewer channels over it). ``ll_busbw``: NCCL's cap
    on the LL protocol inside one node, across two, across more (``llMaxBws``); ``tree_caps`` and
    ``tree_ll128_caps``: NCCL's bandwidth caps on a tree's channel across two nodes and across four
    or more (``perChMaxTreeBws``, every protocol; ``perChMaxTreeLL128Bws``, LL128 besides), whose
    ratio is what the tree keeps of its two-node bandwidth beyond two (:meth:`tree_beyond_two`: its
    reduction tree deepens). ``ramp``:
    seconds a pipeline step adds to the fill of the module docstring's formula (a ring all-reduce
    has ``2(n−1)`` steps, a tree ``2·(GPUs a node − 1 + log2 N)``, an all-to-all ``n−1`` rounds of
    sends, a send one); ``nvls_ramp``: NVLink
    SHARP's, for its one step inside a node. ``net_latency``: the latency (µs) the network's plugin
    reports to NCCL (``ncclNetProperties.latency``; 0 for NCCL's own InfiniBand), which NCCL's tuner
    adds to every step across nodes (:meth:`hop_across`). ``net_post``: NCCL's cost (µs) of posting a
    network operation from the node's CPUs (``getNetOverhead``: 1 on Intel hosts, 2 on AMD ones),
    below which no step of a ring that crosses nodes goes (:meth:`ring_step`).
    """

    nvlink_busbw: float
    nic_bandwidth: float
    reduce_efficiency: float = 1.0
    nvls_busbw: Optional[float] = None
    nics_per_gpu: float = 1.0
    nic_efficiency: float = 0.9
    lone_nic_efficiency: float = 0.75
    ll_busbw: tuple[float, float, float] = (87.7e9, 22.5e9, 19.0e9)
    tree_caps: tuple[float, float] = (23.6, 17.8)
    tree_ll128_caps: tuple[float, float] = (20.0, 20.0)
    ramp: float = 0.1e-6
    nvls_ramp: float = 5e-6
    net_latency: float = 0.0
    net_post: float = 1.0
    source: str = ""

    def hop_across(self, algorithm: str, protocol: int, lone: bool = False) -> float:
        """The latency (µs) of a step across nodes with ``algorithm`` and ``protocol`` (an index of
        :data:`PROTOCOLS`), as NCCL's tuner costs it (``tuning.cc``): its network figure (the tree's
        for a ring where one GPU a node takes part, ``lone``: "latencies are fully exposed"), plus
        the network's own latency (``net_latency``), twice with Simple ("the flush extra latency")."""
        figure = _HOP_NET["tree" if lone and algorithm == "ring" else algorithm][protocol]
        return figure + self.net_latency * (2 if PROTOCOLS[protocol] == "Simple" else 1)

    def ring_step(self, protocol: int) -> float:
        """The least latency (µs) of a step inside a node of a ring that crosses nodes: NCCL's tuner
        has every step post its network operation ("inter-node rings still have to launch nsteps *
        net overhead"), Simple's three (``net_post`` × 3)."""
        return max(HOP_NVLINK["ring"][protocol], self.net_post * (3 if PROTOCOLS[protocol] == "Simple" else 1))

    def tree_beyond_two(self, protocol: int) -> float:
        """What a tree keeps of its two-node bandwidth on 4+ nodes with ``protocol`` (an index of
        :data:`PROTOCOLS`) as NCCL's tuner caps a channel (``tuning.cc``): every protocol at
        ``perChMaxTreeBws``, LL128 then at 120/128 of it and at ``perChMaxTreeLL128Bws``."""
        two, more = self.tree_caps
        if PROTOCOLS[protocol] != "LL128":
            return more / two
        ll128_two, ll128_more = self.tree_ll128_caps
        return min(more * 120 / 128, ll128_more) / min(two * 120 / 128, ll128_two)


# DGX A100 — NVIDIA DGX A100 User Guide, "Introduction to the NVIDIA DGX A100 System"
# (https://docs.nvidia.com/dgx/dgxa100-user-guide/introduction-to-dgxa100.html): eight A100 SXM4 on
# six NVSwitches, NVLink 3 at 600 GB/s a GPU (300 a direction); eight single-port ConnectX-6 at
# 200 Gb/s HDR InfiniBand for the compute fabric, one per GPU; two AMD EPYC 7742 CPUs.
_DGX_A100 = Fabric(
    # all-gather 253.6 and all-to-all 254.7 GB/s bus bandwidth at 1 GiB on eight A100s (Microsoft,
    # mscclpp docs/performance-ndmv4.md, NCCL 2.17.1); all-reduce 231.5 there: 91 % of it
    nvlink_busbw=255e9, reduce_efficiency=0.91,
    # "the peak for 200G HDR is 24GB/s" (NCCL's maintainer, NVIDIA/nccl#412, 2023-04-24): 96 %; so a
    # node's eight reach 192 GB/s, what NVIDIA measures on DGX A100 (NVIDIA/nccl#812, 2023-03-31)
    nic_bandwidth=25e9, nic_efficiency=0.96,
    # one A100 a node, two nodes: all-reduce 18.65 GB/s at 1 GiB (mscclpp docs/performance-ndmv4.md)
    lone_nic_efficiency=0.75,
    ll_busbw=(87.7e9, 22.5e9, 19.0e9),  # tuning.cc llMaxBws: Ampere in one node; AMD hosts across nodes
    tree_caps=(23.6, 17.8), tree_ll128_caps=(20.0, 20.0),  # tuning.cc per-channel tree caps, Ampere: 2 nodes, 4+
    ramp=6e-6 / 14,  # read from the published single-node all-reduce curve, 14 steps (benchmarks/nccl_tests.py)
    net_post=2.0,  # tuning.cc getNetOverhead: AMD hosts
    source="DGX A100 User Guide; nccl-tests figures in benchmarks/nccl_tests.py")
# DGX H100 — NVIDIA DGX H100 User Guide, "Introduction to the NVIDIA DGX H100 System"
# (https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html): eight H100 SXM5 on
# four NVSwitches (NVLink 4, 900 GB/s a GPU, 450 a direction, NVLink SHARP); eight ConnectX-7 at
# 400 Gb/s NDR InfiniBand (in four OSFP cages, two ports each), one per GPU; Intel Xeon 8480C CPUs.
_DGX_H100 = Fabric(
    # "with the protocol overhead (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s ...
    # [with NVLink SHARP] on 8 GPUs you should reach a peak busBw of ~480GB/s" (NCCL's maintainer,
    # NVIDIA/nccl-tests#212, 2024-05-06)
    nvlink_busbw=370e9, reduce_efficiency=1.0, nvls_busbw=480e9,
    # "CX-7 NICs at NDR rate (400Gbps) should achieve up to 48-49GB/s per NIC" (NVIDIA/nccl-tests#267)
    nic_bandwidth=50e9, nic_efficiency=0.97,
    lone_nic_efficiency=0.75,  # not published for H100s: the A100's
    ll_busbw=(141e9, 39.0e9, 20.4e9),  # tuning.cc llMaxBws: Hopper in one node; Intel hosts across nodes
    tree_caps=(41.4, 36.0), tree_ll128_caps=(36.7, 29.0),  # tuning.cc per-channel tree caps, Hopper: 2 nodes, 4+
    ramp=0.2e-6 / 14, nvls_ramp=5e-6,  # read from the published single-node all-reduce curves (nccl_tests.py)
    net_post=1.0,  # tuning.cc getNetOverhead: Intel hosts
    source="DGX H100 User Guide; nccl-tests figures in benchmarks/nccl_tests.py")
# AWS p5.48xlarge (https://aws.amazon.com/ec2/instance-types/p5/): a DGX H100's GPUs and NVSwitches;
# across nodes 32 EFA v2 interfaces of 100 Gb/s, four (400 Gb/s) a GPU, and AMD EPYC hosts. NCCL runs
# over EFA through aws-ofi-nccl, which reports a network latency of 75 µs to NCCL on p5 and p5e
# (src/platform-aws.cpp, platform "p5/p5e", ``.latency = 75.0``, v1.16.3: "Empirical testing on P5 had
# shown that NCCL's internal tuner choices work better with this value"); NCCL's tuner adds it to each
# step across nodes, where its own InfiniBand figures are 2.7–14 µs. No EFA efficiency is published:
# the NIC's is the NDR one's.
_P5 = replace(
    _DGX_H100, nic_bandwidth=12.5e9, nics_per_gpu=4, net_latency=75.0,
    ll_busbw=(141e9, 22.5e9, 19.0e9),  # tuning.cc llMaxBws: Hopper in one node; AMD hosts across nodes
    net_post=2.0,  # tuning.cc getNetOverhead: AMD hosts
    source="AWS p5 instance page; aws-ofi-nccl (EFA's latency as it reports it to NCCL); the DGX H100's NVLink "
           "figures")
#: The fabric of the catalogue's kinds that run in DGX nodes (the DGX H200 has the DGX H100's
#: NVSwitches and NICs) and in AWS's p5; other kinds get :func:`fabric_of`'s default from their spec.
FABRICS: dict[str, Fabric] = {"A100-40GB": _DGX_A100, "A100-80GB": _DGX_A100, "H100": _DGX_H100, "H200": _DGX_H100,
                              "H100-p5": _P5}


def fabric_of(device: str | DeviceSpec) -> Fabric:
    """The fabric of a planned device's kind: :data:`FABRICS`'s, else one read from its spec —
    NCCL's ring at 80 % of the intra-node link (its ~20 % protocol overhead), one NIC a GPU at the
    spec's ``inter_node_bandwidth`` (its share of the node's NICs) and 90 % of it, no NVLink SHARP."""
    spec = device_spec(device)
    if spec.name in FABRICS:
        return FABRICS[spec.name]
    return Fabric(nvlink_busbw=0.8 * spec.intra_node_bandwidth, nic_bandwidth=spec.inter_node_bandwidth,
                  source=f"{spec.name}: read from its spec (intra_node_bandwidth, inter_node_bandwidth)")
