"""Moved to :mod:`pipexplore.predict.simulator`; this path is an alias of it for one release."""
import sys

from pipexplore.predict import simulator as _moved

sys.modules[__name__] = _moved
