"""Moved: tracing to :mod:`pipexplore.models.trace`, the torchrun script to
:mod:`pipexplore.export.torchrun`. This path re-exports both for one release."""
from typing import Any

from pipexplore.export.torchrun import module_fqns_per_model_part, torchrun_script  # noqa: F401
from pipexplore.models import trace as _moved
from pipexplore.models.trace import *  # noqa: F401,F403


def __getattr__(name: str) -> Any:  # the moved module's other names, private ones too
    return getattr(_moved, name)
