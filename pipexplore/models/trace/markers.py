"""One export of a model for all its splits: torch's splitter run on a kept graph.

``torch.distributed.pipelining.pipeline`` exports the model (``torch.export``) with a
``pipe_split()`` call at the start of each split point and splits the graph at those calls, so
a split at other points is another export of the same model: most of a split's time (1.5 s of
2.4 s for a tiny Hugging Face model on a 2-core CPU). A :class:`MarkedExport` is the model
exported once with a marker at every module a stage may begin at (the candidates of both
granularities and the points asked for); a split at any of them is that graph with the other
markers removed, handed to torch's splitter (``Pipe.from_tracing``) in place of a new export
(:func:`exporting`). The graph does not depend on where the markers are (each is a call with no
inputs or outputs, recorded where forward made it), so the stages are what an export marked at
the split points alone would give.

:func:`pipexplore.models.trace.pipes.traced_pipe` keeps one per model shape and micro-batch
shape, its weights on the meta device (no memory: :meth:`MarkedExport.detached`); the pipe of a
split made from it takes the model's tensors as a kept split's does.

Where export keeps a marker apart from the others (one inside an autocast block, or a ``no_grad``
block that needs a gradient, is in a region of its own; a constant ``no_grad`` region is inlined
first, its marker with it), the markers in the graph do not follow the calls one for one, and
where a split point was not marked, :class:`MarkersMoved` is raised: the split is then exported
again (``traced_pipes``), at its own points where the markers were what failed.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import fx, nn

from pipexplore.models.trace.candidates import GRANULARITIES, candidate_modules

__all__ = ["MarkedExport", "MarkersMoved", "marks_for", "mark_beginnings", "keep_markers", "exporting"]

#: One thread at a time replaces torch's export step (other threads' splits export as usual).
_lock = threading.RLock()


class MarkersMoved(RuntimeError):
    """The exported graph's markers are not one per marked call in call order."""


@dataclass(frozen=True)
class MarkedExport:
    """A model's export with a marker at each call of a marked module."""

    #: The ``torch.export.ExportedProgram``.
    program: Any
    #: The FQN of the module each marker begins, in the graph's order (a module called twice: twice).
    order: tuple[str, ...]
    #: The modules marked (those forward never called have no marker in ``order``).
    marked: frozenset[str] = frozenset()

    def detached(self) -> "MarkedExport":
        """This export with its parameters and buffers on the meta device: it holds none of the
        traced model's memory (a split of it takes the tensors of the model it is given:
        :func:`exporting`).

        Raises:
            MarkersMoved: this torch keeps an export's state where this module cannot reach it.
        """
        state = self._state()
        for name, tensor in list(state.items()):
            meta = torch.empty_like(tensor, device="meta")
            state[name] = nn.Parameter(meta, requires_grad=tensor.requires_grad) \
                if isinstance(tensor, nn.Parameter) else meta
        return self

    def attach(self, model: nn.Module) -> None:
        """Point the export's parameters and buffers (and its constants that are ``model``'s
        buffers) at ``model``'s own tensors, as an export of ``model`` itself would hold them: a
        weight tied under two names is one tensor there, which the splitter keeps tied.

        Raises:
            MarkersMoved: the export names a tensor ``model`` does not have.
        """
        state, named = self._state(), model.state_dict(keep_vars=True)
        buffers = dict(model.named_buffers(remove_duplicate=False))
        missing = [name for name in state if name not in named]
        if missing:
            raise MarkersMoved(f"the export holds {missing[:3]}, which the model does not")
        for name in state:
            state[name] = named[name]
        constants = getattr(self.program, "_constants", {})
        for name in constants:
            if name in buffers:
                constants[name] = buffers[name]

    def _state(self) -> dict[str, Any]:
        state = getattr(self.program, "_state_dict", None)
        if not isinstance(state, dict):
            raise MarkersMoved("this torch's ExportedProgram keeps its state elsewhere")
        return state


def marks_for(model: nn.Module, points: Sequence[str]) -> list[str]:
    """Where an export that serves every split marks: ``points`` and the candidate modules of both
    granularities (:func:`~pipexplore.models.trace.candidate_modules`)."""

    found = dict.fromkeys(points)
    for granularity in GRANULARITIES:
        found.update(dict.fromkeys(name for name, _ in candidate_modules(model, granularity)))
    return list(found)


def mark_beginnings(model: nn.Module, points: Sequence[str], order: list[str]) -> list[tuple[nn.Module, Any]]:
    """Make each point's forward call ``pipe_split()`` first (``SplitPoint.BEGINNING``), noting
    its FQN in ``order`` at each call; returns each module with the instance ``forward`` it had (or None)."""
    from torch.distributed.pipelining import pipe_split

    modules = dict(model.named_modules())
    marked = []
    for fqn in points:
        module = modules[fqn]
        forward = module.forward
        marked.append((module, module.__dict__.get("forward")))

        def begin_stage(*args: Any, _forward: Any = forward, _fqn: str = fqn, **kwargs: Any) -> Any:
            order.append(_fqn)
            pipe_split()
            return _forward(*args, **kwargs)

        module.forward = begin_stage  # type: ignore[method-assign]
    return marked


def _is_marker(node: fx.Node) -> bool:
    from torch.distributed.pipelining import pipe_split
    from torch.distributed.pipelining._IR import aten_pipe_split_alias

    return node.op == "call_function" and node.target in (pipe_split, aten_pipe_split_alias)


def keep_markers(gm: fx.GraphModule, order: Sequence[str], points: Sequence[str]) -> None:
    """Remove from ``gm``'s graph the markers of modules not in ``points`` (``order``: whose each
    marker is). Nothing to remove, nothing is looked at.

    Raises:
        MarkersMoved: the graph's markers are not ``len(order)`` calls at its top level.
    """
    wanted = set(points)
    if all(fqn in wanted for fqn in order):
        return
    markers = [node for node in gm.graph.nodes if _is_marker(node)]
    if len(markers) != len(order):
        raise MarkersMoved(f"{len(markers)} markers in the graph for {len(order)} marked calls")
    for node, fqn in zip(markers, order, strict=True):
        if fqn not in wanted:
            gm.graph.erase_node(node)
    gm.recompile()


@contextlib.contextmanager
def exporting(exported: Optional[MarkedExport], captured: dict[str, Any], model: nn.Module) -> Iterator[None]:
    """Within: torch's splitter in this thread takes ``exported``'s program, attached to
    ``model``'s tensors (:meth:`MarkedExport.attach`; detached again after), instead of exporting
    the model; or (``exported`` None) exports as usual and puts the program in ``captured["program"]``.

    Raises:
        MarkersMoved: ``exported`` cannot be attached to ``model``.
    """
    from torch.distributed.pipelining._IR import Pipe

    me = threading.get_ident()
    with _lock:
        original = Pipe.__dict__.get("_trace_with_export")
        if not isinstance(original, staticmethod):  # another torch: its own export each time, nothing kept
            if exported is not None:
                raise MarkersMoved("this torch's splitter exports in a way a kept export cannot stand in for")
            yield
            return

        def export(mod: nn.Module, example_args: Any, example_kwargs: Any = None) -> Any:
            if threading.get_ident() != me:
                return original.__func__(mod, example_args, example_kwargs)
            if exported is not None:
                return exported.program
            captured["program"] = original.__func__(mod, example_args, example_kwargs)
            return captured["program"]

        if exported is not None:
            exported.attach(model)
        Pipe._trace_with_export = staticmethod(export)  # type: ignore[method-assign]
        try:
            yield
        finally:
            Pipe._trace_with_export = original  # type: ignore[method-assign]
            if exported is not None:
                exported.detached()
