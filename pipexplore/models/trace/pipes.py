"""Traced splits kept for the session: a rerun of the same split is not traced again.

Splitting a model (:func:`pipexplore.models.trace.split`) is torch.export's trace of it: seconds
for a real model (GPT-2 small, two stages: 2.7–3.0 s on a 2-core CPU), paid by every run of a
traced model in this process before its first micro-batch. What the trace gives depends on the
model's code and shape, not on its weights: :func:`traced_pipe` keeps each split's pipe with its
parameters and buffers on the meta device (no memory), and a later call for the same split of a
model of the same shape on micro-batches of the same shape gets a copy of it holding the model's
weights as they are now — what a new trace would give, in 0.5–0.9 s for GPT-2 small where the
first call took 4.0 s (the trace, the model's copy it traces, the pipe kept).

"The same shape" (:func:`split_key`): the split points; each input's shape, dtype, device and
``requires_grad``; the model's module names and classes, and the code of the methods each class
outside torch defines (a class redefined in a notebook with another ``forward`` is traced again;
the same code run again in a new cell is not); its parameters' and buffers' names, shapes,
dtypes, devices, ``requires_grad`` and ties (one weight under two names), each module's
train/eval mode (dropout is traced as it runs) and a Hugging Face config's ``repr``. Anything
else the model's ``forward`` reads (a plain attribute set after the first run, a global or a
module-level function it calls, changed since) is not seen: :func:`forget_traced` empties the
kept pipes.

A split at other points of a model of a kept shape is not exported again either: the first split
exports the model with a marker at every module a stage may begin at, and that export is kept
(its weights on the meta device; :data:`KEPT_EXPORTS`); a new split removes the other markers and
runs torch's splitter on the kept graph (:mod:`pipexplore.models.trace.markers`; :data:`exports`
counts the exports). A drag of a split handle then costs the splitter, not torch.export: a
tiny GPT-2's new split 0.41 s against 0.88 s, GPT-2 small's 2.0 s against 3.1 s
(``benchmarks/traced_rerun.py --new-split``). Where the markers cannot all go (one inside a region
export keeps apart), the split is traced at its own points, as :func:`~pipexplore.models.trace.split` does.
The profile of a traced model's stages splits it here too (:func:`pipexplore.models.trace.profile_candidates.
traced_extra`), so an explorer's first run splits the export its profile made (a tiny GPT-2's
first run after ``explore()``: 1.1–1.2 s against 1.8–1.9 s).

The processes executor's ranks keep their own pipes the same way (:data:`traces` counts the
traces a process made): the split the caller made is sent to them (:func:`keep_traced`,
:mod:`pipexplore.models.trace.sent`), and a rank traces the model itself only where it could not
be sent; a rerun in the warm pool copies the kept pipe.
"""
from __future__ import annotations

import collections
import copy
import threading
import types
import warnings
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from pipexplore.models.inputs import call_inputs
from pipexplore.models.trace.candidates import TraceError
from pipexplore.models.trace.markers import MarkersMoved, marks_for
from pipexplore.models.trace.split import split_marked

#: How many splits are kept (the least recently used leaves first).
KEPT_SPLITS = 8

#: split_key → (the pipe with meta weights, [(its meta tensor, the model's FQN), ...])
_kept: "collections.OrderedDict[tuple[Any, ...], tuple[Any, list[tuple[torch.Tensor, str]]]]" = \
    collections.OrderedDict()
#: How many models' exports are kept, each serving every split of its model (the least recently used leaves first).
KEPT_EXPORTS = 2
#: split_key without its points → the model's export marked for every split (weights on meta):
#: :class:`~pipexplore.models.trace.markers.MarkedExport`
_exports: "collections.OrderedDict[tuple[Any, ...], Any]" = collections.OrderedDict()
#: Runs in the background (the explorer's) and in the foreground may look splits up at once.
_lock = threading.Lock()
#: How many splits this process has traced (a rank reports whether its run traced), and how many
#: of them exported the model (the others split a kept export of it).
traces = 0
exports = 0


def input_shapes(value: Any) -> Any:
    """What tracing sees of an input: tensors as (shape, dtype, device, requires_grad), containers
    recursively, anything else by its repr."""
    if torch.is_tensor(value):
        return ("tensor", tuple(value.shape), str(value.dtype), str(value.device), bool(value.requires_grad))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(input_shapes(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((str(k), input_shapes(v)) for k, v in value.items()))
    return repr(value)


def class_code(cls: type) -> tuple[Any, ...]:
    """The code of the methods ``cls`` and its bases define, outside torch's own classes: code
    objects compare by what they do (their bytecode, constants, names and lines), not by the cell
    or file that defined them."""
    found = []
    for base in cls.__mro__:
        if str(getattr(base, "__module__", None) or "").split(".")[0] in ("torch", "builtins"):
            continue
        for name, value in vars(base).items():
            function = getattr(value, "__func__", value)  # staticmethod, classmethod
            if isinstance(function, types.FunctionType):
                found.append((base.__qualname__, name, function.__code__))
    return tuple(found)


def split_key(model: nn.Module, mb_args: Any, mb_kwargs: Optional[dict[str, Any]],
              points: Sequence[str]) -> tuple[Any, ...]:
    """What a trace of ``model`` split at ``points`` on these inputs depends on (the module's doc)."""
    first: dict[int, int] = {}  # tied weights: where each tensor was seen first
    classes = {type(module) for module in model.modules()}
    args, kwargs = call_inputs(mb_args)  # (a tensor and a tuple of it are the same call)
    return (tuple(points), input_shapes(args), input_shapes({**kwargs, **(mb_kwargs or {})}),
            tuple((name, type(module).__module__, type(module).__qualname__, module.training)
                  for name, module in model.named_modules()),
            tuple(sorted(((f"{cls.__module__}.{cls.__qualname__}", class_code(cls)) for cls in classes),
                         key=lambda item: item[0])),
            tuple((name, tuple(p.shape), str(p.dtype), str(p.device), p.requires_grad, first.setdefault(id(p), k))
                  for k, (name, p) in enumerate(model.named_parameters(remove_duplicate=False))),
            tuple((name, tuple(b.shape), str(b.dtype), str(b.device), first.setdefault(id(b), -1 - k))
                  for k, (name, b) in enumerate(model.named_buffers(remove_duplicate=False))),
            repr(getattr(model, "config", None)))


def _stage_tensors(pipe: Any) -> list[tuple[torch.Tensor, str]]:
    """Every parameter and buffer of the pipe's stages with the model's FQN it was traced from
    (a stage's names are ``submod_…`` and the model's own)."""
    found = []
    for named in (pipe.split_gm.named_parameters, pipe.split_gm.named_buffers):
        for name, tensor in named(remove_duplicate=False):
            found.append((tensor, name.split(".", 1)[1] if "." in name else name))
    return found


def _copy_with(pipe: Any, tensors: list[tuple[torch.Tensor, str]], source: dict[str, torch.Tensor],
               make: Any) -> Any:
    """A deep copy of ``pipe`` whose stage tensors are ``make(tensor, source[fqn])`` (one copy for
    a tensor the stages share: a tied weight stays tied). Where torch's split keeps a weight apart
    in several stages (``replicated_params``: copies, summed after backward), only the first copy
    may be the model's own tensor (``_the_models``): the others are copies of it, as the split
    made them (two stages of one rank holding one tensor would add its gradients twice)."""
    memo: dict[int, Any] = {}
    given: set[int] = set()  # the model's tensors given as they are (a tied one: under either name)
    for tensor, fqn in tensors:
        if id(tensor) not in memo:
            current = source.get(fqn)
            apart = make is _the_models and current is not None and id(current) in given
            memo[id(tensor)] = (_from_model if apart else make)(tensor, current)
            if current is not None:
                given.add(id(current))
    memo[id(memo)] = [t for t, _ in tensors]  # deepcopy's keep-alive list: the ids above stay taken
    with warnings.catch_warnings():
        # torch's own deprecated pytree class (LeafSpec) warns as the copy rebuilds the graph's
        # specs: nothing a user can change, once for every run of a traced model
        warnings.filterwarnings("ignore", message=r".*LeafSpec.* is deprecated", category=FutureWarning)
        return copy.deepcopy(pipe, memo)


def _model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers by FQN (a tied one under each of its names)."""
    source: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    source.update(model.named_buffers(remove_duplicate=False))
    return source


def _on_meta(tensor: torch.Tensor, current: Optional[torch.Tensor]) -> torch.Tensor:
    """The skeleton's tensor: on meta where the model holds it; a constant the trace made (torch.export
    lifts a ``torch.tensor(...)`` built in forward into ``lifted_tensor_0``), which no model holds,
    kept as it is."""
    if current is None:
        return tensor.detach().clone()
    meta = torch.empty_like(tensor, device="meta")
    return nn.Parameter(meta, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta


def _from_model(tensor: torch.Tensor, current: Optional[torch.Tensor]) -> torch.Tensor:
    """A copy of the model's tensor (of the trace's own constant where the model holds none)."""
    value = (tensor if current is None else current).detach().clone()
    return nn.Parameter(value, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else value


def _the_models(tensor: torch.Tensor, current: Optional[torch.Tensor]) -> torch.Tensor:
    """The model's own tensor (a Parameter where the pipe has one); a copy of the trace's own constant."""
    if current is None:
        return tensor.detach().clone()
    if isinstance(tensor, nn.Parameter) and not isinstance(current, nn.Parameter):
        return nn.Parameter(current, requires_grad=tensor.requires_grad)
    return current


def _trace_and_keep(key: tuple[Any, ...], model: nn.Module, mb_args: Any, split_points: Sequence[str],
                    mb_kwargs: Optional[dict[str, Any]], owned: bool = False) -> tuple[Any, Any]:
    """Split ``model`` at ``split_points``: from the kept export of a model of this shape when
    there is one (no export; the model itself is read, not changed), else by exporting a copy of
    it (the model itself if ``owned``) marked for every split, that export then kept. Keep the
    pipe's skeleton. Returns (the pipe, holding the model's tensors or copies of them as
    :func:`traced_pipe` says, its skeleton)."""
    global traces, exports

    base = key[1:]  # the split key without its points: what the export depends on
    with _lock:
        exported = _exports.get(base)
        if exported is not None:
            _exports.move_to_end(base)
    pipe, marked = None, None
    if exported is not None:
        try:  # the pipe then holds the model's own tensors
            pipe = split_marked(model, mb_args, list(split_points), mb_kwargs=mb_kwargs, exported=exported)[0]
        except MarkersMoved:
            with _lock:
                _exports.pop(base, None)
    reused = pipe is not None
    if not reused:
        with _lock:
            exports += 1
        try:
            pipe, marked = split_marked(model if owned else copy.deepcopy(model), mb_args, list(split_points),
                                        mb_kwargs=mb_kwargs, marks=marks_for(model, split_points))
        except (MarkersMoved, TraceError) as refused:
            if isinstance(refused, TraceError) and refused.__cause__ is None:
                raise  # the split itself refused (a point forward never calls), not the markers' export
            # the markers could not all go: this split's points alone, no export kept (a model that
            # cannot be traced there fails here as trace.split says)
            pipe = split_marked(model if owned else copy.deepcopy(model), mb_args, list(split_points),
                                mb_kwargs=mb_kwargs)[0]
    skeleton = _copy_with(pipe, _stage_tensors(pipe), _model_tensors(model), _on_meta)
    if reused and not owned:  # copies of the model's tensors, not the tensors themselves
        pipe = _copy_with(skeleton, _stage_tensors(skeleton), _model_tensors(model), _from_model)
    if marked is not None:
        try:
            marked = marked.detached()
        except MarkersMoved:
            marked = None
    with _lock:
        traces += 1
        _kept[key] = (skeleton, _stage_tensors(skeleton))
        while len(_kept) > KEPT_SPLITS:
            _kept.popitem(last=False)
        if marked is not None:
            _exports[base] = marked
            while len(_exports) > KEPT_EXPORTS:
                _exports.popitem(last=False)
    return pipe, skeleton


def _lookup(key: tuple[Any, ...]) -> Optional[tuple[Any, list[tuple[torch.Tensor, str]]]]:
    with _lock:
        kept = _kept.get(key)
        if kept is not None:
            _kept.move_to_end(key)
        return kept


def traced_pipe(model: nn.Module, mb_args: Any, split_points: Sequence[str], *,
                mb_kwargs: Optional[dict[str, Any]] = None, owned: bool = False) -> Any:
    """:func:`~pipexplore.models.trace.split` of a copy of ``model`` (the model itself is left as
    it is), traced once per split of a model of this shape (the module's doc): the pipe returned
    is the caller's, with copies of the model's current parameters and buffers. ``owned``: the
    model is the caller's to give (a rank's copy of it): its tensors are the pipe's, not copied
    (one model's memory, not two), and a first trace takes the model itself, as ``split`` does.

    Raises :class:`~pipexplore.models.trace.TraceError` as ``split`` does (a split that failed is
    not kept).

    Example::

        pipe = traced_pipe(gpt2, {"input_ids": ids[:2]}, ["transformer.h.6"])   # traced
        pipe = traced_pipe(gpt2, {"input_ids": ids[:2]}, ["transformer.h.6"])   # copied
    """
    key = split_key(model, mb_args, mb_kwargs, split_points)
    kept = _lookup(key)
    if kept is not None:
        source = _model_tensors(model)
        skeleton, tensors = kept
        if all(fqn in source or not tensor.is_meta for tensor, fqn in tensors):  # (the trace's constants kept)
            return _copy_with(skeleton, tensors, source, _the_models if owned else _from_model)
    return _trace_and_keep(key, model, mb_args, split_points, mb_kwargs, owned)[0]


def traced_graph(model: nn.Module, mb_args: Any, split_points: Sequence[str], *,
                 mb_kwargs: Optional[dict[str, Any]] = None) -> Any:
    """The kept pipe of this split (traced now when it is not kept), its weights on the meta
    device: to read its graph (which stage reads what), not to run. Raises as :func:`traced_pipe`."""
    key = split_key(model, mb_args, mb_kwargs, split_points)
    kept = _lookup(key)
    if kept is not None:
        return kept[0]
    return _trace_and_keep(key, model, mb_args, split_points, mb_kwargs)[1]


def keep_traced(model: nn.Module, mb_args: Any, split_points: Sequence[str], skeleton: Callable[[], Any], *,
                mb_kwargs: Optional[dict[str, Any]] = None) -> None:
    """Unless this split of ``model`` is kept: keep what ``skeleton()`` gives (what
    :func:`traced_graph` gives: the split with its weights on the meta device, made by another
    process and sent here, :mod:`pipexplore.models.trace.sent`; None: nothing kept), so that
    :func:`traced_pipe` copies it, tracing nothing. ``skeleton`` is not called for a kept split."""
    key = split_key(model, mb_args, mb_kwargs, split_points)
    if _lookup(key) is not None:
        return
    made = skeleton()
    if made is None:
        return
    with _lock:
        _kept.setdefault(key, (made, _stage_tensors(made)))
        while len(_kept) > KEPT_SPLITS:
            _kept.popitem(last=False)


def forget_traced(exports: bool = True) -> None:
    """Trace every split again from now on: the kept pipes are dropped, and (``exports``) the
    kept exports, so that the next split exports the model again."""
    with _lock:
        _kept.clear()
        if exports:
            _exports.clear()
