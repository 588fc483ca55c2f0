"""``@skippable``, ``stash`` and ``pop``: layers that hand tensors to later layers."""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Generator, Iterable, Optional, TypeVar

from torch import Tensor, nn

from pipexplore.microbatch import Batch
from pipexplore.samples import TensorOrTensors
from pipexplore.skip.namespace import Namespace
from pipexplore.skip.tracker import current_skip_tracker

__all__ = ["skippable", "stash", "pop", "Skippable", "verify_skippables"]

T = TypeVar("T", bound="Skippable")


class stash:
    """The command to hand a tensor over: ``yield stash('name', tensor)``."""

    __slots__ = ("name", "tensor")

    def __init__(self, name: str, tensor: Optional[Tensor]) -> None:
        self.name = name
        self.tensor = tensor


class pop:
    """The command to receive a stashed tensor: ``tensor = yield pop('name')``."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class Skippable(nn.Module):
    """A module made by :func:`skippable`: drives the wrapped generator ``forward``.

    The wrapped module is ``self.module``; stashed tensors go to the current skip tracker
    (a plain dict outside a pipeline, portals inside one).
    """

    module_cls: ClassVar[type[nn.Module]]
    stashable_names: ClassVar[frozenset[str]]
    poppable_names: ClassVar[frozenset[str]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.module = self.module_cls(*args, **kwargs)
        self.namespaces: dict[str, Namespace] = {}

    def __repr__(self) -> str:
        return f"@skippable({self.module})"

    def namespaced(self, name: str) -> tuple[Namespace, str]:
        return self.namespaces.get(name), name  # type: ignore[return-value]

    def stashable(self) -> Iterable[tuple[Namespace, str]]:
        for name in sorted(self.stashable_names):
            yield self.namespaced(name)

    def poppable(self) -> Iterable[tuple[Namespace, str]]:
        for name in sorted(self.poppable_names):
            yield self.namespaced(name)

    def isolate(self: T, ns: Namespace, *, only: Optional[Iterable[str]] = None) -> T:
        """Put all (or ``only`` some) of this layer's skip names in ``ns``; returns ``self``."""
        declared = self.stashable_names | self.poppable_names
        names = set(declared if only is None else only)
        unknown = names - declared
        if unknown:
            raise ValueError(f"cannot isolate undeclared skip name(s) {sorted(unknown)}; "
                             f"{type(self).__name__} declares {sorted(declared)}")
        for name in names:
            self.namespaces[name] = ns
        return self

    def dispatch(self, input: TensorOrTensors, handle_stash: Callable[[str, Optional[Tensor]], None],
                 handle_pop: Callable[[str], Optional[Tensor]]) -> Any:
        """Run the wrapped module, answering its ``stash``/``pop`` commands."""
        generator = self.module(input)
        if not isinstance(generator, Generator):
            return generator  # returned without any yield
        try:
            op = next(generator)
            while True:
                if isinstance(op, stash):
                    handle_stash(op.name, op.tensor)
                    op = next(generator)
                elif isinstance(op, pop):
                    op = generator.send(handle_pop(op.name))
                else:
                    raise TypeError(f"{op!r} is not a command from @skippable (yield stash(...) or pop(...))")
        except StopIteration as stop:
            return stop.value

    def forward(self, input: TensorOrTensors) -> TensorOrTensors:  # type: ignore[override]
        tracker = current_skip_tracker()
        stashed: dict[str, Optional[Tensor]] = {}

        # Load what may be popped before running, so that portals see the input batch.
        batch = Batch(input)
        poppable: dict[str, Optional[Tensor]] = {}
        for ns, name in self.poppable():
            try:
                poppable[name] = tracker.load(batch, ns, name)
            except KeyError:
                raise RuntimeError(f"'{name}' has not been stashed before {type(self).__name__} pops it") from None
        input = batch.tensor_or_tensors

        def handle_stash(name: str, tensor: Optional[Tensor]) -> None:
            if name not in self.stashable_names:
                raise RuntimeError(f"'{name}' has not been declared as stashable by {type(self).__name__}")
            if name in stashed:
                raise RuntimeError(f"{type(self).__name__} stashed '{name}' twice in one forward: a name carries one "
                                   "tensor per forward; stash the other tensor under a name of its own "
                                   "(declared in @skippable(stash=[...]))")
            stashed[name] = tensor

        def handle_pop(name: str) -> Optional[Tensor]:
            if name not in self.poppable_names:
                raise RuntimeError(f"'{name}' has not been declared as poppable by {type(self).__name__}")
            return poppable.pop(name)

        output = self.dispatch(input, handle_stash, handle_pop)

        not_stashed = sorted(self.stashable_names - stashed.keys())
        if not_stashed:
            raise RuntimeError(f"{type(self).__name__} must stash {not_stashed} but did not")
        if poppable:
            raise RuntimeError(f"{type(self).__name__} must pop {sorted(poppable)} but did not")

        batch = Batch(output)
        for ns, name in self.stashable():
            tracker.save(batch, ns, name, stashed[name])
        return batch.tensor_or_tensors


def skippable(stash: Iterable[str] = (), pop: Iterable[str] = ()) -> Callable[[type[nn.Module]], type[Skippable]]:
    """Make a module class with a generator ``forward`` into a :class:`Skippable`.

    Example::

        @skippable(stash=['skip'])
        class Stash(nn.Module):
            def forward(self, x):
                yield stash('skip', x)
                return x

        @skippable(pop=['skip'])
        class Pop(nn.Module):
            def forward(self, x):
                skip = yield pop('skip')
                return x + skip
    """
    stashable_names = frozenset(stash)
    poppable_names = frozenset(pop)

    def extend_skippable(module_cls: type[nn.Module]) -> type[Skippable]:
        attrs = {
            "module_cls": module_cls,
            "stashable_names": stashable_names,
            "poppable_names": poppable_names,
            "__module__": module_cls.__module__,
            "__qualname__": module_cls.__qualname__,
            "__doc__": module_cls.__doc__,
        }
        return type(module_cls.__name__, (Skippable,), attrs)

    return extend_skippable


def verify_skippables(module: nn.Sequential) -> None:
    """Check that every stash has exactly one later pop, raising one ``TypeError`` for all problems.

    The messages are torchgpipe's (each names the layer by its name in ``module``), followed by
    what to do.

    Example::

        verify_skippables(nn.Sequential(StashOnly()))
        # TypeError: one or more pairs of stash and pop do not match:
        #
        # * no module declared 'skip' as poppable but stashed ('0' (StashOnly) stashes it: pop it in a later layer)
    """
    stashed: dict[tuple[Namespace, str], str] = {}
    popped: set[tuple[Namespace, str]] = set()
    problems: list[str] = []

    for layer_name, layer in module.named_children():
        if not isinstance(layer, Skippable):
            continue
        where = f"'{layer_name}' ({type(layer).__name__})"
        for name in sorted(layer.stashable_names & layer.poppable_names):
            problems.append(f"'{layer_name}' declared '{name}' both as stashable and as poppable "
                            "(a layer cannot pop what it stashes: rename one of them)")
        for ns, name in layer.stashable():
            if name in layer.poppable_names:
                continue
            if (ns, name) in stashed:
                problems.append(f"'{layer_name}' redeclared '{name}' as stashable but not isolated by namespace "
                                f"({stashed[(ns, name)]} stashes it already: isolate each stash and its pop "
                                "with layer.isolate(Namespace()))")
                continue
            stashed[(ns, name)] = where
        for ns, name in layer.poppable():
            if name in layer.stashable_names:
                continue
            if (ns, name) in popped:
                problems.append(f"'{layer_name}' redeclared '{name}' as poppable but not isolated by namespace "
                                "(an earlier layer pops it already: isolate each stash and its pop with "
                                "layer.isolate(Namespace()))")
                continue
            if (ns, name) not in stashed:
                problems.append(f"'{layer_name}' declared '{name}' as poppable but it was not stashed "
                                f"({where} pops it: stash it in an earlier layer)")
                continue
            popped.add((ns, name))

    for (ns, name), where in stashed.items():
        if (ns, name) not in popped:
            problems.append(f"no module declared '{name}' as poppable but stashed "
                            f"({where} stashes it: pop it in a later layer)")

    if problems:
        raise TypeError("one or more pairs of stash and pop do not match:\n\n" + "\n".join(f"* {p}" for p in problems))
