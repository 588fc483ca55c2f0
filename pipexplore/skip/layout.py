"""Where each skip route starts and ends among the partitions of a pipeline."""
from __future__ import annotations

from typing import Iterable, Sequence

from torch import nn

from pipexplore.skip.namespace import Namespace

__all__ = ["SkipLayout", "inspect_skip_layout"]

Route = tuple[Namespace, str]


def _ns_key(ns: Namespace) -> str:
    return "" if ns is None else str(ns.id)


class SkipLayout:
    """Skip routes of a pipeline.

    ``by_ns_name[(ns, name)] == (stash_partition, pop_partition)``;
    ``by_partition[pop_partition]`` lists ``(stash_partition, ns, name)`` for routes ending there.
    """

    def __init__(self, num_partitions: int, skip_routes: dict[Route, tuple[int, int]]) -> None:
        self.num_partitions = num_partitions
        self.by_ns_name = dict(skip_routes)
        self.by_partition: list[list[tuple[int, Namespace, str]]] = [[] for _ in range(num_partitions)]
        for (ns, name), (stash_partition, pop_partition) in skip_routes.items():
            self.by_partition[pop_partition].append((stash_partition, ns, name))
        for routes in self.by_partition:
            routes.sort(key=lambda r: (r[0], _ns_key(r[1]), r[2]))

    def copy_policy(self, pop_partition: int) -> Iterable[tuple[int, Namespace, str]]:
        """The routes into ``pop_partition`` that come from another partition (need a copy)."""
        for stash_partition, ns, name in self.by_partition[pop_partition]:
            if stash_partition != pop_partition:
                yield stash_partition, ns, name

    def requires_copy(self, ns: Namespace, name: str) -> bool:
        """Whether the route ``(ns, name)`` crosses partitions."""
        stash_partition, pop_partition = self.by_ns_name.get((ns, name), (-1, -1))
        return stash_partition != pop_partition

    def crossing(self) -> list[tuple[Namespace, str, int, int]]:
        """``(ns, name, stash_partition, pop_partition)`` for every route that crosses partitions."""
        return [(ns, name, s, p) for (ns, name), (s, p) in self.by_ns_name.items() if s != p]

    def __repr__(self) -> str:
        routes = ", ".join(f"{name!r}: {s}->{p}" for (_, name), (s, p) in self.by_ns_name.items())
        return f"SkipLayout({self.num_partitions} partitions; {routes})"


def inspect_skip_layout(partitions: Sequence[nn.Sequential]) -> SkipLayout:
    """Find every skip route among ``partitions`` (each an ``nn.Sequential``)."""
    from pipexplore.skip.skippable import Skippable

    skip_routes: dict[Route, tuple[int, int]] = {}
    stashed_at: dict[Route, int] = {}
    for j, partition in enumerate(partitions):
        for layer in partition.children():
            if not isinstance(layer, Skippable):
                continue
            for ns, name in layer.stashable():
                stashed_at[(ns, name)] = j
            for ns, name in layer.poppable():
                if (ns, name) in stashed_at:
                    skip_routes[(ns, name)] = (stashed_at.pop((ns, name)), j)
    return SkipLayout(len(partitions), skip_routes)
