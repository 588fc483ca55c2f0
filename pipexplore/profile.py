"""Moved to :mod:`pipexplore.predict.profiler`; this path is an alias of it for one release."""
import sys

from pipexplore.predict import profiler as _moved

sys.modules[__name__] = _moved
