"""Moved to :mod:`pipexplore.executors._worker`; this path is an alias of it for one release."""
import sys

from pipexplore.executors import _worker as _moved

sys.modules[__name__] = _moved
