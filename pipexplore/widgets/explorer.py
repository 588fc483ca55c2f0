"""The Explorer: one Plan, its prediction, real runs, and export, in one widget.

A facade over two parts: :class:`~pipexplore.widgets.state.ExplorerState` (model, layer table,
plan, runs, status: every behaviour, no widget library) and
:class:`~pipexplore.widgets.view.ExplorerView` (the page, built once from the state and redrawn
on its changes). It holds no pipeline logic of its own: profiles come from
:func:`pipexplore.profile`, splits are checked by :class:`~pipexplore.plan.Plan`, predictions come
from :func:`pipexplore.simulate` and runs from :func:`pipexplore.executors.step.run_step`.
"""
from __future__ import annotations

import threading
from typing import Any, Optional, Sequence

import pandas as pd
from torch import nn

from pipexplore.microbatch import Sample, batch_size
from pipexplore.plan import Plan
from pipexplore.widgets import what_if
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


class Explorer:
    """See and tune the pipeline split of an ``nn.Sequential`` (or, traced, of any model).

    Takes what :class:`~pipexplore.widgets.state.ExplorerState` takes: every argument is checked
    on entry (a ``ValueError``/``TypeError`` naming it); ``chunks`` (default 4, fewer for a
    smaller batch) must split the sample into exactly that many micro-batches. The explorer keeps a
    summary row for every run (:attr:`runs`) and the full timelines of the last ``keep_timelines``
    (20); :meth:`clear_runs` forgets them and :meth:`cancel` stops a background run. A run whose
    loss or gradients are not finite is marked (``finite`` column) and does not calibrate
    predictions. With ``calibrate`` (the default) each run teaches the predictions the executor's
    own cost per action.

    ``explorer.state`` is the model of it all, ``explorer.view`` the page; the widgets are also
    reachable here by name (``explorer.w_run``, ``explorer.bar``, ``explorer.figure``, …).

    Example::

        explorer = pipexplore.explore(model, sample, chunks=8)
        explorer.splits = [4, 9]            # or drag the handles
        explorer.run()                      # a real step; a row in explorer.runs
        print(explorer.export("gpipe"))
    """

    #: Model, layer table, plan, runs and status (no widgets).
    state: ExplorerState
    #: The page, subscribed to the state.
    view: ExplorerView
    #: The page's root widget.
    widget: Any

    def __init__(self, model: nn.Module, sample: Sample, **options: Any) -> None:
        self.state = ExplorerState(model, sample, **options)
        self.view = ExplorerView(self.state)
        self.widget = self.view.widget

    def __getattr__(self, name: str) -> Any:
        view = self.__dict__.get("view")
        if view is None or name not in PANEL_OF:
            raise AttributeError(f"'Explorer' object has no attribute {name!r}")
        panel = getattr(view, PANEL_OF[name])
        return panel.boxes if name == "w_errors" else getattr(panel, name)

    # ---- what it was made of --------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        return self.state.model

    @property
    def sample(self) -> Sample:
        return self.state.sample

    @property
    def traced(self) -> bool:
        """Whether the model is split by torch's tracer (not an ``nn.Sequential``)."""
        return self.state.traced

    @property
    def layer_table(self) -> pd.DataFrame:
        """One row per layer (or traced candidate): names, costs, sizes."""
        return self.state.layer_table

    @property
    def notes(self) -> list[str]:
        """What the page says above its status line (synthetic loss, CPU devices, traced model)."""
        return self.state.notes

    @property
    def last_error(self) -> str:
        """The last error the page showed ('' after a change that worked)."""
        return self.state.last_error

    @property
    def calibrate(self) -> bool:
        return self.state.calibrate

    @property
    def keep_timelines(self) -> int:
        return self.state.log.keep_timelines

    # ---- the plan -------------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        """The current plan (immutable; every change makes a new one)."""
        return self.state.plan

    @property
    def splits(self) -> list[int]:
        """The current split points (the index of each stage's first layer after the first)."""
        return list(self.state.plan.splits)

    @splits.setter
    def splits(self, value: Sequence[int]) -> None:
        self.state.update(splits=value)

    def update(self, **changes: Any) -> Plan:
        """Change ``chunks``, ``checkpoint``, ``schedule``, ``executor``, ``devices``, ``splits``,
        ``virtual_stages`` or ``memory_cap``; checked first. A bad value raises a
        ``ValueError``/``TypeError`` naming it and the plan stays as it was. ``devices`` is a list
        or a comma-separated string. A change made while a run is in progress stays.

        Example::

            explorer.update(chunks=8, schedule="1f1b")
        """
        return self.state.update(**changes)

    def balance(self, by: str = "time") -> list[int]:
        """Set the splits that minimise the most expensive stage (``by`` ``'time'`` or ``'size'``) among
        those the plan's executor can run (:func:`pipexplore.splits.first_runnable_layer`)."""
        return self.state.balance(by)

    def reprofile(self) -> pd.DataFrame:
        """Time every layer again for the current plan (its micro-batch size and the intra-op
        threads its CPU stages run with); what runs taught is dropped. Returns the new table.

        Example::

            explorer.update(devices="cpu,cpu,cpu,cpu")   # 4 CPU stages: fewer threads each
            explorer.reprofile()
        """
        return self.state.reprofile()

    @property
    def memory_cap(self) -> Optional[float]:
        """Bytes of activation memory a stage may hold (drawn on the memory panel; stages over it
        are flagged), or None. Set it as bytes or text (``"2 GiB"``)."""
        return self.state.memory_cap

    @memory_cap.setter
    def memory_cap(self, value: Any) -> None:
        self.state.memory_cap = value

    def set_mesh(self, mesh: Any, **options: Any) -> Plan:
        """Plan the pipeline inside the mesh ``mesh`` (``{"tp": 4, "pp": 8, "dp": 2}`` over the plan's
        devices) with ``options`` (``data_parallel``, ``sequence_parallel``, ``reshard_after_forward``):
        each rank's layers counted for its ``tp``, the ``pp`` stages balanced by time. A wrong mesh
        raises a ``ValueError`` naming what was wrong, and the plan stays as it was.

        Example::

            explorer.set_mesh({"tp": 4, "pp": 8, "dp": 2}, data_parallel="fsdp")
        """
        return self.state.set_mesh(mesh, **options)

    @property
    def mesh(self) -> Any:
        """The plan's mesh (None: every device is a pipeline rank)."""
        return self.state.mesh

    def stage_table(self) -> pd.DataFrame:
        """Per stage: device, layers, time, parameters, activations, predicted peak activation
        memory, and the measured peak of its device in the shown run."""
        return self.state.stage_table()

    def shared_parameters(self) -> dict[str, list[int]]:
        """Parameters used by blocks of more than one stage (tied weights), with those stages."""
        return self.state.shared_parameters()

    # ---- runs -----------------------------------------------------------------------------
    def run(self, executor: Optional[str] = None, *, timeout: Optional[float] = None, nodes: int = 1) -> pd.Series:
        """Run a real training step of the current plan (blocking) and add it to :attr:`runs`;
        returns its row. ``executor``: ``'threads'``, ``'autograd'`` or ``'processes'`` (it becomes
        the plan's), or ``'torchrun'``: the exported script under ``nodes`` torchrun node agents
        here, its recording loaded back (as :meth:`load_run`); ``timeout`` bounds a ``'processes'``
        or ``'torchrun'`` run. Errors propagate; the plan and earlier runs are kept."""
        return self.state.runner.run(executor, timeout=timeout, nodes=nodes)

    def load_run(self, directory: Any) -> pd.Series:
        """Add a run the exported script recorded (``--record DIR``, on any cluster) to :attr:`runs`."""
        return self.state.runner.load_run(directory)

    def run_async(self, executor: Optional[str] = None, **options: Any) -> threading.Thread:
        """Start :meth:`run` in a background thread (what the button does); returns the thread."""
        return self.state.runner.run_async(executor, **options)

    def cancel(self, timeout: float = 60.0) -> bool:
        """Stop the background run: nothing of it is recorded, the plan and earlier runs are kept.
        Returns whether a run was in progress (and has ended within ``timeout`` seconds).

        Example::

            explorer.run_async()
            explorer.cancel()          # True; explorer.runs as before
        """
        return self.state.runner.cancel(timeout)

    @property
    def runs(self) -> pd.DataFrame:
        """One row per run: the plan, what was measured, the prediction's error, the loss at the
        plan's weights, and whether the loss and gradients were ``finite``."""
        return self.state.runs

    def clear_runs(self) -> None:
        """Forget every run (rows and timelines); the plan and what calibration taught it stay."""
        self.state.clear_runs()

    def timeline(self, kind: str = "predicted", run: Optional[int] = None) -> pd.DataFrame:
        """``'predicted'``: the current plan's; ``'measured'``: the latest run's, or run ``run``'s
        while it is among the last ``keep_timelines`` runs.

        Raises:
            ValueError: another ``kind``.
            LookupError: no run yet, or that run's timeline is no longer kept.
        """
        if kind == "predicted":
            return self.state.plan.predicted
        if kind != "measured":
            raise ValueError(f"timeline kind is 'predicted' or 'measured', not {kind!r}")
        return self.state.log.measured_timeline(run)

    def restore(self, run: int) -> Plan:
        """Make the plan of run ``run`` (its number in :attr:`runs`) the current plan again.

        Example::

            explorer.restore(2)
        """
        return self.state.restore(run)

    def residuals(self, run: int = -1) -> pd.DataFrame:
        """Each action of a run (default: the latest) against its prediction."""
        return self.state.log.residuals(run)

    def sweep(self, *, stages: Sequence[int] = (), chunks: Sequence[int] = (), schedules: Sequence[str] = (),
              checkpoint: Sequence[str] = (), measure: int = 0) -> pd.DataFrame:
        """Predict every combination (each with its balanced split), ranked by predicted step time;
        with ``measure=k`` the top ``k`` rows are also run. Apply a row with :meth:`apply`.

        Example::

            table = explorer.sweep(stages=[2, 3, 4], chunks=[4, 8], schedules=["gpipe", "1f1b"], measure=3)
            explorer.apply(table.iloc[0])
        """
        return what_if.sweep(self.state, stages=stages, chunks=chunks, schedules=schedules, checkpoint=checkpoint,
                                measure=measure)

    def search(self, *, memory_cap: Any = None, stages: Sequence[int] = (), chunks: Sequence[int] = (),
               schedules: Sequence[str] = (), checkpoint: Sequence[str] = (), virtual_stages: Sequence[int] = (),
               workers: Optional[int] = None, mesh: Optional[str] = None, data_parallel: Sequence[str] = (),
               microbatch_rows: Sequence[int] = (), cp: Sequence[int] = (), ep: Sequence[int] = (),
               etp: Sequence[int] = ()) -> pd.DataFrame:
        """Every combination, each with the fastest split whose every device holds it within
        ``memory_cap`` (bytes or ``'80 GiB'``: parameters, gradients, optimizer state and the
        activations its schedule holds; None: each device's memory), predicted; the plans that
        fit first, by predicted step, with ``predicted_step_time``, ``peak_bytes``, ``fits`` and
        ``pareto``. Nothing fits: a ``ValueError`` naming the closest plan and how far over it is.
        Apply a row with :meth:`apply`. ``mesh="auto"`` (devices from the catalogue): every mesh of
        the devices (tp × pp × dp, × ``cp`` where asked, with each of ``data_parallel`` and ``microbatch_rows``;
        a mixture of experts folded every way, or at the ``ep`` and ``etp`` asked for), the global batch
        kept, with ``tp``, ``pp``, ``dp``, ``cp``, ``ep``, ``etp`` and ``notes`` columns.

        Example::

            table = explorer.search(memory_cap="80 GiB", stages=[4, 8], chunks=[8, 16],
                                    schedules=["gpipe", "1f1b"], checkpoint=["never", "always"])
            explorer.apply(table.iloc[0])
            meshes = explorer.search(mesh="auto", data_parallel=["zero1", "fsdp"], checkpoint=["always"])
        """
        return what_if.search(self.state, memory_cap=memory_cap, stages=stages, chunks=chunks, schedules=schedules,
                              checkpoint=checkpoint, virtual_stages=virtual_stages, workers=workers, mesh=mesh,
                              data_parallel=data_parallel, microbatch_rows=microbatch_rows, cp=cp, ep=ep, etp=etp)

    def apply(self, row: Any) -> Plan:
        """Make a row of :meth:`sweep` or :meth:`search` the current plan, or a mapping of some of
        their plan columns (the others kept): ``ex.apply({"splits": [2, 4]})``."""
        return what_if.apply(self.state, row)

    # ---- export ---------------------------------------------------------------------------
    def export(self, kind: str = "gpipe", *, hooks: str = "train_hooks", steps: int = 1) -> str:
        """The current split exported as ``kind``, one of :data:`pipexplore.export.registry.KINDS` (the
        page's export menu): code that reproduces it (``'gpipe'``, ``'pipelining'``, ``'torchrun'``: a
        script importing ``build_model``, ``get_batch`` and ``loss_fn`` from the ``hooks`` module, running
        ``steps`` steps), ``'schedule-csv'`` (the plan's schedule in torch's CSV format:
        ``schedule="that.csv"`` reads it), ``'megatron'``, ``'torchtitan'``, ``'chrome-trace'`` (the shown
        run, or the predicted step) or ``'html'`` (the page's report, as :meth:`to_html` writes it).

        Raises:
            ValueError: an unknown kind (the known ones named), or one this plan or model cannot export.
        """
        return self.state.export(kind, hooks=hooks, steps=steps, report=self.view.report_html)

    @property
    def module_fqns_per_model_part(self) -> list[list[str]]:
        """The current split as torchtitan's ``module_fqns_per_model_part``."""
        return self.state.module_fqns_per_model_part

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
        self.state.runner.cancel()
        self.view.close()

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        bundle = self.widget._repr_mimebundle_(**kwargs)
        if isinstance(bundle, dict):
            # A static view beside the live one: a reload without the kernel, nbviewer or GitHub show it.
            bundle["text/html"] = self.static_html()
        return bundle


def explore(model: nn.Module, sample: Sample, **options: Any) -> Explorer:
    """Build an :class:`Explorer` for ``model`` on ``sample`` (one mini-batch); display it by returning it.

    Takes every option :class:`~pipexplore.widgets.state.ExplorerState` takes (``target``,
    ``loss_fn``, ``optimizer``, ``devices``, ``chunks``, ``checkpoint``, ``schedule``, ``splits``,
    ``executor``, ``calibrate``, ``layer_table``, ``memory_cap``, ``keep_timelines``, …).

    Example::

        explorer = pipexplore.explore(model, sample, chunks=8, schedule="1f1b")
    """
    return Explorer(model, sample, **options)
