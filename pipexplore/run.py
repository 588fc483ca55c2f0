"""Moved to :mod:`pipexplore.executors.step`; this path is an alias of it for one release."""
import sys

from pipexplore.executors import step as _moved

sys.modules[__name__] = _moved
