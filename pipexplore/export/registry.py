"""Every kind of export, named once (:data:`KINDS`): what :func:`plan_code`, ``Explorer.export`` and
the page's export menu take, each with its menu label, the title the page shows above it, the suffix
of the file it is saved as, and its writer, ``write(plan, **options) -> str``.

The options (each writer reads those it needs): ``traced`` and ``model_name`` (a model split by
torch's tracer, which GPipe cannot take), ``hooks`` and ``steps`` (the torchrun script), ``tp_plan``
(its tensor parallelism), ``config`` (the model's, for Megatron-LM and torchtitan), ``timeline``
(the Chrome trace's: a run's; the plan's prediction where none is given) and ``report`` (the HTML
report: the page's own, which a plan alone does not have).

Example::

    print(plan_code(plan, "torchrun", hooks="train_hooks"))
    [(kind.name, kind.suffix) for kind in KINDS.values()]     # [('gpipe', '.py'), ...]
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pandas as pd

from pipexplore.export.code import (gpipe_code, megatron_code, pipelining_code, schedule_csv_code, torchrun_code,
                                    torchtitan_code)
from pipexplore.plan import Plan
from pipexplore.timeline import to_chrome_trace

__all__ = ["ExportKind", "KINDS", "export_kind", "plan_code", "chrome_trace_text", "report_text"]


@dataclass(frozen=True)
class ExportKind:
    """One kind of export. ``title`` may name ``{ranks}`` (the ranks the plan runs on) and
    ``{shown}`` (the run whose timeline it is, or the predicted step). ``traced``: whether a model
    split by torch's tracer exports as it (GPipe takes an ``nn.Sequential`` only); ``shown``:
    whether the page shows the text (with a copy button), or writes it to a file."""

    name: str
    label: str
    title: str
    suffix: str
    write: Callable[..., str]
    traced: bool = True
    shown: bool = True


def chrome_trace_text(plan: Plan, *, timeline: Optional[pd.DataFrame] = None, **_: Any) -> str:
    """``timeline`` (the plan's predicted step where None) as Chrome trace JSON (loads in Perfetto)."""
    return json.dumps(to_chrome_trace(timeline if timeline is not None else plan.predicted), indent=1)


def report_text(plan: Plan, *, report: Optional[Callable[[], str]] = None, **_: Any) -> str:
    """The page's HTML report, written by ``report()`` (the explorer's)."""
    if report is None:
        raise ValueError("the HTML report is the explorer's page (its runs, its figures): ex.export('html') or "
                         "ex.to_html(path) writes it")
    return report()


#: Every kind of export, in the page's order.
KINDS: dict[str, ExportKind] = {kind.name: kind for kind in (
    ExportKind("gpipe", "GPipe", "GPipe", ".py", gpipe_code, traced=False),
    ExportKind("pipelining", "torch pipelining", "torch.distributed.pipelining", ".py", pipelining_code),
    ExportKind("torchrun", "torchrun script", "a script for torchrun --standalone --nproc-per-node {ranks}", ".py",
               torchrun_code),
    ExportKind("schedule-csv", "schedule CSV (torch)",
               "the schedule in torch's CSV format: save as .csv, then schedule='that.csv'", ".csv", schedule_csv_code),
    ExportKind("megatron", "Megatron-LM arguments",
               "Megatron-LM's arguments: append them to pretrain_gpt.py's command line", ".txt", megatron_code),
    ExportKind("torchtitan", "torchtitan command",
               "torchtitan's trainer with the plan's mesh and split: run it on each node", ".sh", torchtitan_code),
    ExportKind("chrome-trace", "Chrome trace",
               "Chrome trace of {shown}: save as .json, open in ui.perfetto.dev or chrome://tracing", ".json",
               chrome_trace_text),
    ExportKind("html", "HTML report", "HTML report written (one file, opens with no kernel):", ".html", report_text,
               shown=False),
)}


def export_kind(name: str) -> ExportKind:
    """The kind named ``name``; a ValueError naming every known kind otherwise."""
    if name not in KINDS:
        names = [repr(k) for k in KINDS]
        raise ValueError(f"unknown export kind {name!r}: {', '.join(names[:-1])} or {names[-1]}")
    return KINDS[name]


def plan_code(plan: Plan, kind: str = "gpipe", **options: Any) -> str:
    """``plan`` exported as ``kind`` (one of :data:`KINDS`), with the options its writer reads (the
    module's docstring): the code that reproduces it, its schedule, its trace or its report.

    Raises:
        ValueError: an unknown kind (the known ones named), or one this plan or model cannot export (why).
    """
    return export_kind(kind).write(plan, **options)
