"""The Explorer: one Plan, its prediction, real runs, and export, in one widget.

An :class:`~pipexplore.widgets.state.ExplorerState` (model, layer table, plan, runs, status: every
behaviour, no widget library; its methods defined there, once) with its page,
:class:`~pipexplore.widgets.view.ExplorerView` (built once from the state and redrawn on its
changes). It holds no pipeline logic of its own: profiles come from
:func:`pipexplore.profile`, splits are checked by :class:`~pipexplore.plan.Plan`, predictions come
from :func:`pipexplore.simulate` and runs from :func:`pipexplore.executors.step.run_step`.
"""
from __future__ import annotations

from typing import Any, Optional

import pandas as pd
from torch import nn

from pipexplore.samples import Sample, batch_size
from pipexplore.widgets.options import ExploreOptions
from pipexplore.widgets.run_log import RUN_COLUMNS
from pipexplore.widgets.state import UPDATABLE, ExplorerState
from pipexplore.widgets.view import ExplorerView

__all__ = ["Explorer", "explore", "RUN_COLUMNS", "UPDATABLE"]

#: What :meth:`Explorer.to_plotly` draws.
PLOTLY_KINDS = ("timelines", "memory", "residuals")

#: Which panel of the view holds each widget the explorer exposes (``explorer.w_run``, ``explorer.bar``, …).
PANEL_OF = {
    **dict.fromkeys(("w_header", "w_status", "w_progress"), "status"),
    **dict.fromkeys(("w_stage_count", "w_chunks", "w_checkpoint", "w_schedule", "w_executor", "w_devices", "w_run",
                     "w_run_on"), "controls"),
    **dict.fromkeys(("bar", "w_view", "w_balance_time", "w_balance_size", "w_stages"), "stages"),
    **dict.fromkeys(("timelines", "figure", "w_mode", "w_memory_cap", "w_timeline_box", "w_residuals",
                     "residual_figure", "schedule_grid", "w_schedule_grid"), "timelines"),
    **dict.fromkeys(("w_runs", "w_show_run", "w_restore", "w_compare", "w_sort", "w_compare_box"), "runs"),
    **dict.fromkeys(("w_export_kind", "w_export", "w_code"), "export"),
    "w_errors": "fields",  # the messages beside the fields, by field name
}


class Explorer(ExplorerState):
    """See and tune the pipeline split of an ``nn.Sequential`` (or, traced, of any model).

    An :class:`~pipexplore.widgets.state.ExplorerState` with its page: every method and property
    of the state is the explorer's own (defined once, there; :meth:`run`, :meth:`update`,
    :meth:`search`, …), and this class adds what needs the page (:meth:`to_html`,
    :meth:`to_plotly`, :meth:`close`, the report among the :meth:`export` kinds). It takes what
    the state takes, the options of :class:`~pipexplore.widgets.options.ExploreOptions`: every one
    is checked on entry (a ``ValueError``/``TypeError`` naming it); ``chunks`` (default 4, fewer
    for a smaller batch) must split the sample into exactly that many micro-batches. The explorer
    keeps a summary row for every run (:attr:`runs`) and the full timelines of the last
    ``keep_timelines`` (20); :meth:`clear_runs` forgets them and :meth:`cancel` stops a background
    run. A run whose loss or gradients are not finite is marked (``finite`` column) and does not
    calibrate predictions. With ``calibrate`` (the default) each run teaches the predictions the
    executor's own cost per action.

    ``explorer.view`` is the page; the widgets are also reachable here by name
    (``explorer.w_run``, ``explorer.bar``, ``explorer.figure``, …).

    Example::

        explorer = pipexplore.explore(model, sample, chunks=8)
        explorer.splits = [4, 9]            # or drag the handles
        explorer.run()                      # a real step; a row in explorer.runs
        print(explorer.export("gpipe"))
    """

    #: The page, subscribed to the state.
    view: ExplorerView
    #: The page's root widget.
    widget: Any

    def __init__(self, model: nn.Module, sample: Sample, options: Optional[ExploreOptions] = None,
                 **keywords: Any) -> None:
        super().__init__(model, sample, options, **keywords)
        self.view = ExplorerView(self)
        self.widget = self.view.widget

    def __getattr__(self, name: str) -> Any:
        view = self.__dict__.get("view")
        if view is None or name not in PANEL_OF:
            raise AttributeError(f"'Explorer' object has no attribute {name!r}")
        panel = getattr(view, PANEL_OF[name])
        return panel.boxes if name == "w_errors" else getattr(panel, name)

    @property
    def state(self) -> ExplorerState:
        """The model of it all, without the page: the explorer itself, an :class:`ExplorerState`."""
        return self

    # ---- export ---------------------------------------------------------------------------
    def export(self, kind: str = "gpipe", *, hooks: str = "train_hooks", steps: int = 1, **options: Any) -> str:
        """The current split exported as ``kind``, one of :data:`pipexplore.export.registry.KINDS` (the
        page's export menu): code that reproduces it (``'gpipe'``, ``'pipelining'``, ``'torchrun'``: a
        script importing ``build_model``, ``get_batch`` and ``loss_fn`` from the ``hooks`` module, running
        ``steps`` steps), ``'schedule-csv'`` (the plan's schedule in torch's CSV format:
        ``schedule="that.csv"`` reads it), ``'megatron'``, ``'torchtitan'``, ``'chrome-trace'`` (the shown
        run, or the predicted step) or ``'html'`` (the page's report, as :meth:`to_html` writes it).
        ``options``: more of :func:`pipexplore.export.registry.plan_code`'s.

        Raises:
            ValueError: an unknown kind (the known ones named), or one this plan or model cannot export.
        """
        view = self.__dict__.get("view")
        if view is not None:
            options.setdefault("report", view.report_html)
        return super().export(kind, hooks=hooks, steps=steps, **options)

    def static_html(self) -> str:
        """The explorer as static HTML (no JavaScript): what a notebook keeps for viewers without a kernel."""
        return self.view.static_html()

    def to_html(self, path: Any = "pipexplore-report.html") -> Any:
        """Write one self-contained HTML page of the explorer (opens with no kernel and no
        network); returns its path.

        Example::

            explorer.to_html("report.html")
        """
        return self.view.write_report(path)

    def to_plotly(self, what: str = "timelines") -> Any:
        """A plotly ``Figure`` of what the page draws, for a notebook or dashboard of your own
        (:mod:`pipexplore.widgets.figures`): ``'timelines'``, the current plan's prediction above the
        latest run's measured step (before a run: the prediction only); ``'memory'``, the activation
        memory each stage holds (with the latest run's where it measured it, and the memory cap);
        ``'residuals'``, each action of the latest run against its prediction (a ``ValueError``
        before a run). Needs plotly (``pip install 'pipexplore[plotly]'``): an ``ImportError`` says so.

        Example::

            explorer.to_plotly("memory").show()
        """
        if what not in PLOTLY_KINDS:
            raise ValueError(f"to_plotly draws 'timelines', 'memory' or 'residuals', not {what!r}")
        from pipexplore.widgets import figures

        figures.require_plotly()
        predicted = self.timeline("predicted")
        measured: Optional[pd.DataFrame] = None
        missing = ""
        try:
            measured = self.timeline("measured")
        except LookupError as exc:  # no run yet, or no timeline kept
            missing = str(exc)
        run = f"run {measured['run'].iloc[0]}" if measured is not None and len(measured) else "run"
        if what == "timelines":
            return figures.timelines_figure(predicted, measured, samples=batch_size(self.sample),
                                            names=("predicted", f"measured, {run}"))
        if what == "memory":
            return figures.memory_figure(predicted, measured, cap=self.memory_cap)
        if measured is None:
            raise ValueError(f"to_plotly('residuals') compares a run with its prediction: {missing}")
        return figures.residuals_figure(self.residuals(), title=run)

    def close(self) -> None:
        """Stop a background run (:meth:`cancel`) and close the page's widgets. ipywidgets keeps
        every widget until it is closed, and the page's widgets hold the explorer's state: without
        this an explorer a notebook no longer uses (a cell run again) keeps its model, layer table
        and runs in memory for the kernel's life. The page goes blank; :attr:`runs` stays readable.

        Example::

            explorer.close()
            explorer = pipexplore.explore(bigger_model, sample)
        """
        self.runner.cancel()
        self.view.close()

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        bundle = self.widget._repr_mimebundle_(**kwargs)
        if isinstance(bundle, dict):
            # A static view beside the live one: a reload without the kernel, nbviewer or GitHub show it.
            bundle["text/html"] = self.static_html()
        return bundle


def explore(model: nn.Module, sample: Sample, options: Optional[ExploreOptions] = None,
            **keywords: Any) -> Explorer:
    """Build an :class:`Explorer` for ``model`` on ``sample`` (one mini-batch); display it by returning it.

    Takes the options of :class:`~pipexplore.widgets.options.ExploreOptions`, as keywords
    (``target``, ``loss_fn``, ``optimizer``, ``devices``, ``chunks``, ``checkpoint``, ``schedule``,
    ``splits``, ``executor``, ``calibrate``, ``layer_table``, ``memory_cap``, ``keep_timelines``,
    ``mesh``, ``data_parallel``, …) or as one value (``options``, the keywords over it).

    Example::

        explorer = pipexplore.explore(model, sample, chunks=8, schedule="1f1b")
    """
    return Explorer(model, sample, options, **keywords)
