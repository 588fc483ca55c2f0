"""GPipe: an ``nn.Sequential`` split into partitions on devices, run over micro-batches."""
from __future__ import annotations

import numbers
from collections import OrderedDict
from typing import Any, Iterable, Iterator, Optional, Sequence, Union, cast

import torch
from torch import nn

from pipexplore import microbatch, validate
from pipexplore.devices import as_device
from pipexplore.batchnorm import DeferredBatchNorm
from pipexplore.rng_guard import rng_locks
from pipexplore.samples import TensorOrTensors
from pipexplore.pipeline import Pipeline
from pipexplore.skip.layout import SkipLayout, inspect_skip_layout
from pipexplore.skip.skippable import verify_skippables
from pipexplore.stream import AbstractStream, new_stream

__all__ = ["GPipe", "BalanceError", "Device", "Devices"]

Device = Union[torch.device, int, str]
Devices = Union[Iterable[Device], list[Device]]

MOVING_DENIED = TypeError(
    "denied to move parameters and buffers, because GPipe should manage device placement; "
    "choose the devices with GPipe(module, balance, devices=[...]) instead"
)


class BalanceError(ValueError):
    """A ``balance`` that does not describe the module (wrong sum, empty partitions)."""


_as_device = as_device  # the name torchgpipe's layout uses here


def default_devices(num_partitions: int) -> list[torch.device]:
    """The visible CUDA devices, or the CPU for every partition on a machine without one."""
    if torch.cuda.is_available():
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")] * num_partitions


def verify_module(module: nn.Sequential) -> None:
    """Refuse what GPipe cannot partition: a module that is not an ``nn.Sequential``, the same
    layer twice, or a parameter shared by two distinct layers (torchgpipe's checks and words).

    Example::

        verify_module(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))   # fine
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"module must be nn.Sequential to be partitioned, got {type(module).__name__}; "
                        "wrap your layers in nn.Sequential, or let the explorer trace the model (pipexplore.models.trace)")
    seen: dict[int, int] = {}
    for index, layer in enumerate(module):
        if id(layer) in seen:
            raise ValueError(f"module with duplicate children is not supported: layer {index} is the same "
                             f"module as layer {seen[id(layer)]}")
        seen[id(layer)] = index
    owner: dict[int, str] = {}
    for layer_name, layer in module.named_children():
        for name, param in layer.named_parameters():
            first = owner.setdefault(id(param), f"{layer_name}.{name}")
            if not first.startswith(f"{layer_name}."):
                raise ValueError(f"module with duplicate parameters in distinct children is not supported: "
                                 f"'{layer_name}.{name}' is the parameter '{first}'; put the layers that share "
                                 "it in one child (e.g. an nn.Sequential of them), so that one partition holds it")


def verify_balance(module: nn.Sequential, balance: Iterable[float]) -> list[int]:
    """``balance`` as a list of ints that partitions ``module``: whole numbers (integral floats are
    taken, as torchgpipe takes them; ``3.5`` is refused, not truncated), each at least 1, summing to
    its layers. An empty module takes the empty balance.

    Example::

        verify_balance(nn.Sequential(a, b, c), [2, 1.0])    # [2, 1]
    """
    items = list(balance) if hasattr(balance, "__iter__") and not isinstance(balance, (str, bytes)) else None
    if items is None or not all(
            isinstance(b, numbers.Integral) and not isinstance(b, bool) or isinstance(b, float) and b.is_integer()
            for b in items):
        raise TypeError(f"balance must be a list of ints (layers per partition), got {balance!r}: give e.g. "
                        f"balance=[{len(module) // 2}, {len(module) - len(module) // 2}]")
    counts = [int(b) for b in items]  # integral floats, as torchgpipe takes them
    if not counts and len(module):
        raise BalanceError("balance is empty: give one layer count per partition, e.g. balance=[2, 2], "
                           "or compute one with pipexplore.balance.balance_by_time")
    if sum(counts) != len(module):
        raise BalanceError(f"balance {counts} sums to {sum(counts)} but the module has {len(module)} layers: "
                           "give layer counts that add up to the module's layers, or compute them with "
                           "pipexplore.balance.balance_by_time")
    for j, b in enumerate(counts):
        if b <= 0:
            raise BalanceError(f"balance {counts}: partition {j} has {b} layers; every partition needs at least 1")
    return counts


def split_module(module: nn.Sequential, balance: Sequence[int],
                 devices: Sequence[torch.device]) -> list[nn.Sequential]:
    """Cut ``module`` into ``nn.Sequential`` partitions (keeping layer names) on ``devices``."""
    validate.enough_devices(len(devices), len(balance))
    names = list(module._modules.keys())
    layers = list(module)
    partitions: list[nn.Sequential] = []
    start = 0
    for size, device in zip(balance, devices):
        part = nn.Sequential(OrderedDict((names[k], layers[k]) for k in range(start, start + size)))
        partitions.append(part.to(device))
        start += size

    owner: dict[int, int] = {}
    for j, part in enumerate(partitions):
        for name, param in part.named_parameters(remove_duplicate=False):
            other = owner.setdefault(id(param), j)
            if other != j:
                raise ValueError(f"parameter '{name}' of partition {j} is shared with partition {other}; "
                                 "a parameter shared across partitions is not supported: keep the layers "
                                 "that share it in one partition")
    return partitions


class GPipe(nn.Module):
    """Pipeline parallelism for an ``nn.Sequential`` (torchgpipe-compatible).

    Example::

        model = nn.Sequential(a, b, c, d)
        model = GPipe(model, balance=[1, 1, 1, 1], devices=['cpu'] * 4, chunks=8)
        output = model(input)          # input on model.devices[0]
        output.sum().backward()

    Args:
        module: the ``nn.Sequential`` to partition.
        balance: layers per partition.
        devices: one device per partition (``'cpu'`` may repeat); default: the visible CUDA
            devices, or the CPU for every partition when there are none.
        chunks: micro-batches per mini-batch.
        checkpoint: ``'always'``, ``'except_last'`` (default) or ``'never'``.
        deferred_batch_norm: track BatchNorm statistics per mini-batch.
    """

    balance: list[int]
    devices: list[torch.device]
    chunks: int
    checkpoint: str

    def __init__(self, module: nn.Sequential, balance: Optional[Iterable[int]] = None, *,
                 devices: Optional[Devices] = None, chunks: int = 1, checkpoint: str = "except_last",
                 deferred_batch_norm: bool = False) -> None:
        super().__init__()
        if balance is None:
            raise ValueError("balance is required: give the number of layers per partition, "
                             "or compute it with pipexplore.balance.balance_by_time")
        chunks = validate.chunks(chunks, coerce_float=True)  # an integral float, as torchgpipe takes it
        if not isinstance(checkpoint, (str, bool)) and checkpoint is not None:
            checkpoint = str(checkpoint)  # any object whose str() is a mode, as torchgpipe takes it
        validate.checkpoint(checkpoint)
        validate.boolean(deferred_batch_norm, "deferred_batch_norm")

        verify_module(module)
        balance = verify_balance(module, balance)
        verify_skippables(module)

        self.chunks = chunks
        self.checkpoint = checkpoint
        if deferred_batch_norm:
            module = DeferredBatchNorm.convert_deferred_batch_norm(module, chunks)

        resolved = default_devices(len(balance)) if devices is None else [
            _as_device(d) for d in validate.devices(devices)]
        self.partitions = nn.ModuleList(split_module(module, balance, resolved))
        self.devices = resolved[: len(balance)]
        self.balance = balance
        self._copy_streams: list[list[AbstractStream]] = []
        self._skip_layout: SkipLayout = inspect_skip_layout(self._sequentials())
        self._rng_locks = rng_locks(list(self.partitions), self.devices)

    def _sequentials(self) -> list[nn.Sequential]:
        """The partitions, each an ``nn.Sequential`` (an ``nn.ModuleList`` types its items as plain modules)."""
        return cast(list[nn.Sequential], list(self.partitions))  # cast: split_module made each an nn.Sequential

    def __len__(self) -> int:
        return sum(len(p) for p in self._sequentials())

    def __getitem__(self, index: int) -> nn.Module:
        if index < 0:
            index += len(self)
        for partition in self._sequentials():
            if index < len(partition):
                return partition[index]
            index -= len(partition)
        raise IndexError("layer index out of range")

    def __iter__(self) -> Iterator[nn.Module]:
        for partition in self._sequentials():
            yield from partition

    # GPipe places the partitions; moving them as a whole would break that.
    def cuda(self, device: Any = None) -> "GPipe":
        raise MOVING_DENIED

    def cpu(self) -> "GPipe":
        raise MOVING_DENIED

    def to(self, *args: Any, **kwargs: Any) -> "GPipe":  # type: ignore[override]
        # Changing the dtype is fine; moving is not.
        if "device" in kwargs or "tensor" in kwargs:
            raise MOVING_DENIED
        if args:
            if isinstance(args[0], (torch.device, int, str)):
                raise MOVING_DENIED
            if torch.is_tensor(args[0]):
                raise MOVING_DENIED
        return super().to(*args, **kwargs)

    def _ensure_copy_streams(self) -> list[list[AbstractStream]]:
        if not self._copy_streams:
            self._copy_streams = [[new_stream(d) for _ in range(self.chunks)] for d in self.devices]
        return self._copy_streams

    def checkpoint_stop(self, num_microbatches: int) -> int:
        """Micro-batches ``0 .. stop-1`` are checkpointed (none in eval mode)."""
        if not self.training:
            return 0
        return {"always": num_microbatches, "except_last": num_microbatches - 1, "never": 0}[self.checkpoint]

    def forward(self, input: TensorOrTensors) -> TensorOrTensors:  # type: ignore[override]
        """Run ``input`` (a tensor or a tuple of tensors on ``devices[0]``) through the pipeline."""
        microbatch.check(input)
        if not self.devices:
            return input  # an empty nn.Sequential is the identity
        batches = microbatch.scatter(input, self.chunks)
        pipeline = Pipeline(batches, self._sequentials(), self.devices, self._ensure_copy_streams(),
                            self._skip_layout, self.checkpoint_stop(len(batches)), self._rng_locks)
        pipeline.run()
        return microbatch.gather(batches)

