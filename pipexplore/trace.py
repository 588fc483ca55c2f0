"""Moved to :mod:`pipexplore.models.trace`; this path is an alias of it for one release."""
import sys

from pipexplore.models import trace as _moved

sys.modules[__name__] = _moved
