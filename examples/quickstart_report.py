"""Write the quickstart's explorer as one self-contained HTML page (what ``make demo`` opens first).

The same model, sample and plan as ``notebooks/01_quickstart.ipynb``: a split, one real step of it
on CPU devices, then ``Explorer.to_html``. The page opens in any browser, with no kernel.

Usage::

    python examples/quickstart_report.py build/quickstart.html
"""
from __future__ import annotations

import argparse
import pathlib

import torch
from torch import nn

import pipexplore


def quickstart_explorer() -> pipexplore.widgets.Explorer:
    """The quickstart notebook's explorer: 8 layers of Linear(256) + GELU, 2 CPU stages, 4 chunks.

    Example::

        explorer = quickstart_explorer()
    """
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(8)])
    sample = torch.randn(128, 256)
    return pipexplore.explore(model, sample, devices=["cpu", "cpu"], chunks=4, splits=[4])


def main(argv: list[str] | None = None) -> pathlib.Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", default="build/quickstart.html", help="where to write the page")
    path = pathlib.Path(parser.parse_args(argv).path)
    path.parent.mkdir(parents=True, exist_ok=True)
    explorer = quickstart_explorer()
    explorer.run()
    written = explorer.to_html(path)
    print(f"report: {written.resolve()} ({written.stat().st_size / 1e6:.1f} MB, opens with no kernel)")
    return written


if __name__ == "__main__":
    main()
