"""Moved to :mod:`pipexplore.predict.retime`; this path is an alias of it for one release."""
import sys

from pipexplore.predict import retime as _moved

sys.modules[__name__] = _moved
