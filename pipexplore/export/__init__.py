"""Code and files out: every kind of export named once (:mod:`pipexplore.export.registry`: a GPipe, a
pipelining split, the torchrun script, the schedule as CSV, Megatron-LM's arguments, torchtitan's
command, a Chrome trace, the HTML report), torchtitan's module FQNs, and a stage's weights from a
checkpoint."""
from pipexplore.export.registry import KINDS, ExportKind, export_kind, plan_code

__all__ = ["KINDS", "ExportKind", "export_kind", "plan_code"]
