"""A device mesh: tensor (tp), context (cp), data (dp) and pipeline (pp) parallelism over the ranks.

Ranks are placed as Megatron-LM (its default order ``tp-cp-ep-dp-pp``) and torchtitan
(``init_device_mesh`` over ``("pp", "dp", "cp", "tp")``) place them: tensor-parallel ranks are
neighbours, so a tensor-parallel group sits inside a node where it fits; the pipeline's stages are
the farthest apart. Rank ``r``'s coordinates, the fastest-moving first::

    tp = r % tp          cp = r // tp % cp          dp = r // (tp·cp) % dp          pp = r // (tp·cp·dp)

    8 ranks, mesh(tp=2, dp=2, pp=2):   rank  0 1 2 3 4 5 6 7
                                       tp    0 1 0 1 0 1 0 1
                                       dp    0 0 1 1 0 0 1 1
                                       pp    0 0 0 0 1 1 1 1

A group of a dimension is the ranks that differ in that coordinate only (``tp`` groups here:
``[0, 1] [2, 3] [4, 5] [6, 7]``; ``dp``: ``[0, 2] [1, 3] [4, 6] [5, 7]``; ``pp``: ``[0, 4] …``).

Example::

    mesh = Mesh.of({"tp": 8, "pp": 8, "dp": 2}, devices=128)
    mesh.group("tp", 13)                      # (8, 9, …, 15): one node of 8 GPUs
    mesh.nodes_of("dp", 13, gpus_per_node=8)  # 2: a data-parallel group crosses nodes
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

__all__ = ["Mesh", "DIMS"]

#: The mesh's dimensions, the fastest-moving first (the order ranks are numbered in).
DIMS = ("tp", "cp", "dp", "pp")
_NAMES = {"tp": "tensor", "cp": "context", "dp": "data", "pp": "pipeline"}


@dataclass(frozen=True)
class Mesh:
    """How many ranks each kind of parallelism spans (see the module docstring); their product is
    the number of devices."""

    tp: int = 1  #: tensor-parallel ranks: each stage's layers sharded across them
    pp: int = 1  #: pipeline ranks: the stages
    dp: int = 1  #: data-parallel replicas of the whole pipeline
    cp: int = 1  #: context-parallel ranks: each sequence split across them

    def __post_init__(self) -> None:
        for dim in DIMS:
            value = getattr(self, dim)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"mesh: {dim} ({_NAMES[dim]} parallelism) is a whole number of ranks from 1, "
                                 f"got {value!r}")

    @classmethod
    def of(cls, spec: Optional[Any], devices: int) -> "Mesh":
        """The mesh a user asks for (``{"tp": 4, "pp": 8, "dp": 2}``; a dimension left out is 1;
        None: every device a pipeline stage), checked against the number of ``devices``.

        Raises:
            ValueError: a dimension that is not tp, pp, dp or cp, a size that is not a whole number
                from 1, or a product that is not the number of devices (what would fill them named).
        """
        if spec is None:
            return cls(pp=devices)
        if isinstance(spec, Mesh):
            spec = {dim: getattr(spec, dim) for dim in DIMS}
        if not isinstance(spec, Mapping):
            raise ValueError(f"mesh is a mapping of tp, pp, dp and cp to their ranks ({{'tp': 4, 'pp': 8}}), "
                             f"got {spec!r}")
        unknown = sorted(set(spec) - set(DIMS))
        if unknown:
            named = ", ".join(map(repr, unknown))
            raise ValueError(f"mesh: unknown dimension{'s' if len(unknown) > 1 else ''} {named}: "
                             f"the mesh has {', '.join(f'{d} ({_NAMES[d]})' for d in ('tp', 'pp', 'dp', 'cp'))}")
        mesh = cls(**{dim: spec[dim] for dim in DIMS if dim in spec})
        if mesh.size != devices:
            product = " × ".join(f"{dim} {getattr(mesh, dim)}" for dim in ("tp", "pp", "dp", "cp")
                                 if getattr(mesh, dim) > 1 or dim in spec) or "1"
            rest = devices // (mesh.size // mesh.dp) if devices % (mesh.size // mesh.dp) == 0 else None
            hint = f": dp={rest} would fill them" if rest and "dp" not in spec else ""
            raise ValueError(f"mesh {product} = {mesh.size} ranks, but there are {devices} devices{hint}")
        return mesh

    def describe(self, joiner: str = " · ") -> str:
        """The mesh as a person reads it, ``'tp 4 · pp 8 · dp 2'`` (``cp`` where it is above 1); the
        page's mesh field reads it back with ``joiner=" "``."""
        shown = [dim for dim in ("tp", "pp", "dp", "cp") if dim != "cp" or self.cp > 1]
        return joiner.join(f"{dim} {getattr(self, dim)}" for dim in shown)

    def place(self, rank: int) -> str:
        """Rank ``rank``'s place as a person reads it, ``'pp 1, dp 0, tp 1'`` (``cp`` where above 1):
        what a message naming a rank of the mesh says."""
        where = self.coordinates(rank)
        return ", ".join(f"{dim} {where[dim]}" for dim in ("pp", "dp", "tp", "cp") if dim != "cp" or self.cp > 1)

    @property
    def size(self) -> int:
        """Ranks in all: tp · cp · dp · pp."""
        return self.tp * self.cp * self.dp * self.pp

    def coordinates(self, rank: int) -> dict[str, int]:
        """Rank ``rank``'s place on each dimension."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is not in a mesh of {self.size} ranks (0 … {self.size - 1})")
        place, stride = {}, 1
        for dim in DIMS:
            size = getattr(self, dim)
            place[dim] = rank // stride % size
            stride *= size
        return place

    def rank(self, **coordinates: int) -> int:
        """The rank at ``coordinates`` (a dimension left out is 0)."""
        rank, stride = 0, 1
        for dim in DIMS:
            size = getattr(self, dim)
            at = coordinates.get(dim, 0)
            if not 0 <= at < size:
                raise ValueError(f"{dim} {at} is not in the mesh's {dim} of {size} (0 … {size - 1})")
            rank += at * stride
            stride *= size
        return rank

    def group(self, dim: str, rank: int) -> tuple[int, ...]:
        """The ranks of ``dim``'s group that holds ``rank``: those that differ from it in ``dim`` only."""
        if dim not in DIMS:
            raise ValueError(f"mesh: unknown dimension {dim!r}: {', '.join(DIMS)}")
        place = self.coordinates(rank)
        return tuple(self.rank(**{**place, dim: k}) for k in range(getattr(self, dim)))

    def groups(self, dim: str) -> list[tuple[int, ...]]:
        """Every group of ``dim``, by their first rank."""
        return sorted({self.group(dim, rank) for rank in range(self.size)})

    def nodes_of(self, dim: str, rank: int, gpus_per_node: int = 8) -> int:
        """How many nodes ``dim``'s group holding ``rank`` spans (rank ``r`` on node ``r // gpus_per_node``)."""
        return len({r // gpus_per_node for r in self.group(dim, rank)})

    def notes(self, gpus_per_node: int = 8) -> list[str]:
        """What the mesh does that large runs avoid (allowed, flagged): a tensor-parallel group
        across nodes, where every layer's collectives cross the slower link."""
        if self.tp > 1 and self.nodes_of("tp", 0, gpus_per_node) > 1:
            return [f"tensor parallelism across nodes: tp={self.tp} is more than the {gpus_per_node} GPUs of a node, "
                    "so every layer's all-reduce crosses the nodes' link (large runs keep tp within a node)"]
        return []
