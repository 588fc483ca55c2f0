"""A model's inputs as users hold them: a tensor, a tuple of positional inputs, or a dict of keyword inputs.

Hugging Face models take keyword inputs (``input_ids``, ``attention_mask``, ``labels``); other
models a tensor or several positional ones. Tracing, profiling and the traced executor turn
any of these into the ``(args, kwargs)`` of a call and cut it into micro-batches along dim 0::

    args, kwargs = call_inputs({"input_ids": ids, "labels": ids})     # (), {...}
    rows = sample_rows(ids)                                            # dim 0
    first = microbatches({"input_ids": ids}, chunks=4)[0]              # a quarter of the rows
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["call_inputs", "sample_rows", "microbatches", "first_microbatch", "model_output", "tokens_per_sample"]


def call_inputs(sample: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` for ``model(*args, **kwargs)`` from a tensor, a tuple or a dict of inputs.

    A tensor is the one positional input; a tuple or list holds the positional inputs; a dict
    (or any mapping, e.g. a tokenizer's ``BatchEncoding``) holds keyword inputs.

    Example::

        call_inputs(tokens)                           # ((tokens,), {})
        call_inputs({"input_ids": ids})               # ((), {"input_ids": ids})
    """
    if torch.is_tensor(sample):
        return (sample,), {}
    if isinstance(sample, (tuple, list)):
        return tuple(sample), {}
    if isinstance(sample, Mapping):
        bad = [key for key in sample if not isinstance(key, str)]
        if bad:
            raise TypeError(f"keyword inputs need string keys, got {bad!r}: give a dict like {{'input_ids': ids}}")
        return (), dict(sample)
    raise TypeError(f"sample must be a tensor, a tuple of positional inputs or a dict of keyword inputs, got "
                    f"{type(sample).__name__}")


def _tensors(sample: Any) -> list[torch.Tensor]:
    args, kwargs = call_inputs(sample)
    return [v for v in (*args, *kwargs.values()) if torch.is_tensor(v)]


def sample_rows(sample: Any) -> int:
    """The rows of a mini-batch (dim 0 of its first tensor input).

    Example::

        sample_rows({"input_ids": torch.zeros(8, 16, dtype=torch.long)})   # 8
    """
    tensors = [t for t in _tensors(sample) if t.dim() > 0]
    if not tensors:
        raise ValueError("the sample holds no tensor with a batch dimension: give at least one tensor input of "
                         "shape (batch, ...)")
    return int(tensors[0].size(0))


def microbatches(sample: Any, chunks: int) -> list[Any]:
    """Cut ``sample`` into ``chunks`` equal micro-batches along dim 0, in the sample's own form.

    Tensors whose dim 0 is the batch are cut; other values (flags, shared tensors) go to every
    micro-batch as they are. Traced graphs have fixed shapes, so the rows must divide evenly.

    Example::

        microbatches({"input_ids": ids, "labels": ids}, 4)   # 4 dicts of a quarter of the rows each
    """
    rows = sample_rows(sample)
    if isinstance(chunks, bool) or int(chunks) != chunks or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    if rows % chunks:
        raise ValueError(f"a traced model runs micro-batches of one shape: the batch of {rows} rows does not divide "
                         f"into chunks={chunks}; choose chunks that divide {rows}")

    def cut(value: Any) -> list[Any]:
        if torch.is_tensor(value) and value.dim() > 0 and value.size(0) == rows:
            return list(value.chunk(chunks))
        return [value] * chunks

    args, kwargs = call_inputs(sample)
    arg_parts = [cut(v) for v in args]
    kwarg_parts = {k: cut(v) for k, v in kwargs.items()}
    parts = []
    for i in range(chunks):
        if torch.is_tensor(sample):
            parts.append(arg_parts[0][i])
        elif isinstance(sample, (tuple, list)):
            parts.append(tuple(p[i] for p in arg_parts))
        else:
            parts.append({k: p[i] for k, p in kwarg_parts.items()})
    return parts


def first_microbatch(sample: Any, chunks: int) -> Any:
    """The first of :func:`microbatches`: the example a traced graph is built for."""
    return microbatches(sample, chunks)[0]


def model_output(flat: Any, spec: Any) -> Any:
    """The output as the model returns it (a ``ModelOutput``, a dict, a tuple …), rebuilt from a
    split's flat outputs with the pytree ``spec`` the tracer recorded (``pipe.output_spec``).

    Example::

        out = model_output(last_stage_outputs, pipe.output_spec)
        out.logits
    """
    leaves = list(flat) if isinstance(flat, (tuple, list)) else [flat]
    if spec is not None and spec.num_leaves == len(leaves):
        from torch.utils._pytree import tree_unflatten

        return tree_unflatten(leaves, spec)
    return leaves[0] if len(leaves) == 1 else tuple(leaves)


def tokens_per_sample(sample: Any) -> int:
    """Tokens a sample holds where the sample is token ids (``(rows, sequence)`` integers, or a
    mapping with ``input_ids``): its sequence length; else 1."""
    ids = sample.get("input_ids") if isinstance(sample, dict) else sample
    if isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point():
        return int(ids.shape[1])
    return 1
