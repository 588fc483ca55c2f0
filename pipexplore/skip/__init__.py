"""Skip connections across partitions: ``@skippable``, ``stash``, ``pop``, namespaces and layouts."""
from pipexplore.skip.layout import SkipLayout, inspect_skip_layout
from pipexplore.skip.namespace import Namespace
from pipexplore.skip.skippable import Skippable, pop, skippable, stash, verify_skippables

__all__ = ["skippable", "stash", "pop", "verify_skippables", "Skippable", "Namespace",
           "SkipLayout", "inspect_skip_layout"]
