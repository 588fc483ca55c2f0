"""The random generator of a device shared by partitions in other threads, and what their draws replay.

Partitions that share a device (stages on one host's cores, or on one GPU) run at once in their
own threads and share its random generator. Each checkpointed forward of a partition that draws
then draws from a stream of its own, seeded from the shared generator, which its recomputation
replays (:mod:`pipexplore.checkpoint`). On a GPU, every random operator of such a partition that
draws from the shared generator takes the device's lock for the moment it draws
(:class:`RNGGuard`): the partitions' forwards still overlap, only their draws take turns. On a CPU
no random operator needs the lock (only a stream's seed is drawn under it), and a forward that
draws from the shared generator runs as it would without a guard. A partition that cannot draw
(its dropouts' probabilities 0) pays nothing anywhere.
"""
from __future__ import annotations

import threading
from collections import deque
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Optional

import torch
from torch import Tensor

__all__ = ["RNGGuard", "RNGStates", "rng_locks", "has_randomness", "states", "set_states"]

#: The CPU generator's state and a GPU's (None for a CPU device).
RNGStates = tuple[Tensor, Optional[Tensor]]


def states(device: torch.device) -> RNGStates:
    """The CPU generator's state and ``device``'s (None for a CPU)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_states(device: torch.device, states: RNGStates) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1], device)


class RNGGuard:
    """The lock of a device's random generator, as one partition that shares the device takes it,
    and the streams that the partition's checkpointed forwards draw from.

    While a partition's forward runs within :meth:`drawing`, :meth:`checkpointed` or
    :meth:`recomputing`, each random operator it runs (those torch tags
    ``nondeterministic_seeded``: dropout, ``torch.rand``, ...) is caught as it draws, never the rest
    of the forward: partitions sharing the device overlap their forwards. Holding the lock for the
    whole forward, as before, made drawing forwards on one host run one at a time: GPT-2 small's
    step on four CPU stages took 20–21 s with its dropout (16.7 s without); 16.7–18.2 s now.

    A checkpointed forward draws from a stream of its own (generators seeded from the shared
    generator), which its recomputation replays: the same dropout masks whatever the other
    partitions drew meanwhile. A random operator that takes a generator is given the stream's and
    takes no lock (the shared generator stays untouched). One that takes none:

    - on a GPU (a fused dropout or attention, ``torch.rand``) it runs under the lock, on the stream's
      states swapped into the device's generators; so every draw from the shared generator takes
      the lock too, lest it draw from a stream swapped in (``swaps``);
    - on a CPU it runs as it is, and each operator it calls that takes a generator is caught in turn
      and given the stream's: each CPU kernel of torch's random operators draws through one
      (``tests/test_gpipe.py`` holds every one that takes no generator to it). Nothing is swapped,
      no operator's draw takes the lock, and a forward drawing from the shared CPU generator is not
      watched.

    The random operators are caught in torch's dispatcher, not by a dispatch mode: within a watched
    forward this thread's dispatch includes a key at which only the random operators have a kernel
    (ours), and every other operator falls through at no cost, not one Python call. A dispatch mode
    called Python for every operator: a two-layer ``nn.TransformerEncoderLayer(128, 4, 256)`` (batch
    4 × 64) ran its forward 1.4–1.6× as long under it at dropout 0.0, 1.4× at 0.1. Now each caught
    draw costs a call into Python: on a 2-core CPU, a checkpointed forward of that encoder at
    dropout 0.1 (eight draws, each given its stream's generator) takes 5–7 % longer than without a
    guard; its forward that is not checkpointed, no longer watched on a CPU, 0.5–1.7 % (4–4.3 % when
    the lock took its draws; ``benchmarks/rng_guard.py``).

    ``draws``: True, a partition known to draw (a dropout of ``p`` > 0 and kin, or ``uses_rng =
    True``), watched where it needs to be (every forward on a GPU, a checkpointed one on a CPU);
    None, not known yet (its forward may still call ``F.dropout`` or ``torch.rand``), watched until
    a forward in training mode (``module``'s) has shown whether it draws (on a CPU, such a forward
    draws from a stream of its own, whose generator shows each draw): if it drew, ``draws`` becomes
    True; if not, False, and its forwards cost nothing, neither a watch nor a stream of their own,
    until one of ``module``'s dropouts is given a probability above 0. Only a draw counts: an
    operator tagged random that leaves the generator as it was (attention with a dropout of 0) does
    not.

    Example::

        guard = RNGGuard(threading.Lock(), torch.device("cpu"), draws=None)
        with guard.drawing():
            y = partition(x)
        guard.draws    # True when the partition drew random numbers
    """

    def __init__(self, lock: threading.Lock, device: torch.device, draws: Optional[bool],
                 module: Optional[torch.nn.Module] = None) -> None:
        self.lock = lock
        self.device = device
        self.draws = draws
        self.module = module
        #: ``module``'s dropouts, each with the name of its probability: any raised above 0 makes it draw.
        self._dropouts = [(m, name) for m in (module.modules() if module is not None else ())
                          if (name := _dropout_attribute(m)) is not None]
        #: Whether a stream's operator that takes no generator runs on the stream's states swapped
        #: into the device's generators (a GPU's), so that each draw from them takes the lock.
        self.swaps = device.type != "cpu"

    def drawing(self) -> AbstractContextManager[None]:
        """Within (this thread): a forward that draws from the shared generator: on a GPU, one
        operator at a time under the lock; on a CPU, as without a guard once ``draws`` is known."""
        if not self._watches():
            return _UNWATCHED
        if self.swaps:
            return _Watched(self, None)
        return _Watched(self, self._seed()) if self.draws is None else _UNWATCHED

    def checkpointed(self, rng_states: deque) -> AbstractContextManager[None]:
        """Within (this thread): a checkpointed forward, drawing from a stream of its own; where
        the stream starts (its seed) is appended to ``rng_states`` for :meth:`recomputing`."""
        if not self._watches():
            rng_states.append(None)
            return _UNWATCHED
        seed = self._seed()
        rng_states.append(seed)
        return _Watched(self, seed)

    def recomputing(self, rng_states: deque) -> AbstractContextManager[None]:
        """Within (this thread): the recomputation of a checkpointed forward, drawing what it drew."""
        seed = rng_states.pop()
        return _UNWATCHED if seed is None else _Watched(self, seed)

    def _seed(self) -> int:
        """A stream's seed, from the shared generator: each stream its own numbers."""
        with self.lock:
            return int(torch.randint(0, 2**62, (1,)).item())

    def _watches(self) -> bool:
        """Whether the next forward is watched: one that draws, or may (``draws`` not False, or a
        dropout raised above 0 since the partition was seen not to draw)."""
        if self.draws is False and any(getattr(m, name) > 0 for m, name in self._dropouts):
            self.draws = True
        return self.draws is not False


#: A forward that is not watched (the same object every time: it holds nothing).
_UNWATCHED: AbstractContextManager[None] = nullcontext()


class _Watched:
    """Within (this thread): a guard's forward, its random operators caught, drawing from the
    shared generator (``seed`` None) or from a stream of their own that ``seed`` starts. (A class
    of its own, not a generator: one is entered at every forward of a partition that draws.)"""

    __slots__ = ("guard", "draws", "previous", "included")

    def __init__(self, guard: RNGGuard, seed: Optional[int]) -> None:
        self.guard = guard
        self.draws = _Draws(guard, seed, learning=guard.draws is None)

    def __enter__(self) -> None:
        key = _random_key()
        self.previous, self.included = _watch.draws, torch._C._dispatch_tls_is_dispatch_key_included(key)
        _watch.draws = self.draws
        torch._C._dispatch_tls_set_dispatch_key_included(key, True)

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        torch._C._dispatch_tls_set_dispatch_key_included(_key, self.included)
        _watch.draws = self.previous
        guard, draws = self.guard, self.draws
        if kind is None and guard.draws is None and (draws.drew or guard.module is None or guard.module.training):
            guard.draws = draws.drew


class _Draws:
    """What one watched forward draws from: the shared generator (``generators`` None, a GPU's) or
    a stream of its own (``generators``: the CPU's and, on a GPU, the device's, that the stream's
    seed starts); ``drew``, while ``learning``: whether a random operator moved a generator.
    """

    __slots__ = ("guard", "lock", "swaps", "generators", "learning", "drew", "plain")

    def __init__(self, guard: RNGGuard, seed: Optional[int], learning: bool) -> None:
        self.guard, self.lock, self.swaps, self.learning, self.drew = guard, guard.lock, guard.swaps, learning, False
        self.generators = None if seed is None else _seeded(guard.device, seed)
        #: Each draw from the shared generator, nothing to learn: only the lock to take.
        self.plain = self.generators is None and not learning

    def generator(self, args: Any, kwargs: Any) -> Optional[torch.Generator]:
        """The stream's generator for an operator on these arguments' device (None: none of its own)."""
        if self.generators is None:
            return None
        tensor = next((a for a in args if isinstance(a, Tensor)), None)
        if tensor is not None:
            return self.generators[0] if tensor.is_cpu else self.generators[1] if tensor.is_cuda else None
        device = kwargs.get("device")  # a factory function's
        kind = torch.device(device).type if device is not None else torch.get_default_device().type
        return self.generators[0] if kind == "cpu" else self.generators[1] if kind == "cuda" else None

    def own(self, op: Callable[..., Any], args: Any, kwargs: Any, generator: torch.Generator) -> Any:
        """A random operator given the stream's ``generator``: the shared one untouched, no lock."""
        if not self.learning or self.drew:
            return op(*args, **kwargs)
        start = generator.get_state()
        try:
            return op(*args, **kwargs)
        finally:
            self.drew = not torch.equal(start, generator.get_state())

    def shared(self, op: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """A random operator on the device's generators (the guard's lock held): with a stream,
        the stream's states swapped in for it and out after it (an operator that takes no
        generator: a GPU's fused dropout and attention)."""
        learning = self.learning and not self.drew
        if self.generators is None and not learning:
            return op(*args, **kwargs)
        device = self.guard.device
        start = states(device) if self.generators is None else _generator_states(self.generators)
        shared = None
        if self.generators is not None:
            shared = states(device)
            set_states(device, start)
        try:
            return op(*args, **kwargs)
        finally:
            end = states(device)
            if learning:
                self.drew = not (torch.equal(start[0], end[0])
                                 and (start[1] is None or end[1] is None or torch.equal(start[1], end[1])))
            if self.generators is not None and shared is not None:
                _set_generator_states(self.generators, end)
                set_states(device, shared)


def _seeded(device: torch.device, seed: int) -> tuple[torch.Generator, Optional[torch.Generator]]:
    """Generators (the CPU's, and ``device``'s on a GPU) that ``seed`` starts."""
    cpu = torch.Generator().manual_seed(seed)
    return cpu, torch.Generator(device=device).manual_seed(seed) if device.type == "cuda" else None


def _generator_states(generators: tuple[torch.Generator, Optional[torch.Generator]]) -> RNGStates:
    return generators[0].get_state(), generators[1].get_state() if generators[1] is not None else None


def _set_generator_states(generators: tuple[torch.Generator, Optional[torch.Generator]], states: RNGStates) -> None:
    generators[0].set_state(states[0])
    if generators[1] is not None and states[1] is not None:
        generators[1].set_state(states[1])


class _Watch(threading.local):
    #: This thread's watched forward.
    draws: Optional[_Draws] = None


_watch = _Watch()

#: The dispatch key at which :class:`RNGGuard` keeps its kernels of the random operators: one of
#: torch's keys for an out-of-tree mode (torchdistx's deferred initialization, which no operator of
#: torch's has a kernel at), above autograd and ``BackendSelect``, so that a factory function
#: (``torch.rand``) reaches it through the thread's included keys like any other operator.
_KEY_NAME = "DeferredInit"
_key: Any = None
#: The registrations, kept for the process's life (a library dropped takes its kernels with it).
_libraries: list[Any] = []
_install_lock = threading.Lock()


def _random_key() -> Any:
    """The dispatch key that a watched forward includes (its kernels registered the first time)."""
    global _key
    if _key is None:
        with _install_lock:
            if _key is None:
                _key = _install()
    return _key


def _install() -> Any:
    """Register, at :data:`_KEY_NAME`, a fallthrough for every operator and :func:`_kernel` for
    each random one (tagged ``nondeterministic_seeded``) that is not composed of others (a
    composed one, ``dropout``, reaches the key through the operators it is made of)."""
    from torch.library import Library, fallthrough_kernel

    key = torch._C._parse_dispatch_key(_KEY_NAME)
    assert key is not None, f"torch has no dispatch key {_KEY_NAME}"
    fallback = Library("_", "IMPL")
    fallback.fallback(fallthrough_kernel, _KEY_NAME)
    libraries: dict[str, Any] = {}
    seeded = torch.Tag.nondeterministic_seeded
    for name in torch._C._dispatch_get_all_op_names():
        qualname, _, overload = name.partition(".")
        namespace, _, op_name = qualname.partition("::")
        try:
            tags = torch._C._get_operation_overload(qualname, overload)[2]
        except Exception:  # no schema or no Python binding: not an operator a forward runs
            continue
        if seeded not in tags or torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd"):
            continue
        op = getattr(getattr(getattr(torch.ops, namespace), op_name), overload or "default")
        at = next((i for i, a in enumerate(op._schema.arguments) if a.name == "generator"), None)
        if namespace not in libraries:
            libraries[namespace] = Library(namespace, "IMPL")
        kernel = _kernel(op._op, op._handle.redispatch_boxed, at, key)
        libraries[namespace].impl(name.partition("::")[2], kernel, _KEY_NAME, with_keyset=True)
    _libraries.extend([fallback, *libraries.values()])
    return key


def _kernel(op: Callable[..., Any], redispatch: Callable[..., Any], at: Optional[int], key: Any
            ) -> Callable[..., Any]:
    """The kernel of random operator ``op`` (``at``: the position of its ``generator`` argument,
    None if it takes none) in a watched forward: given the stream's generator; else, on a GPU,
    under the guard's lock (:meth:`_Draws.shared`), and on a CPU run as it is below ``key``
    (``redispatch``), each random operator it calls caught in turn. Given a generator or under the
    lock, ``op`` is called again with ``key`` left out of this thread's dispatch: not caught again,
    nor the operators it calls. (Every name it needs is its own: it runs at each draw, and a draw's
    Python is most of what a guard costs.)"""
    watch, exclude = _watch, torch._C._dispatch_tls_set_dispatch_key_excluded
    below = torch._C._dispatch_keyset_full_after(key)

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        draws = watch.draws
        generator = None
        if draws is not None and not draws.plain:
            args, kwargs, generator = _given(draws, at, args, kwargs)
            if generator is None and not draws.swaps:
                return redispatch(keyset & below, *args, **kwargs)
        exclude(key, True)
        try:
            if draws is None:  # not a guard's forward
                return op(*args, **kwargs)
            if draws.plain:
                with draws.lock:
                    return op(*args, **kwargs)
            if generator is not None:
                return draws.own(op, args, kwargs, generator)
            with draws.lock:
                return draws.shared(op, args, kwargs)
        finally:
            exclude(key, False)

    return kernel


def _given(draws: _Draws, at: Optional[int], args: Any, kwargs: Any) -> tuple[Any, Any, Optional[torch.Generator]]:
    """A random operator's arguments in a forward with a stream of its own (or learning whether it
    draws), given the stream's generator where the operator takes one and was given none; and that
    generator (None: none given)."""
    generator = draws.generator(args, kwargs) if at is not None else None
    if generator is None or at is None:
        return args, kwargs, None
    if len(args) > at:
        if args[at] is not None:
            return args, kwargs, None  # a generator of the caller's: drawn as it says
        return (*args[:at], generator, *args[at + 1:]), kwargs, generator
    if kwargs.get("generator") is not None:
        return args, kwargs, None
    return args, {**kwargs, "generator": generator}, generator


def rng_locks(partitions: list[torch.nn.Module], devices: list[torch.device]) -> list[Optional[RNGGuard]]:
    """One lock per device shared by several partitions, taken through each partition's
    :class:`RNGGuard` (``None`` for a partition alone on its device, a GPU of its own with its own
    generator: nothing to guard): held while a partition draws random numbers, so recomputation
    replays the same dropout masks.

    Example::

        guards = rng_locks(partitions, [torch.device("cpu")] * len(partitions))
    """
    generators = [_generator(d) for d in devices]
    locks: dict[torch.device, threading.Lock] = {}
    shared = {g for g in generators if generators.count(g) > 1}
    return [RNGGuard(locks.setdefault(g, threading.Lock()), d, True if has_randomness(p) else None, p)
            if g in shared else None for p, d, g in zip(partitions, devices, generators)]


def _generator(device: torch.device) -> torch.device:
    """The device whose default generator ``device``'s random operators draw from (one for every CPU)."""
    return torch.device("cpu") if device.type == "cpu" else device


def has_randomness(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds layers that draw from the RNG in training: a dropout of ``p`` > 0
    (``nn.Dropout*``, the attention of ``nn.MultiheadAttention``, between an RNN's layers) and kin,
    or one marked ``uses_rng = True``; a dropout of 0 draws nothing."""
    return any(_may_draw(m) for m in module.modules())


def _dropout_attribute(module: torch.nn.Module) -> Optional[str]:
    """The name of the probability with which ``module``, one of torch's layers that drop in
    training, drops (None for another layer)."""
    if isinstance(module, torch.nn.modules.dropout._DropoutNd):
        return "p"
    if isinstance(module, (torch.nn.MultiheadAttention, torch.nn.RNNBase)):
        return "dropout"
    return None


def _may_draw(module: torch.nn.Module) -> bool:
    name = _dropout_attribute(module)
    if name is not None:
        return bool(getattr(module, name) > 0)
    return isinstance(module, torch.nn.RReLU) or bool(getattr(module, "uses_rng", False))
