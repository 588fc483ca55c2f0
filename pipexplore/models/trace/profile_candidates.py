"""What a traced model costs: each candidate block timed where it runs in the model (:func:`candidates`),
and what its stages cost beyond the model's own modules, which shifts that profile (:func:`shift_to_stages`).

A model that is not an ``nn.Sequential`` is profiled as it is (:func:`pipexplore.models.trace.candidates`
times each candidate block with hooks inside real passes of the model), but every executor runs
it as the stages torch's tracer builds (:func:`pipexplore.models.trace.split`): torch.export's
aten-level graphs in unflattened modules, with the glue between blocks (a dropout, a reshape)
inside a stage. Those stages are not the modules: one block of the ``TinyTransformer`` of
:mod:`pipexplore.examples` took 0.43 ms forward as the model's module and 0.56 ms as its traced
stage (4 rows, one thread), its backward the same both ways; a first prediction of a traced
model's run came out 20–50 % short for that.

:func:`traced_extra` times each candidate both ways, alone, on the inputs it gets in a pass of
the model (the same harness: a forward, then a backward from ones into the outputs that need a
gradient), and gives the seconds its stage takes beyond its module per phase;
:func:`pipexplore.models.trace.candidates_in_rows` measures them on the micro-batch and adds them
to the profile at each size it profiles (:func:`shift_to_stages`). A difference, not a ratio: a
block of a few microseconds (a position embedding) whose stage also runs the glue after it would
otherwise multiply its noise by 10 or more. Tracing costs a second or two of CPU, so the seconds
are kept for the session per model shape (what its trace at every candidate sees:
:func:`pipexplore.models.trace.pipes.split_key`) and intra-op threads: re-exploring the same
architecture measures nothing again.
"""
from __future__ import annotations

import copy
import time
import warnings
from typing import Any, NamedTuple, Optional, Sequence

import pandas as pd
import torch
from torch import nn

from pipexplore.samples import tensors_in
from pipexplore.models.hf import cache_off
from pipexplore.models.inputs import call_inputs
from pipexplore.models.trace.candidates import candidate_modules
from pipexplore.models.trace.pipes import split_key, traced_pipe
from pipexplore.models.trace.stage_inputs import first_runnable_split
from pipexplore.training import LossFn, OptimizerFactory, Training

__all__ = [
    "candidates", "candidates_in_rows", "StageExtra", "traced_extra", "shift_to_stages", "isolated_seconds",
    "forget_measured"
]


class StageExtra(NamedTuple):
    """What :func:`traced_extra` measures: per candidate, the seconds its traced stage takes beyond
    its module, and the first candidate a second stage may begin at to run in processes
    (:func:`pipexplore.models.trace.stage_inputs.first_runnable_split`)."""

    forward: list[float]
    backward: list[float]
    first_split: int


#: What :func:`traced_extra` measured per model shape, once a session.
_MEASURED: dict[tuple, StageExtra] = {}


def forget_measured() -> None:
    """Measure every model shape again (what this session measured is dropped)."""
    _MEASURED.clear()


def _fresh(value: Any) -> Any:
    """An input as a stage receives it: a floating tensor is a new leaf that needs its gradient."""
    if torch.is_tensor(value) and value.is_floating_point():
        return value.detach().requires_grad_(True)
    return value


def isolated_seconds(module: nn.Module, args: Sequence[Any], kwargs: dict[str, Any], *, repeats: int = 3,
                     warmup: int = 1) -> tuple[float, float]:
    """Median seconds of ``module(*args, **kwargs)`` forward, then of its backward from ones into
    every output that needs a gradient (0 where none does), over ``repeats`` calls after
    ``warmup`` untimed ones (a :class:`~pipexplore.profiling.timing.Timer` each: on a GPU, to its
    kernels' end); floating inputs are fresh leaves each call, as a stage gets them."""
    from pipexplore.profiling.timing import Timer

    tensors = [*module.parameters(), *tensors_in(list(args)), *tensors_in(kwargs)]
    device = tensors[0].device if tensors else torch.device("cpu")
    timers = {"forward": Timer(device), "backward": Timer(device)}
    differentiable = False
    for step in range(warmup + repeats):
        call_args = [_fresh(a) for a in args]
        call_kwargs = {k: _fresh(v) for k, v in kwargs.items()}

        def forward() -> Any:
            return module(*call_args, **call_kwargs)

        output = timers["forward"](forward) if step >= warmup else forward()
        outputs = [t for t in tensors_in(output) if t.requires_grad]
        differentiable = bool(outputs)

        def backward(outputs: list[torch.Tensor] = outputs) -> None:
            if outputs:
                torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])

        timers["backward"](backward) if step >= warmup else backward()
    return timers["forward"].median, timers["backward"].median if differentiable else 0.0


def _inputs_of(modules: Sequence[nn.Module], run: Any) -> list[Optional[tuple[tuple, dict]]]:
    """The ``(args, kwargs)`` each module is first called with while ``run()`` runs (no gradients)."""
    seen: list[Optional[tuple[tuple, dict]]] = [None] * len(modules)
    handles = []
    for k, module in enumerate(modules):
        def keep(_: nn.Module, args: Any, kwargs: dict[str, Any], k: int = k) -> None:
            if seen[k] is None:
                seen[k] = (tuple(args), dict(kwargs))
        handles.append(module.register_forward_pre_hook(keep, with_kwargs=True))
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _shape_key(model: nn.Module, sample: Any, names: Sequence[str]) -> tuple:
    """The model's shape as its trace at every candidate sees it (:func:`~pipexplore.models.
    traced_pipes.split_key`), and the intra-op threads its stages are timed with."""
    return split_key(model, sample, None, names), torch.get_num_threads()


def traced_extra(model: nn.Module, sample: Any, names: Sequence[str], *, repeats: int = 3,
                 warmup: int = 1, owned: bool = False) -> StageExtra:
    """Per candidate ``names`` (FQNs in execution order, as :func:`~pipexplore.models.trace.candidates`
    lists them): the seconds its traced stage takes beyond its own module, forward and backward,
    on ``sample`` (one micro-batch as the model takes it; negative where the stage was faster);
    and the first candidate a second stage may begin at for the split to run in processes.
    The model is traced with a stage beginning at every candidate but the first (a copy:
    :func:`~pipexplore.models.trace.pipes.traced_pipe`, whose export of the model the runs' splits
    then use) and
    each stage timed alone beside its module (:func:`isolated_seconds`); a stage also runs the
    glue that follows its block. 0 for a block the pass did not call. Kept for the session per
    model shape (:func:`forget_measured`). ``owned``: the model is a copy the caller gives away
    (the explorer's, on the profile's device): its blocks are timed on it, rather than on one more
    copy (a model that fills half a GPU fits its profile).

    Raises:
        pipexplore.models.trace.TraceError: the model cannot be traced into these stages.
    """

    key = _shape_key(model, sample, names)
    if key in _MEASURED:
        kept = _MEASURED[key]
        return StageExtra(list(kept.forward), list(kept.backward), kept.first_split)
    args, kwargs = call_inputs(sample)
    own = model if owned else copy.deepcopy(model)  # its blocks run backwards: not the caller's own grads
    if owned:
        own.zero_grad(set_to_none=True)  # the profile's passes left them: the copy traced below need not hold them
    modules = dict(own.named_modules())
    blocks = [modules[name] for name in names]
    with cache_off(own):
        own_inputs = _inputs_of(blocks, lambda: own(*args, **kwargs))
    # (through the session's kept pipes: the model's export made here serves the runs' splits after)
    pipe = traced_pipe(model, sample, list(names[1:]))
    stages = sorted(((int(n.rsplit("_", 1)[1]), m) for n, m in pipe.split_gm.named_children()
                     if n.startswith("submod_")), key=lambda pair: pair[0])
    stage_inputs = _inputs_of([m for _, m in stages], lambda: pipe(*args, **kwargs))
    forward, backward = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k, block in enumerate(blocks):
            own_input = own_inputs[k]
            stage_input = stage_inputs[k] if k < len(stages) else None
            if own_input is None or stage_input is None:
                forward.append(0.0)
                backward.append(0.0)
                continue
            mine = isolated_seconds(block, *own_input, repeats=repeats, warmup=warmup)
            traced = isolated_seconds(stages[k][1], *stage_input, repeats=repeats, warmup=warmup)
            forward.append(traced[0] - mine[0])
            backward.append(traced[1] - mine[1])
    first_split = first_runnable_split(pipe)
    _MEASURED[key] = StageExtra(list(forward), list(backward), first_split)
    return StageExtra(forward, backward, first_split)


def shift_to_stages(model: nn.Module, tables: Sequence[Any], sample: Any, *, repeats: int = 3,
                    owned: bool = False) -> Optional[str]:
    """Add to each table's ``forward`` and ``backward`` what its candidates' traced stages take
    beyond them (:func:`traced_extra`), measured on ``sample`` (the micro-batch the stages run)
    and the same seconds at every size the tables were profiled at (what a stage adds is mostly
    per call: dispatch of more, smaller aten ops and the glue between blocks; one block of the
    tiny transformer, 0.12 ms more at 16 rows, 0.17–0.27 ms at 4, within this machine's noise),
    never below zero: one trace, not one a size (each is a torch.export of the whole model, ~2 s
    for a 6-block GPT-2 on this CPU). The seconds go to ``table.attrs["stage_extra"]``
    (``{"forward": [...], "backward": [...]}``), the first row a second stage may begin at for the
    split to run in processes to ``table.attrs["first_split"]`` (:class:`StageExtra`). Returns None,
    or why the tables stay the modules' times: the model cannot be traced a stage a candidate, or a
    stage fails alone."""
    try:
        forward, backward, first_split = traced_extra(model, sample, tables[0]["name"].tolist(), repeats=repeats,
                                                      owned=owned)
    except Exception as exc:  # noqa: BLE001 - the profile stands without it, and says why
        lines = str(exc).strip().splitlines() or [""]
        first = lines[0] if len(lines[0]) <= 160 else lines[0][:159] + "…"
        return (f"The profile times {type(model).__name__}'s own modules, not the stages its runs trace "
                f"({type(exc).__name__}: {first}): predictions leave out what those stages take beyond the "
                "modules.")
    for table in tables:
        for phase, extra in (("forward", forward), ("backward", backward)):
            table[phase] = (table[phase] + extra).clip(lower=0.0)
        table.attrs["stage_extra"] = {"forward": forward, "backward": backward}
        table.attrs["first_split"] = first_split
    return None


def _identity(t: torch.Tensor) -> tuple:
    """The same value seen by two blocks: backward hooks hand the caller a view, not the object."""
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _tied_aliases(blocks: list[tuple[str, nn.Module]], called: list[int]) -> set[int]:
    """The candidates forward never called whose every parameter is one a called candidate holds
    (T5's and BART's ``shared`` embedding, whose weight their encoder's ``embed_tokens`` holds and
    forward calls): not a split point, and their weights are counted where they are used."""
    used = {id(p) for k in called for p in blocks[k][1].parameters()}
    return {k for k, (_, module) in enumerate(blocks) if k not in called
            and (params := list(module.parameters())) and all(id(p) in used for p in params)}


def candidates(model: nn.Module, sample: Any, *, mb_kwargs: Optional[dict[str, Any]] = None,
               granularity: str = "blocks", loss_fn: Optional[LossFn] = None, target: Any = None, repeats: int = 3,
               warmup: int = 1, optimizer: Optional[OptimizerFactory] = None,
               time_optimizer: bool = True) -> pd.DataFrame:
    """Profile each candidate split point (:func:`candidate_modules`) as it runs in the model.

    ``sample`` is one mini-batch as the model takes it: a tensor, a tuple of positional inputs or
    a dict of keyword inputs (``input_ids``, ``attention_mask``, ``labels``); ``mb_kwargs`` adds
    keyword inputs. Hooks time every candidate inside real forward and backward passes of the
    whole model (on a GPU, synchronised at each mark), ``warmup`` passes first (untimed:
    allocation, dispatch caches), then ``repeats`` timed ones; ``loss_fn(output, target)``
    receives the output as the model returns it (default: the mean of the squared floating
    outputs, :func:`pipexplore.training.synthetic_loss`, as every run). The passes run with a
    Hugging Face config's ``use_cache`` off, as training does (:func:`pipexplore.models.hf.cache_off`).

    Returns one row per candidate in execution order, columns as :func:`pipexplore.profile`
    gives (``name`` is the module's FQN), with ``stash`` and ``pop`` naming values that skip over
    candidates (an output consumed by a later, non-adjacent candidate), and ``shared`` naming
    parameters used by several candidates (tied weights). A candidate forward never calls whose
    weights a called one holds (a tied alias: T5's ``shared``) is left out. Times are medians over
    ``repeats``. So is a candidate without parameters that forward calls more than once a pass (a
    shared dropout): it can begin no stage, and its work stays in the stage around it.
    ``optimizer``: seconds of one step of ``optimizer(parameters)`` (the factory a run uses; default
    :data:`pipexplore.training.default_optimizer`) over the candidate's parameters, timed on copies of them
    (:func:`pipexplore.profiling.optimizer_step.optimizer_seconds`; a tied weight counts in every
    candidate that holds it, as each stage steps its own copy); ``time_optimizer=False`` leaves it
    out (a caller that has it already).

    Example::

        table = trace.candidates(gpt2, {"input_ids": ids, "labels": ids}, loss_fn=lambda out, _: out.loss)
        table[["name", "forward", "backward", "shared"]]
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be 0 or more passes, got {warmup}")
    training = Training.of(loss_fn, optimizer, target)
    args, kwargs = call_inputs(sample)
    kwargs.update(mb_kwargs or {})
    blocks = candidate_modules(model, granularity)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no child modules to split between")
    index = {id(module): k for k, (_, module) in enumerate(blocks)}
    order: list[int] = []
    forward: dict[int, list[float]] = {k: [] for k in range(len(blocks))}
    backward: dict[int, list[float]] = {k: [] for k in range(len(blocks))}
    out_bytes: dict[int, int] = {}
    edges: set[tuple[int, int]] = set()
    producer: dict[tuple, tuple[int, torch.Tensor]] = {}
    started: dict[int, float] = {}
    bwd_start: dict[int, float] = {}
    bwd_end: dict[int, float] = {}
    handles = []
    from pipexplore.profiling.timing import synchronize

    device = next(model.parameters(), torch.empty(0)).device

    def now() -> float:  # on a GPU, when the kernels launched so far have run
        synchronize(device)
        return time.perf_counter()

    calls: dict[int, int] = {}

    def pre(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        k = index[id(module)]
        calls[k] = calls.get(k, 0) + 1
        if k not in order:
            order.append(k)
        position = order.index(k)
        for t in tensors_in(args) + tensors_in(kwargs):
            source = producer.get(_identity(t), (None, None))[0]
            if source is not None and order.index(source) < position - 1:  # skips a block in execution order
                edges.add((source, k))
        started[k] = now()

    def post(module: nn.Module, args: Any, output: Any) -> None:
        k = index[id(module)]
        forward[k].append(now() - started[k])
        tensors = tensors_in(output)
        out_bytes[k] = sum(t.numel() * t.element_size() for t in tensors)
        for t in tensors:
            producer[_identity(t)] = (k, t)  # held for the pass: a freed address reused is not this value

    def bwd_pre(module: nn.Module, grad_output: Any) -> None:
        bwd_start[index[id(module)]] = now()

    def bwd_post(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        bwd_end[index[id(module)]] = now()

    for _, module in blocks:
        handles += [module.register_forward_pre_hook(pre, with_kwargs=True), module.register_forward_hook(post),
                    module.register_full_backward_pre_hook(bwd_pre), module.register_full_backward_hook(bwd_post)]
    owners: dict[int, list[int]] = {}
    params: dict[int, nn.Parameter] = {}
    for k, (_, module) in enumerate(blocks):
        for param in module.parameters():
            owners.setdefault(id(param), []).append(k)
            params[id(param)] = param

    def accumulated(blocks_of_param: tuple[int, ...]) -> Any:
        def hook(_: torch.Tensor) -> None:  # a block's backward ends at its weights' last accumulation
            # A tied weight accumulates once, after every block using it: that ends the first of them
            # in forward (the embedding, last in backward), not the others (a head, long done).
            block = min(blocks_of_param, key=lambda j: order.index(j) if j in order else len(order))
            bwd_end[block] = max(bwd_end.get(block, 0.0), now())
        return hook

    for pid, ks in owners.items():
        if params[pid].requires_grad:
            handles.append(params[pid].register_post_accumulate_grad_hook(accumulated(tuple(set(ks)))))
    with warnings.catch_warnings(), cache_off(model):  # training never uses a KV cache: hf.cache_off
        try:
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            for timed in [False] * warmup + [True] * repeats:
                producer.clear()
                bwd_start.clear()
                bwd_end.clear()
                output = model(*args, **kwargs)
                loss = training.loss_fn(output, training.target)
                loss.backward()
                model.zero_grad(set_to_none=True)
                if not timed:
                    for times in forward.values():
                        times.clear()
                    continue
                for k in range(len(blocks)):
                    if k in bwd_start:
                        backward[k].append(max(0.0, bwd_end.get(k, bwd_start[k]) - bwd_start[k]))
        finally:
            producer.clear()
            for handle in handles:
                handle.remove()
    tied_aliases = _tied_aliases(blocks, order)  # never called by their own name, their weights another's
    # A module forward calls several times a pass (T5's stacks apply one dropout again and again)
    # begins no stage: torch's splitter cannot cut at it. Its work stays in the stage around it.
    passes = warmup + repeats
    repeated = [k for k in order if calls.get(k, 0) > passes and not list(blocks[k][1].parameters())]
    if repeated:  # a value it made or read is the stage's around it: the candidate before it in order
        kept = [k for k in order if k not in repeated]
        around = {k: max((j for j in kept if order.index(j) < order.index(k)), key=order.index, default=kept[0])
                  for k in repeated}
        moved = {(around.get(src, src), around.get(dst, dst)) for src, dst in edges}
        edges = {(src, dst) for src, dst in moved if kept.index(src) < kept.index(dst) - 1}
        order = kept
    tied_aliases |= set(repeated)
    if len(order) + len(tied_aliases) < len(blocks):
        unused = [blocks[k][0] for k in range(len(blocks)) if k not in order and k not in tied_aliases]
        order += [k for k in range(len(blocks)) if k not in order and k not in tied_aliases]
        warnings.warn(f"blocks not called in forward: {unused}", stacklevel=2)
    shared: dict[int, list[str]] = {k: [] for k in range(len(blocks))}
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    for pid, ks in owners.items():
        if len(set(ks)) > 1:
            for k in ks:
                shared[k].append(names.get(pid, "?"))
    rows = []
    position = {k: p for p, k in enumerate(order)}
    for k in order:
        name, module = blocks[k]
        routes = sorted((position[src], position[dst]) for src, dst in edges)
        stash = [f"v{src}>{dst}" for src, dst in routes if src == position[k]]
        pop = [f"v{src}>{dst}" for src, dst in routes if dst == position[k]]
        rows.append({
            "name": name, "type": type(module).__name__,
            "param_bytes": sum(p.numel() * p.element_size() for p in module.parameters()),
            "output_bytes": out_bytes.get(k, 0),
            "forward": sorted(forward[k])[len(forward[k]) // 2] if forward[k] else 0.0,
            "backward": sorted(backward[k])[len(backward[k]) // 2] if backward[k] else 0.0,
            "stash": ",".join(stash), "pop": ",".join(pop), "stash_keys": ",".join(stash), "pop_keys": ",".join(pop),
            "shared": ",".join(sorted(set(shared[k]))), "order": position[k],
        })
    table = pd.DataFrame(rows)
    if time_optimizer:  # the update at the end of a step, over each candidate's parameters
        from pipexplore.profiling.optimizer_step import optimizer_seconds

        table["optimizer"] = optimizer_seconds([blocks[k][1] for k in order], training.optimizer, repeats=repeats)
    return table


def candidates_in_rows(model: nn.Module, sample: Any, *, chunks: int, target: Any = None, as_stages: bool = True,
                       owned: bool = False, **options: Any) -> pd.DataFrame:
    """:func:`candidates` profiled on one micro-batch of ``chunks`` and on the whole ``sample``,
    with each block's costs as a line in the rows ``n`` of a micro-batch (``forward_a``,
    ``forward_b``, … as :func:`pipexplore.profile` gives them), so predictions hold when
    ``chunks`` changes. With ``chunks=1`` the whole sample only (costs proportional to rows).
    ``as_stages``: the times include what the traced stages the runs execute take beyond the
    model's own modules, measured on the micro-batch (:func:`pipexplore.models.trace.profile_candidates.
    shift_to_stages`; ``attrs["stage_extra"]``: the seconds and the rows they were measured at);
    ``owned``: ``model`` is a copy the caller gives away, timed on without one more copy.

    Example::

        table = candidates_in_rows(model, {"input_ids": ids}, chunks=4)
    """
    from pipexplore.models.inputs import first_microbatch, sample_rows
    from pipexplore.profiling.timing import fit_columns

    whole = candidates(model, sample, target=target, **options)
    batch = sample_rows(sample)
    tables, rows, samples = [whole], [batch], [sample]
    if chunks > 1:
        part = first_microbatch(sample, chunks)
        part_rows = sample_rows(part)
        part_target = target[:part_rows] if torch.is_tensor(target) and target.dim() > 0 else target
        if part_rows < batch:  # (the optimizer's cost has no rows: the whole sample's table has it)
            tables.insert(0, candidates(model, part, target=part_target, **{**options, "time_optimizer": False}))
            rows.insert(0, part_rows)
            samples.insert(0, part)
    if as_stages:

        refused = shift_to_stages(model, tables, samples[0], repeats=options.get("repeats", 3), owned=owned)
        if refused:
            warnings.warn(refused, RuntimeWarning, stacklevel=2)
            whole.attrs["notes"] = [*whole.attrs.get("notes", []), refused]
    table = whole.copy()
    fit_columns(table, tables, rows)
    table.attrs.update(whole.attrs)
    table.attrs.update(rows=tuple(rows), batch=batch)
    if "stage_extra" in whole.attrs:
        table.attrs["stage_extra"] = {**whole.attrs["stage_extra"], "rows": rows[0]}
    return table
