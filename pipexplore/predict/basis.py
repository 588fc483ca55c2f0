"""What a prediction rests on, and how far the benchmarks found that kind of prediction from runs.

Every predicted step time rests on one of three kinds of evidence:

==================  ========================================================================
``measured here``   layers timed on this machine and the executor's own costs probed, no run yet
``learnt from runs`` the same, corrected by the runs of this plan's executor (or, for catalogue
                    devices, by runs of that kind brought back from a cluster)
``catalogue``       devices of the catalogue: counted operators costed from datasheet figures
                    and documented efficiencies, nothing measured on such a device
``catalogue, learnt from runs``  the same, corrected by runs on devices of that kind brought back
==================  ========================================================================

:data:`MEASURED_ERROR` holds, for each, what the benchmarks measured of that kind of prediction
(median and largest absolute error, and where: the script and its column), so that a number on
the page says how sure it is; :data:`TORCHRUN_HERE_ERROR` the same for the exported script's ranks
run here (a mesh's, or a pipeline's under node agents), and :data:`EXPERTS_ERROR` the catalogue's
for a mixture of experts, each of which its own benchmark measures. The figures are the
benchmarks' (``benchmarks/README.md``), written here when the benchmark is run again.

Example::

    basis = prediction_basis(explorer.plan)
    basis.kind                 # 'measured here'
    basis.text()               # 'measured here · benchmarks: median 5 %, max 46 % (prediction_accuracy.py, first run)'
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping, Optional

if TYPE_CHECKING:  # the plan imports the predictions; this module is read by its users
    from pipexplore.plan import Plan

__all__ = ["Basis", "BASES", "MEASURED_ERROR", "TORCHRUN_HERE_ERROR", "EXPERTS_ERROR", "prediction_basis"]

#: The kinds of evidence, in the order of how much of the prediction was measured.
BASES = ("learnt from runs", "measured here", "catalogue, learnt from runs", "catalogue")


@dataclass(frozen=True)
class Basis:
    """A prediction's ``kind`` of evidence (one of :data:`BASES`) with the benchmarks' ``median``
    and ``largest`` absolute error for that kind (fractions) and ``source``, where they were measured."""

    kind: str
    median: Optional[float]
    largest: Optional[float]
    source: str

    def text(self) -> str:
        """One line for the page: the kind, then the benchmarks' errors and where they come from."""
        if self.median is None or self.largest is None:
            return f"{self.kind} · {self.source}"
        return (f"{self.kind} · benchmarks: median {self.median * 100:.0f} %, max {self.largest * 100:.0f} % "
                f"({self.source})")


#: What the benchmarks measured, per kind of evidence: ``(median, largest, source)``. The CPU
#: figures are ``benchmarks/prediction_accuracy.py``'s on a 2-core x86_64 machine (its columns
#: "first run" and "same plan again": the median of the runs' medians and of their maxima, runs
#: T–W for the first run, U and V for the same plan again, which learnt as the code now does);
#: the catalogue's are the published runs planned from documented defaults
#: (``benchmarks/mesh_published.py``: Narayanan et al. 2021, Table 1).
MEASURED_ERROR: Mapping[str, tuple[Optional[float], Optional[float], str]] = MappingProxyType({
    "measured here": (0.046, 0.462, "prediction_accuracy.py, first run"),
    "learnt from runs": (0.045, 0.368, "prediction_accuracy.py, same plan again"),
    "catalogue": (0.058, 0.094, "mesh_published.py, Narayanan et al. Table 1"),
    "catalogue, learnt from runs": (None, None, "no benchmark has measured runs brought back from a cluster yet"),
})

#: The catalogue's figures for a mixture of experts (a layer table that counts routed experts), which
#: Narayanan's dense GPTs do not measure: ``benchmarks/megatron_bridge_moe.py``, Megatron-Bridge's
#: published DGX-H100 rows (GPT-OSS 120B, Qwen3-30B-A3B, Qwen3-235B-A22B) planned from the models'
#: configs and the recipes' documented defaults (tokens/s/GPU: +13.1, +13.6, +12.1 %; 2026-12-06).
EXPERTS_ERROR: tuple[Optional[float], Optional[float], str] = (
    0.131, 0.136, "megatron_bridge_moe.py, Megatron-Bridge's MoE rows")


#: The same two kinds for the exported script's ranks run here (a mesh's: tensor, data or expert
#: parallelism beside the pipeline, forked with torchrun's environment; or a pipeline under node
#: agents, ``run(executor="torchrun")``), processes that share this machine's cores and talk over
#: gloo, which ``prediction_accuracy.py`` does not run: ``benchmarks/mesh_here.py``'s six runs (a
#: Llama-shaped model at pp 2 × dp 2 as DDP, ZeRO-1 and FSDP2, and at pp 2 × tp 2; notebook 07's
#: small FSDP2 mesh and its pipeline under two node agents, where the ranks' own costs weigh), their
#: first runs, and the two runs held against what the first taught: the medians of two runs'
#: medians and maxima (2026-12-06, a 2-core x86_64 machine, the meshes' ranks forked as ``ex.run()``
#: runs them, a pipeline × data-parallel mesh's costs probed through its exported script).
TORCHRUN_HERE_ERROR: Mapping[str, tuple[Optional[float], Optional[float], str]] = MappingProxyType({
    "measured here": (0.201, 0.349, "mesh_here.py, first run"),
    "learnt from runs": (0.050, 0.266, "mesh_here.py, runs after the first"),
})


def prediction_basis(plan: "Plan", executor: Optional[str] = None) -> Basis:
    """What ``plan``'s prediction rests on (:data:`BASES`), with the benchmarks' error for that kind:
    :data:`TORCHRUN_HERE_ERROR`'s for the exported script's ranks run here (a mesh's, or ``executor``
    ``'torchrun'``: the run it is set beside), :data:`EXPERTS_ERROR` for the catalogue's plan of a
    mixture of experts, else :data:`MEASURED_ERROR`'s."""
    learnt = plan.learnt.runs > 0
    if plan.planned:
        kind = "catalogue, learnt from runs" if learnt else "catalogue"
    else:
        kind = "learnt from runs" if learnt else "measured here"
    ranks_here = not plan.planned and (plan.mesh is not None or executor == "torchrun")
    if kind == "catalogue" and (plan.layer_table.attrs.get("experts") or {}).get("count"):
        median, largest, source = EXPERTS_ERROR
    else:
        median, largest, source = (TORCHRUN_HERE_ERROR if ranks_here else MEASURED_ERROR)[kind]
    return Basis(kind, median, largest, source)
