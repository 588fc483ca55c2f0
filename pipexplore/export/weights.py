"""A stage's weights from a checkpoint, read tensor by tensor: what an exported script's
``init_stage(module)`` needs for a model larger than a host.

A rank of the exported torchrun script holds only its own stages (the model was built on the meta
device); :func:`load_stage` fills such a stage from safetensors files — a Hugging Face checkpoint
directory (``model.safetensors``, or shards listed by ``model.safetensors.index.json``) or one
``.safetensors`` file — opening only the files that hold its tensors and reading only those
tensors, by the model's own names. What the checkpoint does not hold (a buffer computed at
construction, such as a rotary embedding's ``inv_freq``; a tied weight saved under its other
name, unless ``aliases`` names it) is returned for the caller to fill.

Example (the hooks module of an exported script)::

    from pipexplore.export.weights import load_stage

    def init_stage(module):
        left = load_stage(module, "checkpoints/llama-70b", aliases={"lm_head.weight": "model.embed_tokens.weight"})
        for name in left:  # e.g. model.rotary_emb.inv_freq
            module.get_buffer(name).copy_(rotary_buffers[name])
"""
from __future__ import annotations

import json
import pathlib
from typing import Optional, Union

import torch
from torch import nn

__all__ = ["load_stage", "checkpoint_files"]

INDEX = "model.safetensors.index.json"


def _safe_open():
    try:
        from safetensors import safe_open
    except ImportError as error:  # a dependency of transformers; not of pipexplore
        raise ImportError("reading a safetensors checkpoint needs the safetensors package: pip install safetensors") \
            from error
    return safe_open


def checkpoint_files(checkpoint: Union[str, pathlib.Path]) -> dict[str, pathlib.Path]:
    """Each tensor name of a safetensors checkpoint and the file that holds it.

    Raises:
        FileNotFoundError: no such file or directory, or a directory with neither
            ``model.safetensors.index.json`` nor ``model.safetensors``.
        ImportError: safetensors is not installed.
    """
    safe_open = _safe_open()

    path = pathlib.Path(checkpoint)
    if path.is_dir():
        if (path / INDEX).is_file():
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
            return {name: path / file for name, file in weight_map.items()}
        path = path / "model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"no safetensors checkpoint at {checkpoint}: give a .safetensors file or a directory "
                                f"holding {INDEX} (shards) or model.safetensors")
    with safe_open(str(path), framework="pt") as file:
        return {name: path for name in file.keys()}


def load_stage(module: nn.Module, checkpoint: Union[str, pathlib.Path], *,
               aliases: Optional[dict[str, str]] = None) -> list[str]:
    """Fill ``module``'s parameters and buffers from ``checkpoint`` by their names (``aliases``: a
    name of the module → the checkpoint's name for it, e.g. a tied head saved as the embedding);
    return the names the checkpoint does not hold, in the module's order.

    Raises:
        ValueError: a tensor whose shape in the checkpoint differs from the module's.
    """
    safe_open = _safe_open()

    files = checkpoint_files(checkpoint)
    aliases = aliases or {}
    wanted: dict[pathlib.Path, list[tuple[str, str, torch.Tensor]]] = {}
    missing = []
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        key = name if name in files else aliases.get(name)
        if key is None or key not in files:
            missing.append(name)
            continue
        wanted.setdefault(files[key], []).append((name, key, tensor))
    with torch.no_grad():
        for path, tensors in wanted.items():
            with safe_open(str(path), framework="pt") as file:
                for name, key, tensor in tensors:
                    value = file.get_tensor(key)
                    if tuple(value.shape) != tuple(tensor.shape):
                        raise ValueError(f"{name}: the checkpoint's {key} has shape {tuple(value.shape)}, the stage's "
                                         f"tensor {tuple(tensor.shape)}")
                    tensor.copy_(value)
    return missing
