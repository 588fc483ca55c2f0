"""Moved to :mod:`pipexplore.predict.costs`; this path is an alias of it for one release."""
import sys

from pipexplore.predict import costs as _moved

sys.modules[__name__] = _moved
