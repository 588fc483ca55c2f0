"""Hugging Face models as they come: their KV cache off while pipexplore traces, profiles and runs them.

A default config (``GPT2Config()``, ``LlamaConfig()``, ``BertConfig()``, …) says ``use_cache=True``:
the model's forward then builds a ``DynamicCache`` and returns it, which torch's tracer cannot put in
a graph's output ("Found DynamicCache in output"). Training never reads the cache, so pipexplore
runs the step without it: :func:`cache_off` sets ``use_cache=False`` on every config of the model
(any module's ``config`` that has ``use_cache``, a ``PreTrainedModel``'s and its submodules') while
it traces or profiles, and puts them back after, so the user's model keeps its config.

    with cache_off(model):          # what trace.candidates and trace.split do
        pipe = pipeline(model, ...)
    cache_note(model)               # the explorer's note, '' when no config has use_cache=True

The exported torchrun script builds its own model and turns the cache off with
:data:`EXPORT_SOURCE`, a copy of this logic that needs no pipexplore.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn

__all__ = ["cached_configs", "cache_off", "cache_note", "EXPORT_SOURCE"]


def cached_configs(model: nn.Module) -> list[tuple[str, Any]]:
    """``(FQN of the first module holding it, config)`` for each distinct config in ``model``
    whose ``use_cache`` is True (``''`` is the model itself), in registration order."""
    found: dict[int, tuple[str, Any]] = {}
    for fqn, module in model.named_modules():
        config = getattr(module, "config", None)
        if config is not None and id(config) not in found and getattr(config, "use_cache", None) is True:
            found[id(config)] = (fqn, config)
    return list(found.values())


@contextlib.contextmanager
def cache_off(model: nn.Module) -> Iterator[list[tuple[str, Any]]]:
    """``use_cache=False`` on every config of ``model`` that says True, inside the block only;
    yields what :func:`cached_configs` found (empty: nothing to do)."""
    found = cached_configs(model)
    for _, config in found:
        config.use_cache = False
    try:
        yield found
    finally:
        for _, config in found:
            config.use_cache = True


def cache_note(model: nn.Module) -> str:
    """What the explorer says about the cache of ``model`` ('' when no config has ``use_cache=True``)."""
    found = cached_configs(model)
    if not found:
        return ""
    name = type(model).__name__
    holders = [f"{name}'s" if not fqn else f"{name}.{fqn} ({type(model.get_submodule(fqn)).__name__})'s"
               for fqn, _ in found]
    configs = "config has" if len(found) == 1 else "configs have"
    return (f"{', '.join(holders)} {configs} use_cache=True: training never uses the KV cache, so the traced step "
            "runs with use_cache=False.")


#: The exported script's own copy of :func:`cache_off` (it imports no pipexplore): the model it
#: builds is its own, so the cache is turned off for good.
EXPORT_SOURCE = '''def without_kv_cache(model):
    """Training never uses the KV cache: a Hugging Face config's use_cache=True would make the
    model return a DynamicCache, which the tracer cannot split. Turn it off on every config."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None) is True:
            config.use_cache = False
    return model
'''
