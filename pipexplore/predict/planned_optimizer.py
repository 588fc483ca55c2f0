"""An optimizer step on a planned device: the bytes it reads and writes, and their seconds.

An optimizer step is a pass over the parameters, their gradients and the optimizer's states,
bound by memory bandwidth on any accelerator: its seconds are the bytes its kernels move over the
device's reachable bandwidth (:class:`~pipexplore.predict.roofline.Efficiency`, ``optimizer``).
The bytes are those of ``torch.optim``'s own implementation as it runs on a GPU, counted
(:func:`step_passes`): its default there is the *foreach* form, a kernel per operation over all
parameters, so Adam reads and writes each parameter-sized tensor 19 times a step (its moments
updated, a square root, a division and an addition into a temporary, the update) where a fused
kernel (``fused=True``) moves 8. What a step costs where the device is here is timed instead
(:func:`pipexplore.profiling.optimizer_step.optimizer_seconds`), and a device of the planned kind
here teaches the fraction of bandwidth such a step reaches (:func:`optimizer_bandwidth`).

Example::

    planned_optimizer_seconds(8_000_000_000, "bfloat16", "adamw", "H100", state_dtype="float32")
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pipexplore.devices import device_spec, dtype_name
from pipexplore.predict.roofline import Efficiency, SpecLike
from pipexplore.training import OptimizerFactory, Training, default_optimizer

__all__ = ["OPTIMIZERS", "step_passes", "optimizer_bytes", "planned_optimizer_seconds", "optimizer_bandwidth"]


#: The optimizers known by name: ``torch.optim`` factories as a run makes them (``"sgd"`` is the
#: runs' default, :data:`pipexplore.training.default_optimizer`; the others are choices of their own).
OPTIMIZERS: dict[str, OptimizerFactory] = {
    "sgd": default_optimizer,
    "momentum": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params),
    "adamw": lambda params: torch.optim.AdamW(params),
}

_PROBE = 4096  # elements of the probe parameter: larger than any scalar state, small enough to step at once


class _Passes(TorchDispatchMode):
    """Counts, per aten op, the parameter-sized tensors read (every tensor argument) and written
    (arguments the op's schema marks as mutated, and new outputs), by role: the parameter, its
    gradient, anything else (states and temporaries)."""

    def __init__(self, param: torch.Tensor) -> None:
        super().__init__()
        assert param.grad is not None  # the probe is given its gradient before it is counted
        self.storages = (param.untyped_storage().data_ptr(), param.grad.untyped_storage().data_ptr())
        self.passes = [0, 0, 0]

    def _count(self, tensors: list) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.numel() == _PROBE:
                pointer = t.untyped_storage().data_ptr()
                self.passes[self.storages.index(pointer) if pointer in self.storages else 2] += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        written = []
        for i, argument in enumerate(func._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(argument.name)
                written += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
        mutated = {id(t) for t in written}
        written += [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and id(t) not in mutated]
        self._count(tree_flatten((args, kwargs))[0])
        self._count(written)
        return out


def _factory(optimizer: Any) -> Callable[[Any], Any]:
    if isinstance(optimizer, str):
        key = optimizer.lower().replace("_", "-")
        key = {"sgd-momentum": "momentum", "sgd+momentum": "momentum"}.get(key, key)
        if key not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZERS)}, or give "
                             "a torch.optim class or a factory")
        return OPTIMIZERS[key]
    if isinstance(optimizer, torch.optim.Optimizer):  # an instance: the same class and settings
        return functools.partial(type(optimizer), **{k: v for k, v in optimizer.defaults.items() if k != "params"})
    return Training.of(optimizer=optimizer).optimizer  # None: the runs' default


def step_passes(optimizer: Any = None) -> tuple[float, float, float]:
    """How many times one step of ``optimizer`` reads or writes each parameter-sized tensor, as
    ``(parameter, gradient, states and temporaries)``, counted on ``torch.optim``'s implementation
    as a GPU runs it: the *foreach* form where the optimizer leaves the choice to torch (on a CPU
    torch would loop per parameter; the count is the same), the fused kernel where it asks for
    ``fused=True``. The second step of a probe parameter is counted (the first allocates the
    states), each aten op's tensor arguments read once and what it mutates or returns written
    once (a kernel that reads one tensor twice counts it twice).

    ``optimizer``: a factory as a run takes it (``optimizer(parameters)``), a ``torch.optim``
    class or instance, or a name of :data:`OPTIMIZERS`; ``None``: the runs' default
    (:data:`pipexplore.training.default_optimizer`, SGD).
    SGD: ``(2, 1, 0)``; SGD with momentum ``(2, 1, 5)``; Adam ``(2, 3, 14)``; AdamW ``(4, 3, 14)``
    (weight decay scales the parameter first); fused Adam ``(2, 2, 4)`` (its schema marks the
    gradients mutable, for the unscaling it may do).

    Raises:
        ValueError: an unknown name.
        TypeError: ``optimizer(parameters)`` does not give an optimizer.
    """
    factory = _factory(optimizer)
    try:
        return _cached(factory)
    except TypeError as error:  # an unhashable factory: counted each time
        if "unhashable" not in str(error):
            raise
        return _counted(factory)


@functools.lru_cache(maxsize=64)
def _cached(factory: Callable[[Any], Any]) -> tuple[float, float, float]:
    return _counted(factory)


def _counted(factory: Callable[[Any], Any]) -> tuple[float, float, float]:
    probe = torch.nn.Parameter(torch.zeros(_PROBE))
    probe.grad = torch.full_like(probe, 1e-3)
    optimizer = factory([probe])
    if not hasattr(optimizer, "step") or not hasattr(optimizer, "param_groups"):
        raise TypeError(f"optimizer(parameters) must return a torch.optim.Optimizer, got {type(optimizer).__name__}")
    for group in optimizer.param_groups:  # what torch picks on a GPU
        if group.get("foreach", False) is None and not group.get("fused"):
            group["foreach"] = True
    optimizer.step()
    counter = _Passes(probe)
    with counter:
        optimizer.step()
    return tuple(float(n) for n in counter.passes)  # type: ignore[return-value]


def _itemsize(dtype: Union[str, torch.dtype]) -> int:
    name = dtype_name(dtype)
    if name == "float8":
        return 1
    if name == "tf32":
        return 4
    found = getattr(torch, name, None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return found.itemsize


def optimizer_bytes(param_count: int, dtype: Union[str, torch.dtype], optimizer: Any, *,
                    grad_dtype: Union[None, str, torch.dtype] = None,
                    state_dtype: Union[None, str, torch.dtype] = None) -> int:
    """Bytes one step of ``optimizer`` moves over ``param_count`` parameters: its
    :func:`step_passes` ``(p, g, s)`` times the sizes of a parameter, a gradient and a state.
    Adam in bf16: ``P × (2·2 + 3·2 + 14·2) = 38·P`` bytes; with fp32 states:
    ``P × (2·2 + 3·2 + 14·4) = 66·P``."""
    p, g, s = step_passes(optimizer)
    size = _itemsize(dtype)
    return int(round(int(param_count) * (p * size + g * _itemsize(grad_dtype or dtype)
                                         + s * _itemsize(state_dtype or dtype))))


def planned_optimizer_seconds(param_count: int, dtype: Union[str, torch.dtype], optimizer: Any, spec: SpecLike, *,
                      grad_dtype: Union[None, str, torch.dtype] = None,
                      state_dtype: Union[None, str, torch.dtype] = None,
                      efficiency: Optional[Efficiency] = None) -> float:
    """Seconds a step of ``optimizer`` takes over ``param_count`` parameters on ``spec``: its
    bytes (:func:`optimizer_bytes`) over the memory bandwidth an optimizer step reaches there
    (``Efficiency.optimizer_for``: learnt where a device of the kind is here, else the spec's
    bandwidth efficiency). Launches are left out (a foreach or fused step launches a few kernels
    for all parameters), as is the arithmetic (a few FLOPs per byte moved).

    ``optimizer``: a name of :data:`OPTIMIZERS` (``"sgd"``, ``"momentum"``, ``"adam"``,
    ``"adamw"``), a ``torch.optim`` class or instance, or a factory. States are in ``state_dtype``
    (default: the parameters'), gradients in ``grad_dtype`` (default: the parameters').
    """
    spec = device_spec(spec)
    eff = efficiency if efficiency is not None else Efficiency()
    moved = optimizer_bytes(param_count, dtype, optimizer, grad_dtype=grad_dtype, state_dtype=state_dtype)
    return moved / (spec.memory_bandwidth * eff.optimizer_for(spec))


def optimizer_bandwidth(module: torch.nn.Module, optimizer: Any, spec: SpecLike, *, repeats: int = 5) -> float:
    """The fraction of ``spec``'s memory bandwidth a step of ``optimizer`` reaches over ``module``'s
    parameters (real, on a device of the kind: a block made real to be profiled): what such a
    device here teaches the plan's ``Efficiency.optimizer``.

    A step is timed over the module's parameters and over twice as many (a copy beside them), by
    :func:`pipexplore.profiling.optimizer_step.optimizer_seconds` (copies, gradients set, the median
    of ``repeats`` steps after an untimed one); the counted bytes of one module over the
    difference is the bandwidth a step's bytes move at. The difference leaves out what a step pays
    whatever its size (its Python, its launches: ~0.2 ms for Adam on an H200), which a stage of many
    blocks spreads over all of them; where it does not come out positive (noise on a tiny module),
    the one step's time stands."""
    import copy

    from pipexplore.profiling.optimizer_step import optimizer_seconds as timed

    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"{type(module).__name__} has no trained parameters to step")
    spec = device_spec(spec)
    factory = _factory(optimizer)
    passes = sum(step_passes(factory))  # counted once: parameters, gradients and states of one dtype
    moved = passes * sum(p.numel() * p.element_size() for p in params)
    single = float(timed([module], factory, repeats=repeats)[0])
    double = float(timed([torch.nn.ModuleList([module, copy.deepcopy(module)])], factory, repeats=repeats)[0])
    seconds = double - single if double > single else single
    return moved / (seconds * spec.memory_bandwidth)
