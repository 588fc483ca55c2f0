"""Skip trackers: where stashed tensors wait for their pop."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Generator, Optional

from torch import Tensor

from pipexplore.dependency import fork, join
from pipexplore.microbatch import Batch
from pipexplore.checkpoint import is_checkpointing
from pipexplore.skip.namespace import Namespace

if TYPE_CHECKING:
    from pipexplore.skip.layout import SkipLayout
    from pipexplore.skip.portal import Portal
    from pipexplore.stream import AbstractStream

__all__ = ["SkipTracker", "SkipTrackerThroughPortals", "use_skip_tracker", "current_skip_tracker"]


class SkipTracker:
    """Stashed tensors in a dict, passed by reference: right outside a pipeline or within one partition."""

    def __init__(self) -> None:
        self.tensors: dict[tuple[Namespace, str], Optional[Tensor]] = {}

    def save(self, batch: Batch, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None:
        self.tensors[(ns, name)] = tensor

    def load(self, batch: Batch, ns: Namespace, name: str) -> Optional[Tensor]:
        return self.tensors.pop((ns, name))

    def copy(self, batch: Batch, prev_stream: "AbstractStream", next_stream: "AbstractStream",
             ns: Namespace, name: str) -> None:
        raise TypeError("copy is not supported for non-portal skip tensors")


class SkipTrackerThroughPortals(SkipTracker):
    """The tracker of one micro-batch inside a pipeline.

    A skip tensor that crosses partitions enters a :class:`~pipexplore.skip.portal.Portal`: it
    is hidden from autograd, copied to the pop partition's device, and freed after its last
    use. Its gradient travels back through the same portal. Routes within one partition use
    the plain dict (no copy, ordinary autograd).
    """

    def __init__(self, skip_layout: "SkipLayout") -> None:
        super().__init__()
        self.skip_layout = skip_layout
        self.portals: dict[tuple[Namespace, str], "Portal"] = {}

    def save(self, batch: Batch, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None:
        from pipexplore.skip.portal import Portal

        if not self.skip_layout.requires_copy(ns, name):
            super().save(batch, ns, name, tensor)
            return
        # Tensor life: how many more uses the portal keeps the tensor for.
        #   forward:     PortalBlue (stash)  →  PortalOrange (pop)            = 2
        #   checkpointed: + PortalOrange again when the pop partition recomputes = 3
        #   recompute of the stash partition stashes anew: PortalBlue only      = 1
        if (ns, name) not in self.portals:
            portal = Portal(tensor, tensor_life=3 if is_checkpointing() else 2)
            self.portals[(ns, name)] = portal
        else:
            portal = self.portals[(ns, name)]
            portal.put_tensor(tensor, tensor_life=1)
        phony = portal.blue()
        batch[0] = join(batch[0], phony)

    def load(self, batch: Batch, ns: Namespace, name: str) -> Optional[Tensor]:
        if not self.skip_layout.requires_copy(ns, name):
            return super().load(batch, ns, name)
        portal = self.portals[(ns, name)]
        batch[0], phony = fork(batch[0])
        return portal.orange(phony)

    def copy(self, batch: Batch, prev_stream: "AbstractStream", next_stream: "AbstractStream",
             ns: Namespace, name: str) -> None:
        """Copy the portal's tensor to ``next_stream``'s device, ordered with ``batch``."""
        assert self.skip_layout.requires_copy(ns, name)
        batch[0], phony = fork(batch[0])
        phony = self.portals[(ns, name)].copy(prev_stream, next_stream, phony)
        batch[0] = join(batch[0], phony)


class _ThreadLocal(threading.local):
    def __init__(self) -> None:
        self.skip_tracker: Optional[SkipTracker] = None


_local = _ThreadLocal()


@contextmanager
def use_skip_tracker(skip_tracker: SkipTracker) -> Generator[None, None, None]:
    """Make ``skip_tracker`` current in this thread for the block."""
    previous = _local.skip_tracker
    _local.skip_tracker = skip_tracker
    try:
        yield
    finally:
        _local.skip_tracker = previous


def current_skip_tracker() -> SkipTracker:
    """This thread's skip tracker (a plain :class:`SkipTracker` outside any pipeline)."""
    tracker = _local.skip_tracker
    if tracker is None:
        tracker = SkipTracker()
        _local.skip_tracker = tracker
    return tracker
