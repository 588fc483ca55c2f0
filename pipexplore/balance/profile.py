"""Balance by profile: per-layer time or memory, measured on a copy of the model, then the exact balance."""
from __future__ import annotations

import copy
from typing import Iterator, Optional, Union

import torch
from torch import nn

from pipexplore.balance.optimal import balance_cost, check_partitions
from pipexplore.microbatch import Batch
from pipexplore.samples import TensorOrTensors

__all__ = ["balance_by_time", "balance_by_size", "layerwise_sandbox", "sandbox"]

Device = Union[torch.device, int, str]


def layerwise_sandbox(module: nn.Sequential, device: torch.device) -> Iterator[nn.Module]:
    """Copies of the layers of ``module``, each on ``device`` and in training mode; ``module`` is
    left as it is (as in torchgpipe).

    Example::

        for layer in layerwise_sandbox(model, torch.device("cpu")):
            assert layer.training
    """
    for layer in module:
        layer_copy = copy.deepcopy(layer)
        layer_copy.to(device)
        layer_copy.train()
        yield layer_copy


def sandbox(module: nn.Sequential, device: torch.device) -> nn.Sequential:
    """A copy of the whole ``module`` on ``device``, in training mode: profiling it moves no
    parameter of ``module``, updates none of its buffers (BatchNorm statistics) and leaves its
    mode. Layers that share a parameter still share it in the copy.

    Example::

        copied = sandbox(model, torch.device("cpu"))
    """
    copied = copy.deepcopy(module)
    copied.to(device)
    copied.train()
    return copied


def _no_gradients(module: nn.Module, caller: str) -> None:
    for name, param in module.named_parameters():
        if param.grad is not None:
            raise ValueError(f"some parameter already has gradient ('{name}'): {caller} profiles training steps "
                             "of a model before training; clear the gradients first with "
                             "module.zero_grad(set_to_none=True)")


def _resolve(device: Optional[Device]) -> torch.device:
    if isinstance(device, int) and not isinstance(device, bool):
        device = torch.device("cuda", device)
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        return torch.device("cpu")
    return device


def balance_by_time(partitions: int, module: nn.Sequential, sample: TensorOrTensors, *,
                    timeout: float = 1.0, device: Device = torch.device("cuda")) -> list[int]:
    """A balance by profiled time (forward + backward of each layer), as in torchgpipe.

    A copy of the layers runs one after another on ``device`` (the CPU when CUDA is not
    available) for about ``timeout`` seconds; each layer's median time is its cost, and the
    balance minimises the slowest partition exactly (the others as even as they can be).
    ``module`` itself is not moved, trained or switched to training mode.

    Example::

        balance = balance_by_time(4, model, torch.randn(64, 3, 32, 32), device="cpu")
        pipe = GPipe(model, balance, chunks=8)
    """
    from pipexplore.profiling.sequential import profile

    check_partitions(len(module), partitions)
    _no_gradients(module, "balance_by_time")
    target = _resolve(device)
    # Only forward + backward count here: the input/weight-gradient split (which imports
    # torch.distributed.pipelining, ~1.5 s) would spend the timeout on nothing.
    table = profile(sandbox(module, target), sample, device=target, timeout=timeout, split_backward=False)
    return balance_cost((table["forward"] + table["backward"]).tolist(), partitions)


def balance_by_size(partitions: int, module: nn.Sequential, input: TensorOrTensors, *, chunks: int = 1,
                    param_scale: float = 2.0, device: Device = torch.device("cuda")) -> list[int]:
    """A balance by memory: each layer's activations per micro-batch plus ``param_scale`` × its
    parameter bytes (2 for SGD: weights and their gradients; 3 with momentum; 4–5 for Adam).

    On a CUDA device a layer's activations are what its forward leaves allocated on the device
    (outputs and what autograd keeps for backward), as torchgpipe measures them; on the CPU they
    are its output bytes (and stashed skip tensors). ``input`` is a whole mini-batch; ``module``
    itself is not moved.

    Example::

        balance = balance_by_size(4, model, torch.randn(256, 3, 32, 32), chunks=8, param_scale=4.0)
    """
    from pipexplore.profiling.sequential import profile

    check_partitions(len(module), partitions)
    if chunks < 1:
        raise ValueError(f"chunks must be at least 1, got {chunks}: "
                         "give the micro-batches per mini-batch GPipe will use")
    _no_gradients(module, "balance_by_size")
    target = _resolve(device)
    copied = sandbox(module, target)
    if target.type == "cuda":
        sizes = _cuda_sizes(copied, input, chunks, param_scale, target)
    else:
        table = profile(copied, input, device=target, repeats=1, timeout=None)
        sizes = (table["output_bytes"] / chunks + param_scale * table["param_bytes"]).tolist()
    return balance_cost(sizes, partitions)


def _cuda_sizes(module: nn.Sequential, input: TensorOrTensors, chunks: int, param_scale: float,
                device: torch.device) -> list[float]:
    """Per layer: the device memory its forward leaves allocated / ``chunks`` + ``param_scale`` × its
    parameter bytes."""
    from pipexplore.skip.tracker import SkipTracker, use_skip_tracker

    sizes: list[float] = []
    with torch.cuda.device(device):
        for measured in (False, True):  # a first pass pays the one-time allocations (cuBLAS workspaces)
            batch = Batch(input)
            batch[:] = tuple(x.detach().to(device).requires_grad_(x.requires_grad) for x in batch)
            with use_skip_tracker(SkipTracker()):
                for layer in module:
                    batch[:] = tuple(x.detach().requires_grad_(x.requires_grad) for x in batch)
                    before = torch.cuda.memory_allocated(device)
                    batch = batch.call(layer)
                    latent = torch.cuda.memory_allocated(device) - before
                    if measured:
                        param_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
                        sizes.append(latent / chunks + param_scale * param_bytes)
    return sizes
