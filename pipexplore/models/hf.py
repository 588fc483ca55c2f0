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

The exported torchrun script builds its own model and turns the cache off for good with its own
:func:`pipexplore.export.script_parts.without_kv_cache`, which needs no pipexplore.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import torch

from torch import nn

__all__ = ["cached_configs", "cache_off", "cache_note", "input_refusal"]


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


#: What an encoder-decoder's decoder can be fed from (``labels``: the model shifts them into its inputs).
_DECODER_INPUTS = ("decoder_input_ids", "decoder_inputs_embeds", "labels")


def input_refusal(model: nn.Module, sample: Any) -> str:
    """Why a Hugging Face model cannot run on ``sample``, naming the input it lacks and its shape
    ('' where it can, or where ``model`` is not a Hugging Face model): an encoder-decoder given no
    decoder inputs; a model of images (``main_input_name`` ``pixel_values``) given token ids.

    Example::

        input_refusal(t5, {"input_ids": ids})   # "T5ForConditionalGeneration is an encoder-decoder: ..."
    """
    config, main = getattr(model, "config", None), getattr(model, "main_input_name", None)
    if config is None or not isinstance(main, str):
        return ""
    name = type(model).__name__
    given = set(sample) if isinstance(sample, Mapping) else {main}
    if getattr(config, "is_encoder_decoder", False) and not given & set(_DECODER_INPUTS):
        return (f"{name} is an encoder-decoder: its decoder needs decoder_input_ids of shape (batch, target length) "
                f"(or labels, which it shifts into them); the sample has {', '.join(sorted(given))}")
    first = sample.get(main) if isinstance(sample, Mapping) else sample
    if main == "pixel_values" and isinstance(first, torch.Tensor) and (first.dim() != 4 or
                                                                      not first.is_floating_point()):
        channels, size = getattr(config, "num_channels", 3), getattr(config, "image_size", "height")
        return (f"{name} takes images: pixel_values of shape (batch, {channels}, {size}, {size}), floating; "
                f"the sample is a {str(first.dtype).replace('torch.', '')} tensor of shape {tuple(first.shape)}")
    return ""
