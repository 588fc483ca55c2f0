"""A device mesh: tensor (tp), context (cp), data (dp) and pipeline (pp) parallelism over the ranks,
and a mixture of experts' expert (ep) and expert-tensor (etp) parallelism folded over the same GPUs.

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

The experts fold over the same GPUs (Megatron-Core's parallel folding; torchtitan's sparse mesh,
whose ``efsdp`` is ``edp`` here): attention and dense layers run on ``tp × cp × dp × pp``, a
mixture of experts' routed experts on ``etp × ep × edp × pp``, where each pipeline stage's
``tp · cp · dp`` GPUs are cut ``etp`` fastest, then ``ep``, then ``edp = tp·cp·dp / (ep·etp)``
(Megatron-Core's expert order ``tp-ep-dp-pp``). ``ep × etp`` must divide ``tp · cp · dp``, and
``ep`` the model's experts (:meth:`Mesh.of` with ``experts``)::

    16 ranks, mesh(tp=2, dp=8, ep=4):   rank   0 1 2 3 4 5 6 7 8 …
                                        etp    0 0 0 0 0 0 0 0 0        (etp 1)
                                        ep     0 1 2 3 0 1 2 3 0
                                        edp    0 0 0 0 1 1 1 1 2

Example::

    mesh = Mesh.of({"tp": 8, "pp": 8, "dp": 2}, devices=128)
    mesh.group("tp", 13)                      # (8, 9, …, 15): one node of 8 GPUs
    mesh.nodes_of("dp", 13, gpus_per_node=8)  # 2: a data-parallel group crosses nodes
    moe = Mesh.of({"tp": 2, "pp": 8, "dp": 16, "ep": 32}, devices=256, experts=128)
    moe.edp, moe.group("ep", 0)               # 1, (0, 1, …, 31)

Where the mesh's other parts live, layer by layer (imports run one way, ``tests/test_layers.py``):

======================================  =========================================================
``devices/links.py``                    the links between planned devices (NVLink, the network)
``predict/collectives.py``              what a collective costs over a group, as NCCL runs it
``predict/mesh_costs.py``               what a mesh adds to a rank's step: dp, FSDP, sends, all-to-alls
``predict/fsdp_actions.py``             FSDP's gathers and reduce-scatters placed in the schedule
``predict/memory.py``                   training memory a GPU, experts and ZeRO/FSDP sharding included
``predict/mesh_search.py``              every factorisation of the devices, the fastest that fits
``models/sharded.py``                   a block as tensor parallelism shards it, counted by torch
``models/expert_parallel.py``           a mixture of experts' blocks at a tp × ep mesh, counted
``models/ep_rank.py``, ``experts.py``   one ep rank's experts and its all-to-alls; where experts are
``models/rank_here.py``                 one tensor-parallel rank of a model run on this machine
``executors/distributed.py``            one process per rank, meshes of this machine's CPUs run
``export/mesh_parts.py``                what an exported ``torchrun`` script runs on each mesh rank
``export/expert_parts.py``              the exported script's expert parallelism
``widgets/mesh_choice.py``              the explorer's mesh: which one it plans and how replicas share
======================================  =========================================================
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

__all__ = ["Mesh", "DIMS", "EXPERT_DIMS"]

#: The mesh's dimensions, the fastest-moving first (the order ranks are numbered in).
DIMS = ("tp", "cp", "dp", "pp")
#: The experts' dimensions over the same ranks, the fastest-moving first (``edp`` follows from the others).
EXPERT_DIMS = ("etp", "ep", "edp", "pp")
#: What a mesh given as a mapping may name, in the order a person reads it.
_GIVEN = ("tp", "pp", "dp", "cp", "ep", "etp")
_NAMES = {"tp": "tensor", "cp": "context", "dp": "data", "pp": "pipeline", "ep": "expert", "etp": "expert-tensor",
          "edp": "expert-data"}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Mesh:
    """How many ranks each kind of parallelism spans (see the module docstring); their product is
    the number of devices."""

    tp: int = 1  #: tensor-parallel ranks: each stage's layers sharded across them
    pp: int = 1  #: pipeline ranks: the stages
    dp: int = 1  #: data-parallel replicas of the whole pipeline
    cp: int = 1  #: context-parallel ranks: each sequence split across them
    ep: int = 1  #: expert-parallel ranks: each holds ``1/ep`` of a layer's routed experts
    etp: int = 1  #: expert-tensor-parallel ranks: each expert's widths sharded across them

    def __post_init__(self) -> None:
        for dim in (*DIMS, "ep", "etp"):
            value = getattr(self, dim)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"mesh: {dim} ({_NAMES[dim]} parallelism) is a whole number of ranks from 1, "
                                 f"got {value!r}")
        stage = self.tp * self.cp * self.dp
        if stage % (self.ep * self.etp):
            raise ValueError(f"mesh: ep {self.ep} × etp {self.etp} = {self.ep * self.etp} does not divide "
                             f"tp·cp·dp = {stage}, the GPUs of a pipeline stage the experts are folded over: "
                             f"{self._folds()}")

    def _folds(self, experts: Optional[int] = None, etp: Optional[int] = None) -> str:
        """The expert degrees that fold over a stage's ``tp · cp · dp`` GPUs (and divide ``experts``):
        at ``etp`` (default: the mesh's) where it divides them, else at 1 and ``tp`` (torchtitan's two)."""
        stage = self.tp * self.cp * self.dp
        etp = self.etp if etp is None else etp
        etps = [etp] if stage % etp == 0 else sorted({1, self.tp})
        said = []
        for etp in etps:
            eps = [e for e in _divisors(stage // etp) if experts is None or experts % e == 0]
            said.append(f"with etp {etp}, ep can be {', '.join(map(str, eps))}")
        return "; ".join(said)

    @classmethod
    def of(cls, spec: Optional[Any], devices: int, experts: Optional[int] = None) -> "Mesh":
        """The mesh a user asks for (``{"tp": 4, "pp": 8, "dp": 2}``, ``"ep"`` and ``"etp"`` for a
        mixture of experts; a dimension left out is 1; None: every device a pipeline stage), checked
        against the number of ``devices`` and, where given, the model's routed ``experts`` (0: a
        model without).

        Raises:
            ValueError: a dimension that is not tp, pp, dp, cp, ep or etp, a size that is not a whole
                number from 1, a product that is not the number of devices (what would fill them
                named), ``ep × etp`` that does not divide ``tp · cp · dp`` or ``ep`` that does not
                divide the experts (the degrees that would, named), ``ep`` or ``etp`` above 1 for a
                model without experts.
        """
        if spec is None:
            return cls(pp=devices)
        if isinstance(spec, Mesh):
            spec = {dim: getattr(spec, dim) for dim in _GIVEN}
        if not isinstance(spec, Mapping):
            raise ValueError(f"mesh is a mapping of tp, pp, dp and cp (ep and etp for experts) to their ranks "
                             f"({{'tp': 4, 'pp': 8}}), got {spec!r}")
        unknown = sorted(set(spec) - set(_GIVEN))
        if unknown:
            named = ", ".join(map(repr, unknown))
            raise ValueError(f"mesh: unknown dimension{'s' if len(unknown) > 1 else ''} {named}: "
                             f"the mesh has {', '.join(f'{d} ({_NAMES[d]})' for d in _GIVEN)}")
        for dim in _GIVEN:
            value = spec.get(dim, 1)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"mesh: {dim} ({_NAMES[dim]} parallelism) is a whole number of ranks from 1, "
                                 f"got {value!r}")
        plain = {dim: spec[dim] for dim in DIMS if dim in spec}
        size = cls(**plain).size
        if size != devices:
            mesh = cls(**plain)
            product = " × ".join(f"{dim} {getattr(mesh, dim)}" for dim in ("tp", "pp", "dp", "cp")
                                 if getattr(mesh, dim) > 1 or dim in spec) or "1"
            rest = devices // (mesh.size // mesh.dp) if devices % (mesh.size // mesh.dp) == 0 else None
            hint = f": dp={rest} would fill them" if rest and "dp" not in spec else ""
            raise ValueError(f"mesh {product} = {mesh.size} ranks, but there are {devices} devices{hint}")
        ep, etp = spec.get("ep", 1), spec.get("etp", 1)
        if experts == 0 and ep * etp > 1:
            raise ValueError(f"mesh: ep {ep}, etp {etp}: expert parallelism folds a mixture of experts' routed "
                             "experts, and this model has none (its config names no expert count, "
                             "num_local_experts, num_experts or n_routed_experts): leave ep and etp at 1")
        dense = cls(**plain)
        stage = dense.tp * dense.cp * dense.dp
        if stage % (ep * etp):
            folds = dense._folds(experts, etp)
            raise ValueError(f"mesh: ep {ep} × etp {etp} = {ep * etp} does not divide tp·cp·dp = {stage}, the GPUs "
                             f"of a pipeline stage the experts are folded over: {folds}")
        mesh = replace(dense, ep=ep, etp=etp)
        mesh.check_experts(experts)
        return mesh

    def check_experts(self, experts: Optional[int]) -> None:
        """Refuse an ``ep`` that does not divide the model's ``experts`` routed experts (None: not
        known), naming the degrees that would do."""
        if experts and experts % self.ep:
            raise ValueError(f"mesh: ep {self.ep} does not divide the model's {experts} routed experts (each "
                             f"expert-parallel rank holds a whole share of them): {self._folds(experts)}")

    @property
    def edp(self) -> int:
        """Expert-data-parallel ranks: the replicas of each expert's shard, ``tp·cp·dp / (ep·etp)``."""
        return self.tp * self.cp * self.dp // (self.ep * self.etp)

    @property
    def has_experts(self) -> bool:
        """Whether the experts are folded otherwise than as the dense layers' replicas (``ep`` or ``etp`` above 1)."""
        return self.ep * self.etp > 1

    def describe(self, joiner: str = " · ") -> str:
        """The mesh as a person reads it, ``'tp 4 · pp 8 · dp 2'`` (``cp``, ``ep`` and ``etp`` where
        above 1); the page's mesh field reads it back with ``joiner=" "``."""
        shown = [dim for dim in _GIVEN if dim in ("tp", "pp", "dp") or getattr(self, dim) > 1]
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

    def expert_coordinates(self, rank: int) -> dict[str, int]:
        """Rank ``rank``'s place on the experts' dimensions (:data:`EXPERT_DIMS`): its stage's
        ``tp · cp · dp`` ranks cut ``etp`` fastest, then ``ep``, then ``edp``."""
        local = rank % (self.tp * self.cp * self.dp)
        return {"etp": local % self.etp, "ep": local // self.etp % self.ep, "edp": local // (self.etp * self.ep),
                "pp": self.coordinates(rank)["pp"]}

    def group(self, dim: str, rank: int) -> tuple[int, ...]:
        """The ranks of ``dim``'s group that holds ``rank``: those that differ from it in ``dim`` only
        (``dim`` one of :data:`DIMS` or of the experts' ``etp``, ``ep``, ``edp``)."""
        if dim in ("etp", "ep", "edp"):
            place = self.expert_coordinates(rank)
            stride = {"etp": 1, "ep": self.etp, "edp": self.etp * self.ep}[dim]
            base = rank - place[dim] * stride
            return tuple(base + k * stride for k in range(getattr(self, dim)))
        if dim not in DIMS:
            raise ValueError(f"mesh: unknown dimension {dim!r}: {', '.join((*DIMS, 'etp', 'ep', 'edp'))}")
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
