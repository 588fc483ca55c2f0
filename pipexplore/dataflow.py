"""Moved to :mod:`pipexplore.predict.dataflow`; this path is an alias of it for one release."""
import sys

from pipexplore.predict import dataflow as _moved

sys.modules[__name__] = _moved
