"""Moved to :mod:`pipexplore.executors.traced`; this path is an alias of it for one release."""
import sys

from pipexplore.executors import traced as _moved

sys.modules[__name__] = _moved
