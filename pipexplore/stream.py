"""Streams that work on any device: CUDA streams on GPUs, a no-op stand-in on the CPU."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Generator, Union, cast

import torch

__all__ = [
    "AbstractStream", "CPUStream", "new_stream", "current_stream", "default_stream",
    "use_device", "use_stream", "get_device", "wait_stream", "record_stream", "is_cuda",
]


class _CPUStreamType:
    def __repr__(self) -> str:
        return "CPUStream"


#: The stream of the CPU: work on it is ordered by the host thread that issues it.
CPUStream = _CPUStreamType()

AbstractStream = Union[torch.cuda.Stream, _CPUStreamType]


def is_cuda(stream: AbstractStream) -> bool:
    return stream is not CPUStream


def as_cuda(stream: AbstractStream) -> torch.cuda.Stream:
    return cast(torch.cuda.Stream, stream)


def new_stream(device: torch.device) -> AbstractStream:
    """A new stream on ``device`` (the CPU stand-in on the CPU)."""
    if device.type != "cuda":
        return CPUStream
    return torch.cuda.Stream(device)


def current_stream(device: torch.device) -> AbstractStream:
    if device.type != "cuda":
        return CPUStream
    return torch.cuda.current_stream(device)


def default_stream(device: torch.device) -> AbstractStream:
    if device.type != "cuda":
        return CPUStream
    return torch.cuda.default_stream(device)


@contextmanager
def use_device(device: torch.device) -> Generator[None, None, None]:
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield


@contextmanager
def use_stream(stream: AbstractStream) -> Generator[None, None, None]:
    if not is_cuda(stream):
        yield
        return
    with torch.cuda.stream(as_cuda(stream)):
        yield


def get_device(stream: AbstractStream) -> torch.device:
    if is_cuda(stream):
        return as_cuda(stream).device
    return torch.device("cpu")


def wait_stream(source: AbstractStream, target: AbstractStream) -> None:
    """``source`` waits for the work queued on ``target`` so far."""
    if is_cuda(target):
        if is_cuda(source):
            as_cuda(source).wait_stream(as_cuda(target))
        else:
            as_cuda(target).synchronize()
    # A CPU target: its work is done when the host thread gets here.


def record_stream(tensor: torch.Tensor, stream: AbstractStream) -> None:
    """Keep ``tensor``'s memory from reuse until the work queued on ``stream`` is done."""
    if is_cuda(stream):
        # A tensor with no storage of its own (a phony, a view of nothing) needs no guard.
        tensor = tensor.new_empty([0]).set_(tensor.untyped_storage())
        tensor.record_stream(as_cuda(stream))
