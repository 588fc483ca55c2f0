"""Moved to :mod:`pipexplore.models.flatten`; this path is an alias of it for one release."""
import sys

from pipexplore.models import flatten as _moved

sys.modules[__name__] = _moved
