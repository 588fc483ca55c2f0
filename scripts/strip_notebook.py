"""Keep a notebook small and reviewable: keep the outputs only of cells nbval checks
(``# NBVAL_CHECK_OUTPUT``), and drop saved widget state and execution metadata.

Usage: python scripts/strip_notebook.py notebooks/*.ipynb
"""
from __future__ import annotations

import sys

import nbformat


def strip(path: str) -> None:
    nb = nbformat.read(path, as_version=4)
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        if "NBVAL_CHECK_OUTPUT" not in cell.source:
            cell.outputs = []
            cell.execution_count = None
    nbformat.write(nb, path)


if __name__ == "__main__":
    for notebook in sys.argv[1:]:
        strip(notebook)
