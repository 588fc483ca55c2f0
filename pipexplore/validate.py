"""Argument checks, one function per concept: each refusal names the argument, the bad value and the valid range.

``Plan``, ``GPipe``, ``ScheduleExecutor``, ``explore``/``Explorer`` and the executors call these
where a value enters, so that the same mistake gets the same words everywhere::

    chunks(8, batch=10)        # ValueError: chunks=8 cannot split a batch of 10 rows into 8 micro-batches ...
    devices("cpu,cpu")         # ('cpu', 'cpu')
    sample([[1.0, 2.0]])       # TypeError: sample must be a tensor ... got a list ...
"""
from __future__ import annotations

import functools
import numbers
import os
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Any, Generator, Optional, Sequence

import torch
from torch import nn

from pipexplore.splits import SplitError, check_splits

__all__ = [
    "TooFewDevicesError", "integer", "boolean", "chunks", "chunks_for_batch", "splits_exactly", "valid_chunks",
    "device", "devices",
    "enough_devices", "splits", "virtual_stages", "checkpoint", "schedule", "executor", "sample", "target",
    "loss_value", "optional_callable", "naming_failing_layer", "interleaved_devices", "capacity_factor",
    "one_of",
]

CHECKPOINTS = ("always", "except_last", "never")


class TooFewDevicesError(ValueError, IndexError):
    """More partitions than devices (an ``IndexError`` too, as torchgpipe raises it)."""


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def integer(value: Any, name: str, *, minimum: int = 1, coerce_float: bool = False) -> int:
    """``value`` as an int of at least ``minimum``; ``coerce_float`` also takes integral floats (``42.0``).

    Example::

        integer(3, "repeats")          # 3
        integer("2", "chunks")         # TypeError: chunks must be an integer ≥ 1, got '2' (str)
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer ≥ {minimum}, got {value!r} (a bool): give a number such as "
                        f"{max(minimum, 2)}")
    if isinstance(value, numbers.Integral):
        number = int(value)
    elif coerce_float and isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be an integer ≥ {minimum}, got {_shown(value)} ({type(value).__name__}): "
                        "give a whole number")
    else:
        raise TypeError(f"{name} must be an integer ≥ {minimum}, got {_shown(value)} ({type(value).__name__})")
    if number < minimum:
        raise ValueError(f"{name} must be an integer ≥ {minimum}, got {number}")
    return number


def boolean(value: Any, name: str) -> bool:
    """``value`` when it is a bool; anything else is refused.

    Example::

        boolean(True, "calibrate")     # True
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {_shown(value)} ({type(value).__name__})")
    return value


def one_of(value: Any, name: str, choices: Sequence[str], meaning: str = "") -> str:
    """``value`` where it is one of ``choices`` (option ``name``'s), else a ``ValueError`` naming them
    and, where ``meaning`` says it, what they mean (``unknown data_parallel 'zero3': ddp, zero1, fsdp``)."""
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}: {', '.join(choices)}" + (f" ({meaning})" if meaning else ""))
    return str(value)


def capacity_factor(value: Any, ep: Optional[int] = None, name: str = "capacity_factor") -> float:
    """``value`` as a mixture of experts' routing imbalance: how many times its balanced share of the
    routed tokens the busiest expert-parallel rank receives, a number from 1 (balanced routing) to
    ``ep`` (every routed token; None: the mesh not known yet, no bound above).

    Example::

        capacity_factor(2, ep=8)        # 2.0
        capacity_factor(True)           # TypeError: capacity_factor must be a number from 1 ... got True (bool)
        capacity_factor(9, ep=8)        # ValueError: capacity_factor is how many times ... to ep = 8, got 9
    """
    bound = f"ep = {ep}" if ep is not None else "the mesh's ep"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number from 1 (balanced routing) to {bound}, got {_shown(value)} "
                        f"({type(value).__name__})")
    number = float(value)
    if not 1.0 <= number < float("inf") or (ep is not None and number > ep):
        more = " (a factor above 1 needs a mesh whose ep is at least it)" if ep is not None and number > ep else ""
        raise ValueError(f"{name} is how many times its balanced share of the routed tokens the busiest "
                         f"expert-parallel rank receives: from 1 (balanced) to {bound}, got {number:g}{more}")
    return number


def splits_exactly(batch: int, chunks: int) -> bool:
    """Whether ``torch.chunk`` splits ``batch`` rows into exactly ``chunks`` micro-batches (equal
    parts, a smaller last one: 5 rows in 4 chunks make 3).

    Example::

        splits_exactly(10, 4), splits_exactly(5, 4)    # True (3, 3, 3, 1 rows), False (2, 2, 1: three)
    """
    return 1 <= chunks <= batch and _made(batch, chunks) == chunks


def _made(batch: int, chunks: int) -> int:
    """How many micro-batches ``torch.chunk`` makes of ``batch`` rows asked for ``chunks``."""
    return -(-batch // -(-batch // chunks))


def valid_chunks(batch: int, around: int, count: int = 8) -> list[int]:
    """The chunk counts nearest ``around`` that split ``batch`` rows into exactly that many
    micro-batches (as ``torch.chunk`` splits: equal parts, a smaller last one).

    Example::

        valid_chunks(10, 8)    # [3, 4, 5, 10, ...]: 6..9 give 5 micro-batches of 2 rows
    """
    exact = functools.partial(splits_exactly, batch)
    below: list[int] = []
    above: list[int] = []
    c = min(around, batch)
    while c >= 1 and len(below) < count // 2 + 1:
        if exact(c):
            below.append(c)
        c -= 1
    c, steps = around + 1, 0
    while c <= batch and len(above) < count // 2 and steps < 100_000:
        if exact(c):
            above.append(c)
        c, steps = c + 1, steps + 1
    if batch not in below and batch not in above and batch > around:
        above.append(batch)
    return sorted(set(below + above))[-count:] if around >= batch else sorted(set(below + above))


def chunks_for_batch(chunks: int, batch: int, name: str = "chunks") -> None:
    """Refuse ``chunks`` that a batch of ``batch`` rows cannot be split into exactly (``torch.chunk``):
    every executor would run fewer micro-batches than the plan says.

    Example::

        chunks_for_batch(4, 6)   # ValueError: chunks=4 cannot split ... torch.chunk makes 3 micro-batches
    """
    if chunks > batch:
        raise ValueError(f"{name}={chunks} is more than the batch's {batch} rows: every micro-batch needs at least one "
                         f"row; choose {name} between 1 and {batch} (that split it exactly: "
                         f"{', '.join(map(str, valid_chunks(batch, batch)))})")
    rows, made = -(-batch // chunks), _made(batch, chunks)
    if made != chunks:
        raise ValueError(f"{name}={chunks} cannot split a batch of {batch} rows into {chunks} micro-batches: "
                         f"torch.chunk makes {made} micro-batches of up to {rows} rows; choose {name} among "
                         f"{', '.join(map(str, valid_chunks(batch, chunks)))}, or change the batch")


def chunks(value: Any, *, batch: Optional[int] = None, name: str = "chunks", coerce_float: bool = False) -> int:
    """Micro-batches per step: an int ≥ 1 that splits ``batch`` rows exactly (when given).

    Example::

        chunks(4, batch=16)       # 4
        chunks(42.0, coerce_float=True)   # 42 (GPipe takes integral floats, as torchgpipe does)
    """
    try:
        number = integer(value, name, minimum=1, coerce_float=coerce_float)
    except (TypeError, ValueError) as exc:  # torchgpipe's words first
        raise type(exc)(f"{name}: number of chunks must be a positive integer, got {_shown(value)}"
                        f"{'' if isinstance(exc, ValueError) else f' ({type(value).__name__})'}") from None
    if batch is not None:
        chunks_for_batch(number, batch, name)
    return number


def device(value: Any, name: str = "device") -> torch.device:
    """One device that exists here: ``'cpu'``, ``'cuda:N'``, an int N (``cuda:N``) or a ``torch.device``.

    Example::

        device("cpu")          # torch.device('cpu')
        device("cuda:7")       # ValueError: device 'cuda:7' does not exist ...
    """
    if isinstance(value, bool) or not isinstance(value, (str, int, torch.device)):
        raise TypeError(f"{name}: {_shown(value)} ({type(value).__name__}) is not a device: give 'cpu', 'cuda:N', "
                        "an int N or a torch.device")
    if isinstance(value, int):
        value = torch.device("cuda", value)
    try:
        resolved = torch.device(value)
    except RuntimeError as exc:
        raise ValueError(f"{name}: {value!r} is not a device: {exc}") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}: device '{resolved}' does not exist: CUDA is not available on this machine; "
                             "use devices=['cpu', ...]")
        count = torch.cuda.device_count()
        index = resolved.index if resolved.index is not None else torch.cuda.current_device()
        if index >= count:
            raise ValueError(f"{name}: device '{resolved}' does not exist: {count} CUDA device(s) visible "
                             f"(cuda:0..cuda:{count - 1})")
        resolved = torch.device("cuda", index)
    elif resolved.type != "cpu":
        raise ValueError(f"{name}: device '{resolved}' is not supported: use 'cpu' or 'cuda:N'")
    return resolved


def devices(value: Any, name: str = "devices", *, exist: bool = True) -> tuple[str, ...]:
    """A non-empty list of devices that exist (any names when ``exist`` is False: a plan may be
    predicted for devices this machine lacks), as strings; a string is read as comma-separated
    (``'cpu,cpu'``), never letter by letter.

    Example::

        devices(["cpu", "cpu"])    # ('cpu', 'cpu')
        devices("cuda:0, cuda:1")  # ('cuda:0', 'cuda:1')
        devices([])                # ValueError: devices is empty ...
    """
    if isinstance(value, str):
        items: list[Any] = [part.strip() for part in value.split(",") if part.strip()]
    elif isinstance(value, (torch.device, int, bytes)) or value is None or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be a list of devices such as ['cpu', 'cpu'] (or a comma-separated string "
                        f"'cpu,cpu'), got {_shown(value)} ({type(value).__name__})")
    else:
        items = list(value)
    if not items:
        raise ValueError(f"{name} is empty ({_shown(value)}): give one device per stage, e.g. ['cpu', 'cpu']")
    out = []
    for item in items:
        if isinstance(item, str):
            item = item.strip()
        if exist:
            device(item, name)
        elif isinstance(item, bool) or not isinstance(item, (str, int, torch.device)) or item == "":
            raise TypeError(f"{name}: {_shown(item)} ({type(item).__name__}) is not a device: give 'cpu', 'cuda:N', "
                            "an int N or a torch.device")
        out.append(f"cuda:{item}" if isinstance(item, int) else str(item))
    return tuple(out)


def enough_devices(count: int, partitions: int) -> None:
    """Refuse fewer devices than partitions (torchgpipe's words; an ``IndexError`` and a ``ValueError``).

    Example::

        enough_devices(2, 4)   # TooFewDevicesError: too few devices to hold given partitions ...
    """
    if count < partitions:
        raise TooFewDevicesError(f"too few devices to hold given partitions (devices: {count}, partitions: "
                                 f"{partitions}): devices needs one entry per partition ('cpu' may repeat)")


def splits(value: Any, num_layers: int, name: str = "splits") -> list[int]:
    """Sorted layer indices in ``1 … num_layers - 1`` that begin a stage.

    Example::

        splits([4, 9], 12)     # [4, 9]
        splits(None, 12)       # TypeError: splits must be a list of layer indices ...
    """
    if isinstance(value, (str, bytes)) or value is None or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be a list of layer indices that begin a stage (between 1 and "
                        f"{num_layers - 1}, sorted), e.g. [{max(1, num_layers // 2)}]; got {_shown(value)} "
                        f"({type(value).__name__})")
    points = list(value)
    for point in points:
        if isinstance(point, bool) or not (isinstance(point, numbers.Integral) or
                                           (isinstance(point, float) and point.is_integer())):
            raise TypeError(f"{name}: split point {_shown(point)} ({type(point).__name__}) is not a layer index: "
                            f"give ints between 1 and {num_layers - 1}")
    try:
        return check_splits([int(p) for p in points], num_layers)
    except SplitError as exc:
        raise SplitError(f"{name}={[int(p) for p in points]}: {exc}") from None


def virtual_stages(value: Any) -> int:
    """Stages per device of the interleaved schedule: an int ≥ 1.

    Example::

        virtual_stages(2)      # 2
    """
    return integer(value, "virtual_stages", minimum=1)


def checkpoint(value: Any) -> str:
    """``'always'``, ``'except_last'`` or ``'never'`` (torchgpipe's words when not).

    Example::

        checkpoint("never")    # 'never'
    """
    if not isinstance(value, str) or value not in CHECKPOINTS:
        raise ValueError(f"checkpoint is not one of 'always', 'except_last', or 'never', got {_shown(value)}")
    return value


def schedule(value: Any, allowed: Sequence[str], *, csv: bool = False) -> str:
    """A schedule name among ``allowed``; with ``csv``, also the path of a CSV file (a string or
    path ending in ``.csv``, torch's schedule format; read where it is used), as a string.

    Example::

        schedule("1f1b", ("gpipe", "1f1b"))                # '1f1b'
        schedule(Path("my.csv"), ("gpipe",), csv=True)     # 'my.csv'
    """
    if csv and isinstance(value, (str, os.PathLike)) and os.fspath(value).lower().endswith(".csv"):
        return os.fspath(value)
    if not isinstance(value, str) or value not in allowed:
        files = ", or give the path of a .csv file (a schedule in torch's CSV format)" if csv else ""
        raise ValueError(f"unknown schedule {_shown(value)}: choose one of {', '.join(allowed)}{files}")
    return value


def executor(value: Any, allowed: Sequence[str]) -> str:
    """An executor name among ``allowed``.

    Example::

        executor("threads", ("threads", "autograd"))   # 'threads'
    """
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"unknown executor {_shown(value)}: choose one of {', '.join(allowed)}")
    return value


_SAMPLE = "a tensor (one mini-batch, rows along dim 0) or a tuple of such tensors"


def sample(value: Any, name: str = "sample") -> Any:
    """One mini-batch: a tensor with at least one dimension and one row, or a non-empty tuple (or,
    for a traced model's keyword inputs, a dict) of them with the same rows.

    Example::

        sample(torch.randn(16, 8))          # the tensor
        sample(numpy_array)                 # TypeError: ... got a numpy array: give torch.from_numpy(sample)
    """
    if torch.is_tensor(value):
        if value.dim() == 0:
            raise ValueError(f"{name} is a 0-dim tensor ({value.item()!r}): it needs a batch dimension (dim 0), "
                             f"e.g. {name}.reshape(1, -1)")
        if value.size(0) == 0:
            raise ValueError(f"{name} has 0 rows (shape {list(value.shape)}): give a mini-batch of at least one row")
        return value
    if isinstance(value, tuple):
        if not value:
            raise TypeError(f"{name} must be {_SAMPLE}, got an empty tuple")
        rows = set()
        for k, item in enumerate(value):
            if not torch.is_tensor(item):
                raise TypeError(f"{name}[{k}] must be a tensor, got {type(item).__name__}: {name} must be {_SAMPLE}")
            sample(item, f"{name}[{k}]")
            rows.add(int(item.size(0)))
        if len(rows) != 1:
            raise ValueError(f"the tensors of {name} need the same rows (dim 0), got {sorted(rows)}")
        return value
    if isinstance(value, Mapping):  # keyword inputs of a traced model: {'input_ids': ..., 'attention_mask': ...}
        tensors = {key: item for key, item in value.items() if torch.is_tensor(item)}
        if not tensors:
            raise TypeError(f"{name} must be {_SAMPLE}, or a dict of keyword input tensors; got a "
                            f"{type(value).__name__} without tensors ({', '.join(map(str, value)) or 'empty'})")
        for key, item in tensors.items():
            sample(item, f"{name}[{key!r}]")
        rows = {int(item.size(0)) for item in tensors.values()}
        if len(rows) != 1:
            raise ValueError(f"the tensors of {name} need the same rows (dim 0), got {sorted(rows)}")
        return value
    kind = type(value).__name__
    hint = ("give torch.from_numpy(sample)" if type(value).__module__.startswith("numpy") else
            "give torch.tensor(sample), or a tuple for several inputs" if isinstance(value, list) else
            "give the model's input for one mini-batch, e.g. torch.randn(32, 128)")
    article = "a numpy array" if kind == "ndarray" else ("None" if value is None else f"a {kind}")
    raise TypeError(f"{name} must be {_SAMPLE}, got {article}: {hint}")


def target(value: Any, batch: int, name: str = "target") -> Any:
    """A target for ``batch`` rows: None, anything that is not a tensor (handed to ``loss_fn`` as
    it is), or a tensor with one row per sample row.

    Example::

        target(torch.randn(16, 1), 16)     # the tensor
    """
    if torch.is_tensor(value):
        if value.dim() == 0:
            raise ValueError(f"{name} is a 0-dim tensor: it is split into micro-batches along dim 0 like the sample; "
                             f"give one row per sample row ({batch})")
        if value.size(0) != batch:
            raise ValueError(f"{name} has {value.size(0)} rows but the sample has {batch}: give one target row per "
                             "sample row")
    return value


def loss_value(loss: Any, name: str = "loss_fn") -> torch.Tensor:
    """What ``loss_fn`` returned, when it is a tensor of one floating value (``backward()`` starts there).

    Example::

        loss = loss_value(loss_fn(output, target))   # TypeError when loss_fn returned a float or None
    """
    if not torch.is_tensor(loss):
        raise TypeError(f"{name} must return a scalar tensor, got {_shown(loss)} ({type(loss).__name__}): return a "
                        "tensor computed from the output, e.g. nn.functional.mse_loss(output, target)")
    if loss.numel() != 1:
        raise ValueError(f"{name} must return a scalar tensor, got a tensor of shape {list(loss.shape)}: reduce it, "
                         "e.g. with .mean() or reduction='mean'")
    if not loss.is_floating_point():
        raise TypeError(f"{name} must return a floating-point scalar tensor, got dtype {loss.dtype}")
    return loss


def optional_callable(value: Any, name: str, example: str) -> Any:
    """None or a callable.

    Example::

        optional_callable(nn.functional.mse_loss, "loss_fn", "loss_fn(output, target)")
    """
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be a callable {example} or None, got {_shown(value)} ({type(value).__name__})")
    return value


def _failing_layer(module: nn.Module, exc: BaseException) -> Optional[tuple[int, str, nn.Module]]:
    """The outermost child of ``module`` whose ``forward`` is in ``exc``'s traceback."""
    children = {id(child): (k, name, child) for k, (name, child) in enumerate(module.named_children())}
    traceback = exc.__traceback__
    while traceback is not None:
        owner = traceback.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in children:
            return children[id(owner)]
        traceback = traceback.tb_next
    return None


@contextmanager
def naming_failing_layer(module: nn.Module, value: Any, name: str = "sample") -> Generator[None, None, None]:
    """Running ``module``'s layers on ``value``: an error raised inside one of its layers becomes
    a ``ValueError`` that names the argument and the layer (the original error as its cause).

    Example::

        with naming_failing_layer(model, sample):
            profile(model, sample)   # ValueError: sample (shape [16, 5]) does not fit the model: layer 0 (Linear) ...
    """
    try:
        yield
    except Exception as exc:
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            raise
        found = _failing_layer(module, exc)
        if found is None:
            raise
        index, layer_name, layer = found
        shapes = (list(value.shape) if torch.is_tensor(value) else
                  [list(t.shape) for t in value if torch.is_tensor(t)] if isinstance(value, tuple) else "?")
        raise ValueError(f"{name} (shape {shapes}) does not fit the model: layer {index} ('{layer_name}', "
                         f"{type(layer).__name__}) failed on it with {type(exc).__name__}: {exc}") from exc


def interleaved_devices(stages: int, devices: Sequence[Any], chunks: int) -> list[Any]:
    """The device of each stage under the interleaved schedule (stage ``s`` on device ``s % p``),
    after checking that the stages and ``chunks`` are multiples of the ``p`` devices.

    Example::

        interleaved_devices(4, ["cuda:0", "cuda:1"], chunks=8)   # ['cuda:0', 'cuda:1', 'cuda:0', 'cuda:1']
    """
    p = len(devices)
    if stages % p:
        raise ValueError(f"interleaved spreads {stages} stages over {p} devices: the stage count must be a "
                         "multiple of the device count")
    if chunks % p:
        raise ValueError(f"interleaved needs chunks ({chunks}) to be a multiple of the device count ({p})")
    return [devices[s % p] for s in range(stages)]


def first_chunks(value: Optional[int], batch: int, given: Optional[int] = None) -> int:
    """The micro-batches a first plan runs: ``value`` checked against the ``batch``'s rows; else
    what a schedule file ``given`` says; else 4, or the most a small batch splits into exactly."""
    if value is None:
        value = given if given is not None else max(c for c in valid_chunks(batch, 4) if c <= 4)
    return chunks(value, batch=batch)
