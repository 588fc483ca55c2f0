"""Moved to :mod:`pipexplore.executors.sequential`; this path is an alias of it for one release."""
import sys

from pipexplore.executors import sequential as _moved

sys.modules[__name__] = _moved
