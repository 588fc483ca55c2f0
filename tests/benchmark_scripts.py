"""The scripts of ``benchmarks/`` imported as modules, for the tests that check what they plan."""
from __future__ import annotations

import importlib
import pathlib
import sys
from types import ModuleType

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` imported (its folder on the path only while it imports)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
