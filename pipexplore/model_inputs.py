"""Moved to :mod:`pipexplore.models.inputs`; this path is an alias of it for one release."""
import sys

from pipexplore.models import inputs as _moved

sys.modules[__name__] = _moved
