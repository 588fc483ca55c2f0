"""Executors: the ways one measured training step of a Plan runs, behind one protocol.

Every executor is a module with ``NAME`` and ``run(job: StepJob) -> RunResult``: it builds the
plan on its devices from a copy of ``job.model``, trains ``job.warmup`` steps, measures the next
ones and returns the measured timeline and loss (:func:`pipexplore.executors.base.result`).
:mod:`pipexplore.executors.step` picks the module; no executor imports it back.

====================  ==========================================================
``threads``           the schedule executor: F/B/I/W per stage in worker threads
``autograd``          the ``GPipe`` module: one ``backward()`` call
``processes``         one process per stage, ``torch.distributed.pipelining``
``backends``          stages served as expert backends (``async-backends``)
====================  ==========================================================

:func:`probe` measures an executor's own cost per action on layers that cost nothing, so that
predictions include it before any run of the user's model.
"""
from __future__ import annotations

from pipexplore.executors.base import RunResult, StepJob, result
from pipexplore.executors.probe import probe

__all__ = ["RunResult", "StepJob", "result", "probe"]
