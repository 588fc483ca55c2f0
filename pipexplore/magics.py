"""``%load_ext pipexplore`` registers ``%pipexplore``: an explorer from names in the notebook."""
from __future__ import annotations

import argparse
import threading
from typing import Any, Optional

from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from pipexplore.schedules import SCHEDULES, is_csv

__all__ = ["PipexploreMagics", "load_ipython_extension", "unload_ipython_extension"]


def _schedule(value: str) -> str:
    """A schedule name, or the path of a CSV file in torch's format."""
    if value in SCHEDULES or is_csv(value):
        return value
    raise argparse.ArgumentTypeError(f"unknown schedule {value!r}: choose one of {', '.join(SCHEDULES)}, or give "
                                     "the path of a .csv file")


@magics_class
class PipexploreMagics(Magics):
    @magic_arguments()
    @argument("model", help="name of an nn.Sequential in the notebook")
    @argument("sample", help="name of one mini-batch (a tensor or a tuple of tensors)")
    @argument("--target", default=None, help="name of the targets for --loss")
    @argument("--loss", default=None, help="name of a loss_fn(output, target)")
    @argument("--optimizer", default=None, help="name of an optimizer factory: parameters -> Optimizer")
    @argument("--chunks", type=int, default=None,
              help="micro-batches per mini-batch (default 4, or the schedule file's, or fewer for a small batch)")
    @argument("--devices", default=None, help="comma-separated, one per stage, e.g. cuda:0,cuda:1 or cpu,cpu")
    @argument("--checkpoint", default="except_last", choices=["always", "except_last", "never"])
    @argument("--schedule", default="gpipe", type=_schedule, help=f"{', '.join(SCHEDULES)}, or a .csv file")
    @argument("--splits", default=None, help="comma-separated layer indices that begin a stage, e.g. 4,9")
    @line_magic
    def pipexplore(self, line: str) -> Any:
        """Show an explorer for a model: ``%pipexplore model sample --chunks 8 --devices cuda:0,cuda:1``."""
        from pipexplore.widgets.explorer import explore

        args = parse_argstring(self.pipexplore, line)
        namespace = self.shell.user_ns if self.shell is not None else {}

        def lookup(name: Any, what: str) -> Any:
            if name is None:
                return None
            if name not in namespace:
                raise NameError(f"%pipexplore: {what} '{name}' is not defined in the notebook")
            return namespace[name]

        devices = [d.strip() for d in args.devices.split(",") if d.strip()] if args.devices else None
        splits = [int(s) for s in args.splits.split(",") if s.strip()] if args.splits else None
        return explore(lookup(args.model, "model"), lookup(args.sample, "sample"),
                       target=lookup(args.target, "target"), loss_fn=lookup(args.loss, "loss"),
                       optimizer=lookup(args.optimizer, "optimizer"), devices=devices, chunks=args.chunks,
                       checkpoint=args.checkpoint, schedule=args.schedule, splits=splits)


def load_ipython_extension(ipython: Any) -> None:
    ipython.register_magics(PipexploreMagics)
    # The first explorer would pay its modules' first-use costs; pay them now, in the background,
    # while the next cell is written (what a run needs comes once the page has drawn an explorer).
    global warm_up_thread
    if warm_up_thread is None:
        from pipexplore import background

        warm_up_thread = background.start(_warm_up, "pipexplore-warm-up")


#: The thread that pays the explorer's first-use imports, started by the first ``%load_ext``.
warm_up_thread: Optional[threading.Thread] = None


def _warm_up() -> None:
    try:
        from pipexplore.widgets.timeline_figure import warm_up

        warm_up()
    except Exception:  # only a head start: the explorer imports what it needs itself
        pass


def unload_ipython_extension(ipython: Any) -> None:
    manager = ipython.magics_manager
    manager.magics["line"].pop("pipexplore", None)
    manager.registry.pop("PipexploreMagics", None)
