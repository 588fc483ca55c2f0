"""Moved to :mod:`pipexplore.executors.distributed`; this path is an alias of it for one release."""
import sys

from pipexplore.executors import distributed as _moved

sys.modules[__name__] = _moved
