"""What the pool sends each rank: a function and its arguments, pickled by value (``cloudpickle``),
and the check that names what in them cannot be pickled (``model.1.lock``: a lock inside a layer)
before any process starts.

Example::

    payload = pack_job(function, {"x": 1})       # a rank runs function(rank, world, x=1)
    ensure_picklable({"model": model, "loss_fn": loss_fn})
"""
from __future__ import annotations

import contextlib
import functools
import types
from typing import Any, Callable, Iterator

__all__ = ["pack_job", "ensure_picklable"]


def _children(value: Any) -> Iterator[tuple[str, Any]]:
    """(path suffix, object) for what pickling ``value`` pickles too, as far as it can be named."""
    from torch import nn

    if isinstance(value, nn.Module):
        for name, child in value.__dict__.items():
            if name in ("_modules", "_parameters", "_buffers"):
                yield from ((f".{k}", v) for k, v in child.items() if v is not None)
            else:
                yield f".{name}", child
    elif isinstance(value, dict):
        yield from ((f"[{k!r}]", v) for k, v in value.items())
    elif isinstance(value, (list, tuple, set, frozenset)):
        yield from ((f"[{i}]", v) for i, v in enumerate(value))
    elif isinstance(value, functools.partial):
        yield from [(".func", value.func), (".args", value.args), (".keywords", value.keywords)]
    elif isinstance(value, types.MethodType):
        yield from [(".__self__", value.__self__), (".__func__", value.__func__)]
    elif isinstance(value, types.FunctionType):
        for name, cell in zip(value.__code__.co_freevars, value.__closure__ or ()):
            with contextlib.suppress(ValueError):  # an empty cell
                yield f" (closure variable {name!r})", cell.cell_contents
        for name in value.__code__.co_names:
            if name in value.__globals__:
                yield f" (global {name!r})", value.__globals__[name]
        yield from ((f" (default {i})", v) for i, v in enumerate(value.__defaults__ or ()))
    elif isinstance(value, type):
        yield from ((f".{k}", v) for k, v in vars(value).items() if not k.startswith("__"))
    elif hasattr(value, "__dict__") and not isinstance(value, types.ModuleType):
        yield from ((f".{k}", v) for k, v in vars(value).items())


def _first_unpicklable(value: Any, path: str, error: BaseException, seen: set[int], depth: int = 0
                       ) -> tuple[str, Any, BaseException]:
    """Descend into the first child that fails to pickle: the deepest such object names the culprit."""
    import cloudpickle

    seen.add(id(value))
    if depth < 16:
        for suffix, child in _children(value):
            if id(child) in seen:
                continue
            try:
                cloudpickle.dumps(child)
            except Exception as child_error:
                return _first_unpicklable(child, path + suffix, child_error, seen, depth + 1)
    return path, value, error


def ensure_picklable(named: dict[str, Any]) -> None:
    """Check that each object can be sent to the workers; else a TypeError naming the culprit.

    The error names the argument, the attribute path to the object that cannot be pickled (for
    example ``model.1.lock``), its type and what to do.

    Example::

        ensure_picklable({"model": model, "loss_fn": loss_fn})
    """
    import cloudpickle

    for name, value in named.items():
        try:
            cloudpickle.dumps(value)
        except Exception as error:
            path, culprit, cause = _first_unpicklable(value, name, error, set())
            raise TypeError(
                f"cannot send {name} to the worker processes: {path} (a {type(culprit).__module__}."
                f"{type(culprit).__qualname__}) cannot be pickled ({type(cause).__name__}: {cause}). The processes "
                f"executor sends the model, loss_fn, optimizer and batch to each rank by value (cloudpickle): "
                f"remove or replace that object (create it where it is used, or leave it out in __getstate__), "
                "or run in this process with executor='threads'") from error


def pack_job(function: Callable[..., Any], kwargs: dict[str, Any]) -> bytes:
    """``function`` and its keyword arguments as bytes a worker runs as ``function(rank, world, **kwargs)``.

    Example::

        payload = pack_job(pipexplore.executors.distributed._rank_step, {"job": job})
    """
    import cloudpickle

    try:
        return bytes(cloudpickle.dumps((function, kwargs)))
    except Exception:
        ensure_picklable(kwargs)  # names the culprit
        raise
