"""Candidate split points: the blocks of a model at any depth, in the order its forward runs them.

Example::

    candidate_modules(gpt2)          # [('transformer.wte', Embedding), …, ('transformer.h.0', GPT2Block), …]
"""
from __future__ import annotations

from torch import nn

__all__ = ["TraceError", "GRANULARITIES", "candidate_modules"]

#: How fine the candidate split points are: ``blocks`` (the model's repeated blocks, wherever their
#: containers sit) or ``children`` (each block opened one level more).
GRANULARITIES = ("blocks", "children")
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


class TraceError(RuntimeError):
    """The model could not be captured as one graph, or split where asked; the message says what to do."""


def _is_block_list(module: nn.Module) -> bool:
    """A container of blocks: a ``ModuleList``, ``ModuleDict`` or ``Sequential`` whose every
    element is itself made of modules (``h.0``, ``layers["0"]``), not of plain layers."""
    return isinstance(module, _CONTAINERS) and len(module) > 0 and all(
        next(child.children(), None) is not None for child in module.children())


def _opens(module: nn.Module, *, top: bool, in_block: bool) -> bool:
    """Whether ``module`` is opened (its children become candidates) rather than being one.

    Containers at the top of the model always open (as before); block lists open anywhere.
    Outside blocks a module opens when a block list sits anywhere below it (``transformer`` of
    ``transformer.h.N``, ``bert.encoder`` of ``bert.encoder.layer.N``). A block opens only when
    block lists among its direct children hold most of its weights (``stages.N`` of
    ``stages.N.blocks.M``), so that blocks keep lesser inner lists (attention heads) closed.
    """
    if isinstance(module, _CONTAINERS) and len(module) > 0 and (top or _is_block_list(module)):
        return True
    if not in_block:
        return any(_is_block_list(m) for m in module.modules())
    lists = [child for child in module.children() if _is_block_list(child)]
    if not lists:
        return False

    def size(m: nn.Module) -> int:
        return sum(p.numel() for p in m.parameters()) or sum(1 for _ in m.modules())

    return 2 * sum(size(child) for child in lists) > size(module)


def candidate_modules(model: nn.Module, granularity: str = "blocks") -> list[tuple[str, nn.Module]]:
    """Modules a pipeline stage can begin at, by FQN, in the model's registration order.

    ``granularity='blocks'``: the model's children, with containers opened wherever they sit —
    ``ModuleList``, ``ModuleDict`` and ``Sequential`` holding blocks inside attributes, nested
    (``transformer.h.0``, ``model.layers.0``, ``layers.0`` of a ``ModuleDict``,
    ``encoder.layer.0``, ``backbone.stages.0.blocks.0``); a container at the top of the model
    opens even when it holds plain layers. ``granularity='children'``: each of those blocks opened
    one level more (``transformer.h.0.attn``, ``transformer.h.0.mlp``, …; a ``ModuleList`` child,
    never called itself, gives its elements).

    Example::

        [name for name, _ in candidate_modules(gpt2)]
        # ['transformer.wte', 'transformer.wpe', 'transformer.drop', 'transformer.h.0', …, 'lm_head']
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {', '.join(map(repr, GRANULARITIES))}, got {granularity!r}")
    found: list[tuple[str, nn.Module]] = []

    def visit(fqn: str, module: nn.Module, *, top: bool, in_block: bool) -> None:
        if fqn and not _opens(module, top=top, in_block=in_block):
            found.append((fqn, module))
            return
        inner = in_block or _is_block_list(module)
        for name, child in module.named_children():
            visit(f"{fqn}.{name}" if fqn else name, child, top=not fqn, in_block=inner)

    visit("", model, top=True, in_block=False)
    if granularity == "children":
        opened: list[tuple[str, nn.Module]] = []
        for fqn, module in found:
            children = [(f"{fqn}.{name}", child) for name, child in module.named_children()] or [(fqn, module)]
            for name, child in children:  # a ModuleList or ModuleDict is never called itself: its elements are
                lists = isinstance(child, (nn.ModuleList, nn.ModuleDict)) and len(child) > 0
                opened += [(f"{name}.{key}", element) for key, element in child.named_children()] if lists \
                    else [(name, child)]
        found = opened
    return _once_each(found)


def _once_each(found: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Each module once: a module registered under several names (T5's and BART's ``shared``
    embedding is also their encoder's and decoder's ``embed_tokens``) is a candidate under the first
    name inside the model's parts, where forward calls it (``encoder.embed_tokens``), not the top
    attribute forward never calls by that name."""
    names: dict[int, list[str]] = {}
    for name, module in found:
        names.setdefault(id(module), []).append(name)
    kept = {key: next((n for n in aliases if "." in n), aliases[0]) for key, aliases in names.items()}
    return [(name, module) for name, module in found if kept[id(module)] == name]
