"""Moved to :mod:`pipexplore.executors.pool`; this path is an alias of it for one release."""
import sys

from pipexplore.executors import pool as _moved

sys.modules[__name__] = _moved
