"""Moved to :mod:`pipexplore.predict.residuals`; this path is an alias of it for one release."""
import sys

from pipexplore.predict import residuals as _moved

sys.modules[__name__] = _moved
