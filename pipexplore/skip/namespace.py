"""Namespaces that let the same skip name be reused by different layers."""
from __future__ import annotations

import abc
import uuid
from typing import Any

__all__ = ["Namespace"]


class Namespace(metaclass=abc.ABCMeta):
    """A namespace for skip names: ``layer.isolate(Namespace())`` keeps its names apart.

    Example::

        ns1, ns2 = Namespace(), Namespace()
        model = nn.Sequential(
            StashX().isolate(ns1), PopX().isolate(ns1),
            StashX().isolate(ns2), PopX().isolate(ns2),
        )
    """

    __slots__ = ("id",)

    def __init__(self) -> None:
        self.id = uuid.uuid4()

    def __repr__(self) -> str:
        return f"<Namespace '{self.id}'>"

    def __hash__(self) -> int:
        return hash(self.id)

    def __lt__(self, other: Any) -> bool:
        if isinstance(other, Namespace):
            return self.id < other.id
        return False

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, Namespace):
            return self.id == other.id
        return False


# The default namespace of every skip name is ``None``.
Namespace.register(type(None))
