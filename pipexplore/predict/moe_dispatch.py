"""How a mixture of experts' tokens reach their experts' ranks: each routed copy, or once a destination node and GPU.

The dispatcher (a plan's ``moe_dispatcher``, :data:`MOE_DISPATCHERS`, Megatron-Core's):
``alltoall`` (the default, ``moe_token_dispatcher_type="alltoall"``) sends each of a token's ``top_k``
copies to its expert's rank, by an all-to-all over the ``ep`` group; ``hybridep`` and ``deepep`` (the ``flex``
dispatcher's backends, DeepEP's Hybrid-EP and its normal kernels) send a token across the network
once to each other node holding any of its experts (to the GPU of the same local rank there), and
over NVLink once to each GPU of a node holding any of them (that GPU forwards what it received; the
combine runs the reverse, reduced inside a node before it crosses). Under balanced routing a
token's experts are a uniformly drawn ``top_k`` of the layer's ``E``, so a part of the ``ep`` group
holding ``E/p`` of them (a node, a GPU) receives it with probability ``1 − C(E − E/p, k) / C(E, k)``
(:func:`dispatch_copies`). The two legs run at once (the network's and NVLink's, pipelined), each
costed as an all-to-all of the copies it carries (over the group, over a node's GPUs of it); the
slower is the exchange's.

The copies a GPU sends are what :func:`dispatch_copies` gives; :func:`dispatch_cost` costs an
exchange so for :func:`pipexplore.predict.mesh_costs.mesh_layer_table` (the legs as
:func:`pipexplore.predict.collectives.linear_cost` costs an ``all_to_all``). Sources: Megatron-Core's
``token_dispatcher.py`` (``MoEAlltoAllTokenDispatcher``, ``MoEFlexTokenDispatcher`` with its
``_HybridEPManager`` and DeepEP manager) and DeepEP's ``docs/Hybrid-EP_Implementation.md`` ("RDMA
communication pattern": peers of the same local rank across nodes, then NVLink inside; an RDMA buffer
of one token a remote node); HybridEP dispatches bf16 (Megatron-Core's ``fused_a2a.py`` refuses FP8
dispatch), the bytes the count's.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

from pipexplore import validate
from pipexplore.devices import node_of
from pipexplore.predict.collectives import linear_cost

__all__ = ["MOE_DISPATCHERS", "check_dispatcher", "dispatch_copies", "dispatch_cost"]

#: How a mixture of experts' tokens reach their experts' ranks: each routed copy by
#: an all-to-all (Megatron-Core's ``alltoall`` dispatcher), or once a destination node and GPU
#: (its ``flex`` dispatcher with ``moe_flex_dispatcher_backend`` ``hybridep`` or ``deepep``).
MOE_DISPATCHERS = ("alltoall", "hybridep", "deepep")


def check_dispatcher(name: str) -> str:
    """``name`` where it is one of :data:`MOE_DISPATCHERS`.

    Raises:
        ValueError: another name, the known ones named.
    """
    return validate.one_of(name, "moe_dispatcher", MOE_DISPATCHERS,
                           "each routed copy by an all-to-all; once a destination node and GPU")


def _reached(experts: int, top_k: int, parts: int) -> float:
    """The probability that a token's ``top_k`` experts, a uniformly drawn ``top_k`` of ``experts``
    (balanced routing), include one of a part's ``experts / parts``: ``1 − C(E − E/p, k) / C(E, k)``."""
    return 1.0 - math.comb(experts - experts // parts, top_k) / math.comb(experts, top_k)


def dispatch_copies(experts: int, top_k: int, ranks: int, nodes: int,
                    dispatcher: str = "alltoall") -> tuple[float, float]:
    """The copies of one of its tokens a GPU of an ``ep`` group of ``ranks`` GPUs over ``nodes``
    nodes (as many on each) sends in a layer's dispatch (its combine receives as many), under
    balanced routing over ``experts`` experts spread evenly over the group, each token to
    ``top_k``: ``(across nodes, over NVLink inside one)``. ``alltoall``: every routed copy, its
    expert's rank's share of them ``(k·(G − g)/G, k·(g − 1)/G)`` (``g = G/N`` a node); ``hybridep``,
    ``deepep``: once to each other node holding any of its experts and once to each GPU, other than
    the one it arrives at, of each node holding any: ``((N − 1)·P_N, N·(g − 1)·P_G)``, ``P_p`` the
    probability that a part of ``p`` receives it (the module docstring).

    Raises:
        ValueError: an unknown dispatcher, a group that does not split evenly over its nodes or
            whose ranks do not split the experts, ``top_k`` out of 1 … ``experts``.
    """
    check_dispatcher(dispatcher)
    if ranks < 1 or nodes < 1 or ranks % nodes or experts % ranks or not 1 <= top_k <= experts:
        raise ValueError(f"{experts} experts, top_k {top_k}, over {ranks} ranks on {nodes} nodes: the ranks "
                         "split evenly over the nodes and hold as many experts each, and a token goes to 1 … "
                         "experts of them")
    per = ranks // nodes
    if dispatcher == "alltoall":
        return top_k * (ranks - per) / ranks, top_k * (per - 1) / ranks
    return ((nodes - 1) * _reached(experts, top_k, nodes) if nodes > 1 else 0.0,
            nodes * (per - 1) * _reached(experts, top_k, ranks) if per > 1 else 0.0)


def dispatch_cost(point: float, group: Sequence[str], gpus_per_node: int, dispatcher: str,
                  experts: Optional[dict]) -> tuple[float, float]:
    """An exchange of ``dispatcher`` whose ``alltoall`` would carry ``point`` bytes (``top_k``
    copies of a micro-batch's tokens) over ``group``, as ``(latency, seconds a byte of that all-to-all)``:
    the all-to-all itself, or the deduplicating dispatchers' two legs (:func:`dispatch_copies`: the
    copies crossing nodes as an all-to-all over the group, those inside a node over its GPUs of the
    group, the slower at ``point``). A group whose nodes hold unequal numbers of its GPUs, or a table
    that does not say its experts, is costed as the all-to-all."""
    count, top_k = int((experts or {}).get("count") or 0), int((experts or {}).get("top_k") or 0)
    places = [node_of(d, gpus_per_node) for d in group]
    nodes = sorted(set(places))
    if dispatcher == "alltoall" or not count or not top_k or len({places.count(n) for n in nodes}) > 1:
        return linear_cost("all_to_all", point, group, gpus_per_node)
    ranks, per = len(group), len(group) // len(nodes)
    across, nvlink = dispatch_copies(count, top_k, ranks, len(nodes), dispatcher)
    legs = []  # (the all-to-all's bytes for one byte of alltoall's, its group): what crosses, and its own share kept
    if across > 0:
        legs.append((across * len(nodes) / (len(nodes) - 1) / top_k, list(group)))
    if nvlink > 0:
        legs.append((nvlink * per / (per - 1) / top_k, [d for d, n in zip(group, places) if n == nodes[0]]))
    best = (0.0, 0.0, 0.0)
    for scale, devices in legs:
        latency, rate = linear_cost("all_to_all", point * scale, devices, gpus_per_node)
        if latency + rate * point * scale > best[0]:
            best = (latency + rate * point * scale, latency, rate * scale)
    return best[1], best[2]
