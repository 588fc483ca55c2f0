"""Micro-batches: split a mini-batch along dim 0 and gather it back."""
from __future__ import annotations

import typing
from typing import Callable, Iterator, Sequence, Union, cast

import torch
from torch import Tensor

from pipexplore.samples import TensorOrTensors, Tensors

__all__ = ["Batch", "check", "scatter", "gather"]


class Batch:
    """A micro-batch: one tensor (``atomic``) or a tuple of tensors.

    ``batch[0]`` is the tensor that carries the pipeline's ordering edges (fork/join phonies)::

        batch = Batch(torch.ones(2, 3))
        batch[0] = batch[0] * 2
        out = batch.call(layer)
    """

    __slots__ = ("value", "atomic")

    def __init__(self, value: TensorOrTensors) -> None:
        self.value = value
        self.atomic = torch.is_tensor(value)

    @property
    def tensor(self) -> Tensor:
        if not self.atomic:
            raise AttributeError("not atomic batch")
        return cast(Tensor, self.value)

    @property
    def tensors(self) -> Tensors:
        if self.atomic:
            raise AttributeError("batch is atomic")
        return cast(Tensors, self.value)

    @property
    def tensor_or_tensors(self) -> TensorOrTensors:
        return self.value

    def call(self, function: Callable[[TensorOrTensors], TensorOrTensors]) -> "Batch":
        return Batch(function(self.value))

    def __repr__(self) -> str:
        return f"Batch[atomic={self.atomic!r}]({self.value!r})"

    def __iter__(self) -> Iterator[Tensor]:
        if self.atomic:
            yield self.tensor
        else:
            yield from self.tensors

    def __len__(self) -> int:
        return 1 if self.atomic else len(self.tensors)

    def __getitem__(self, index: int) -> Tensor:
        if not self.atomic:
            return self.tensors[index]
        if index != 0:
            raise IndexError("atomic batch allows index 0 only")
        return self.tensor

    @typing.overload
    def __setitem__(self, index: int, value: Tensor) -> None: ...

    @typing.overload
    def __setitem__(self, index: slice, value: Tensors) -> None: ...

    def __setitem__(self, index: Union[int, slice], value: TensorOrTensors) -> None:
        if isinstance(index, int):
            self._setitem_by_index(index, cast(Tensor, value))
        else:
            self._setitem_by_slice(index, cast(Tensors, value))

    def _setitem_by_index(self, index: int, value: Tensor) -> None:
        if not self.atomic:
            values = list(self.tensors)
            values[index] = value
            self.value = tuple(values)
            return
        if index != 0:
            raise IndexError("atomic batch allows index 0 only")
        self.value = value

    def _setitem_by_slice(self, index: slice, value: Tensors) -> None:
        if not (index.start is index.stop is index.step is None):
            raise NotImplementedError("only slice [:] supported")
        if not self.atomic:
            self.value = tuple(value)
            return
        if len(value) != 1:
            raise IndexError("atomic batch cannot be replaced with multiple tensors")
        self.value = value[0]


def check(input: object) -> None:
    """Raise ``TypeError`` unless ``input`` is a tensor or a non-empty tuple of tensors."""
    if isinstance(input, tuple):
        if not input:
            raise TypeError("expected a tensor or a non-empty tuple of tensors, got an empty tuple")
        for x in input:
            check(x)
        return
    if not torch.is_tensor(input):
        raise TypeError(f"expected a tensor or a tuple of tensors, got {type(input).__name__}")


def scatter(input: TensorOrTensors, chunks: int) -> list[Batch]:
    """Split ``input`` along dim 0 into at most ``chunks`` micro-batches.

    Like :func:`torch.chunk`, a batch not divisible by ``chunks`` gives a smaller last
    micro-batch, and a batch smaller than ``chunks`` gives fewer micro-batches. Each tensor of a
    tuple is split by its own size (as in torchgpipe), so they may differ in dim 0 as long as
    they give the same number of micro-batches.

    Example::

        a, b = scatter((torch.zeros(2, 1), torch.zeros(4, 2)), chunks=2)   # rows 1 and 2 each
    """
    if torch.is_tensor(input):
        return [Batch(x) for x in input.chunk(chunks)]
    tensors = cast(Sequence[Tensor], input)
    columns = [x.chunk(chunks) for x in tensors]
    counts = {len(column) for column in columns}
    if len(counts) != 1:
        shapes = ", ".join(f"tensor {k}: {x.size(0)} rows into {len(c)}"
                           for k, (x, c) in enumerate(zip(tensors, columns)))
        raise ValueError(f"the tensors of a tuple input split into different numbers of micro-batches with "
                         f"chunks={chunks} ({shapes}): give every tensor at least {chunks} rows along dim 0, "
                         "or sizes that split into the same number of micro-batches")
    return [Batch(tuple(row)) for row in zip(*columns)]


def gather(outputs: Sequence[Batch]) -> TensorOrTensors:
    """Concatenate micro-batch outputs back into one mini-batch along dim 0."""
    if outputs[0].atomic:
        return torch.cat([b.tensor for b in outputs])
    columns = zip(*(b.tensors for b in outputs))
    return tuple(torch.cat(column) for column in columns)

