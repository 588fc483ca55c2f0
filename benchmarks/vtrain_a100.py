"""Measured runs, predicted: vTrain's 1,440 GPT training runs on one node of A100s (Bang et al.,
MICRO 2024, arXiv 2312.12391; ``../shared/data/vtrain/single_node.csv``, its README's rules).

Every row is planned through the project's planning path from documented defaults:

- the model: a GPT of the row's hidden size, heads and layers, sequence 1,024, vocabulary 50,257
  padded to a multiple of 128·tp (Megatron's padding), fp16, written as Megatron-LM computes it
  (``mesh_published.GPT``: fused scale-mask-softmax over materialised scores, bias-GeLU, dropout
  0.1; the same code base Megatron-DeepSpeed runs), sharded by Megatron's tensor-parallel layout;
- the mesh: the row's tp, pp and dp, ranks placed as Megatron places them, one node of 8;
- the batch: global batch / dp rows a replica, in micro-batches of the row's size, 1F1B, full
  recomputation (every layer checkpointed), Megatron's even split of the layers;
- data parallelism: the fp16 gradients all-reduced at the step's end (no bucketing); Adam with
  fp32 master weights, fused (one kernel over parameter, gradient and both moments, as
  Megatron-DeepSpeed's FusedAdam);
- the device: the catalogue's ``A100-80GB`` (datasheet peaks and bandwidth, its efficiency
  defaults; 108 SMs, tiles and waves: :mod:`pipexplore.predict.kernels`) with the node's links as
  the data's README gives them: NVLink at 150 GB/s a direction.

The layer table of each model shape, tensor parallelism and micro-batch is counted once on the
meta device (``count_layers``) and reused for every row that shares it, then costed
(``planned_layer_costs``, as ``profile_model`` costs a planned device: checked equal on one row)
and simulated (``Plan.predicted``).

**Learnt on half, reported on the other.** The rows are split in two fixed halves by the SHA-256
of each row's configuration (its first ten fields as the CSV writes them, joined by commas): the
720 with the smallest digests are the *learning* half, the others *held out*. What is learnt is
learnt on the learning half only, from all of its rows at once (never row by row), by least
squares over the rows' relative errors (:class:`Learnt`): the launch floor
(:attr:`pipexplore.predict.roofline.Efficiency.launch`: the host's time to issue a kernel, which
Megatron-DeepSpeed's Python sets, not the GPU), the large GEMMs' fraction of peak, and the
framework's time per pipeline action (``Plan.action_overhead``, with two stages or more: each
forward, recomputation and backward of a micro-batch on a stage comes with Megatron's point-to-point
exchange with the next stage and the device's synchronisation after it; a time a pipeline pays once
an action however few layers its stage holds, so that without it the deeper pipelines of small
micro-batches were predicted 10–12 % short). Reported: mean, median and max absolute error on the
held-out half and on the whole file, with the catalogue's defaults and with what was learnt; and
per group (one model shape on the same number of GPUs and the same global batch: the same work),
the regret: the measured time of the plan predicted fastest over the measured fastest.

Run: ``python benchmarks/vtrain_a100.py`` (``--sample N``: every N-th row only; ``--data PATH``).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import pathlib
import sys
import time
from typing import Any, NamedTuple, Optional

import numpy as np
import pandas as pd
import torch

from common import machine
from mesh_published import TP_PLAN, even_splits, gpt

from pipexplore.devices import CATALOGUE, device_spec, register_device
from pipexplore.models.meta import count_layers
from pipexplore.plan import Plan
from pipexplore.predict.kernels import KERNELS, register_gpu_kernels
from pipexplore.predict.memory import optimizer_traffic
from pipexplore.predict.roofline import Efficiency, Group, planned_layer_costs

DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "vtrain" / "single_node.csv"
COLUMNS = ["gpus", "global_batch", "micro_batch", "hidden", "heads", "layers", "sequence", "tp", "dp", "pp", "ms"]
#: The node as the data's README documents it: A100s, NVLink at 150 GB/s a direction. The catalogue's
#: A100 (the 80 GB part: the README does not say which) with that link.
NODE = "A100-80GB-vTrain"
BASE = "A100-80GB"
VOCABULARY = 50257
GPUS_PER_NODE = 8


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's vocabulary-parallel cross-entropy (``tensor_parallel.vocab_parallel_cross_entropy``)
    as its code computes it on one rank's fp32 logits (its all-reduces of the max and of the sum,
    a float a token, left out): the max subtracted, the target's logit gathered, exponentiated,
    summed, the softmax kept for the backward, which scales it by the incoming gradient (the
    target's entry made one less: a float a token)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        shifted = logits - logits.max(dim=-1)[0].unsqueeze(-1)
        predicted = shifted.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        ctx.save_for_backward(exp / total.unsqueeze(-1), target)
        return torch.log(total) - predicted

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        softmax, target = ctx.saved_tensors
        grad_input = softmax * grad.unsqueeze(-1)
        grad_input.scatter_add_(-1, target.unsqueeze(-1), -grad.unsqueeze(-1))
        return grad_input, None


def cross_entropy(tp: int) -> Any:
    """The loss a rank of ``tp`` computes: the cross-entropy of its share of the vocabulary's logits,
    in fp32 (Megatron's default: ``fp16_lm_cross_entropy`` off), averaged."""
    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        share = logits[..., : logits.shape[-1] // tp]  # (a rank's logits: the model's are the whole vocabulary's)
        return VocabParallelCrossEntropy.apply(share.float(), target).mean()

    return loss


def node_spec() -> Any:
    spec = dataclasses.replace(CATALOGUE[BASE], name=NODE, intra_node_bandwidth=150e9,
                               intra_node_link="NVLink 3 at 150 GB/s a direction (the vTrain data's README)")
    register_device(spec, replace=True)
    register_gpu_kernels(NODE, KERNELS[BASE], replace=True)
    return spec


def fused_adam(params: Any) -> torch.optim.Optimizer:
    """Megatron-DeepSpeed's optimizer: Adam, fused (one kernel over p, g, m and v)."""
    return torch.optim.Adam(params, fused=True)


def load(path: pathlib.Path) -> pd.DataFrame:
    """The rows, with ``key`` (the configuration as the CSV writes it), ``half`` (0: learning, 1:
    held out), ``model_gpus`` (model shape and GPUs) and ``group`` (model shape, GPUs, global batch)."""
    raw = pd.read_csv(path)
    config = raw.iloc[:, :10].astype(str).agg(",".join, axis=1)
    frame = raw.set_axis(COLUMNS, axis=1)
    frame["key"] = config
    digest = config.map(lambda s: hashlib.sha256(s.encode()).hexdigest())
    order = np.argsort(digest.to_numpy(), kind="stable")
    half = np.ones(len(frame), dtype=int)
    half[order[: len(frame) // 2]] = 0
    frame["half"] = half
    frame["model_gpus"] = (frame["hidden"].astype(str) + "h/" + frame["layers"].astype(str) + "L/"
                           + frame["gpus"].astype(str) + "gpu")
    frame["group"] = frame["model_gpus"] + "/b" + frame["global_batch"].astype(str)
    return frame


_COUNTS: dict[tuple, tuple[pd.DataFrame, pd.DataFrame]] = {}
_COSTED: dict[tuple, pd.DataFrame] = {}
#: Blocks a shape is counted with: every block of a GPT is the same kind, counted once; the table of
#: ``layers`` blocks repeats the last (:func:`with_layers`).
COUNTED_BLOCKS = 2


def counted(hidden: int, heads: int, sequence: int, tp: int, micro: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The layer table of one tensor-parallel rank of a GPT of :data:`COUNTED_BLOCKS` blocks, counted
    at a micro-batch of ``micro`` rows (its ``batch``), and its ops: once per shape."""
    key = (hidden, heads, sequence, tp, micro)
    if key not in _COUNTS:
        vocabulary = -(-VOCABULARY // (128 * tp)) * 128 * tp
        model = gpt(heads, hidden, COUNTED_BLOCKS, vocabulary, sequence)
        sample = torch.zeros(micro, sequence, dtype=torch.long, device="meta")
        table = count_layers(model, sample, microbatch_rows=micro, tp=tp, tp_plan=TP_PLAN if tp > 1 else None,
                             loss_fn=cross_entropy(tp), target=torch.zeros_like(sample))
        ops = table.attrs["ops"]
        ops = ops.assign(flops=ops["flops"].fillna(0.0))
        table.attrs = {k: v for k, v in table.attrs.items() if k != "ops"}  # (pandas copies attrs at every step)
        _COUNTS[key] = (table, ops)
    return _COUNTS[key]


def with_layers(table: pd.DataFrame, layers: int) -> pd.DataFrame:
    """``table`` (a GPT's, blocks named ``layers.<i>``) with ``layers`` blocks: its last block repeated."""
    names = table["name"].astype(str)
    blocks = np.flatnonzero(names.str.startswith("layers.").to_numpy())
    block = table.iloc[[blocks[-1]]]
    repeated = pd.concat([block] * layers, ignore_index=True)
    repeated["name"] = [f"layers.{i}" for i in range(layers)]
    out = pd.concat([table.iloc[: blocks[0]], repeated, table.iloc[blocks[-1] + 1:]], ignore_index=True)
    out["order"] = np.arange(len(out))
    out.attrs = dict(table.attrs)
    return out


#: The columns of a count that grow with the rows of the batch (count_layers scales them so).
_PER_ROW = ("output_bytes", "saved_bytes", "forward_flops", "backward_flops", "rank_forward_flops",
            "rank_backward_flops")


def at_batch(table: pd.DataFrame, batch: int) -> pd.DataFrame:
    """A count at ``table.attrs['batch']`` rows as count_layers gives it at ``batch`` rows."""
    scale = batch / float(table.attrs["batch"])
    out = table.copy()
    for column in _PER_ROW:
        if column in out:
            out[column] = out[column].to_numpy(dtype=float) * scale
    out.attrs = {**table.attrs, "batch": batch}
    return out


def tp_group(devices: list[str], tp: int) -> Optional[Group]:
    """The tensor-parallel group of the first ``tp`` ranks, as ``planned_layers`` builds it (its
    collectives costed as NCCL runs them over the node's links)."""
    return Group.over(list(devices[:tp]), GPUS_PER_NODE) if tp > 1 else None


def costed(table: pd.DataFrame, ops: pd.DataFrame, devices: list[str], *, batch: int, micro: int, tp: int,
           efficiency: Optional[Efficiency]) -> pd.DataFrame:
    """The costed layer table, as ``planned_layers`` costs a count (its roofline and optimizer
    columns), with ``efficiency`` (None: the catalogue's defaults)."""
    spec = device_spec(NODE)
    group = tp_group(devices, tp)
    out = planned_layer_costs(table, ops, spec, batch=batch, microbatch_rows=micro, efficiency=efficiency,
                              group=group)
    out["optimizer"] = optimizer_traffic(out, optimizer=fused_adam, mixed_precision=True) / (
        spec.memory_bandwidth * (efficiency or Efficiency()).optimizer_for(spec))
    if tp > 1:  # a rank steps its shard of each layer's parameters
        whole = out["param_bytes"].to_numpy(dtype=float)
        held = out["rank_param_bytes"].to_numpy(dtype=float) / np.maximum(whole, 1)
        out["optimizer"] *= np.where(whole > 0, held, 1.0)
    return out


def layer_table(row: Any, efficiency: Optional[Efficiency]) -> pd.DataFrame:
    """The costed layer table of one row's pipeline rank (its model, tp, micro-batch and batch)."""
    batch = int(row.global_batch) // int(row.dp)
    shape = (int(row.hidden), int(row.heads), int(row.sequence), int(row.tp), int(row.micro_batch))
    key = (*shape, batch, efficiency)
    if key not in _COSTED:
        table, ops = counted(*shape)
        devices = [f"{NODE}:{i}" for i in range(GPUS_PER_NODE)]
        _COSTED[key] = costed(at_batch(table, batch), ops, devices, batch=batch, micro=int(row.micro_batch),
                              tp=int(row.tp), efficiency=efficiency)
    return with_layers(_COSTED[key], int(row.layers))


class Learnt(NamedTuple):
    """What :func:`learn` learns: the kernels' efficiency (its launch floor and the large GEMMs'
    fraction of peak) and the framework's seconds per pipeline action (``Plan.action_overhead``)."""

    efficiency: Efficiency
    action: float = 0.0


def plan_of(row: Any, learnt: Optional[Learnt]) -> Plan:
    """One row's plan, costed with ``learnt`` (None: the catalogue's defaults, no time per action); the
    time per action where there is a pipeline (its stages exchange a micro-batch's activations)."""
    batch = int(row.global_batch) // int(row.dp)
    table = layer_table(row, learnt.efficiency if learnt is not None else None)
    devices = tuple(f"{NODE}:{i}" for i in range(int(row.gpus)))
    return Plan(table, splits=tuple(even_splits(table, int(row.pp))), devices=devices,
                chunks=batch // int(row.micro_batch), checkpoint="always", schedule="1f1b", executor="processes",
                batch=batch, gpus_per_node=GPUS_PER_NODE, data_parallel="ddp", sequence_parallel=True,
                mesh={"tp": int(row.tp), "pp": int(row.pp), "dp": int(row.dp)},
                action_overhead=learnt.action if learnt is not None and int(row.pp) > 1 else 0.0)


def predict(rows: pd.DataFrame, learnt: Optional[Learnt]) -> np.ndarray:
    """Predicted step (ms) of each row (``learnt`` None: the catalogue's defaults)."""
    out = []
    for row in rows.itertuples():
        predicted = plan_of(row, learnt).predicted
        out.append(float(predicted["end"].max() - predicted["start"].min()) * 1e3)
    return np.array(out)


def errors(frame: pd.DataFrame, column: str) -> pd.Series:
    return frame[column] / frame["ms"] - 1.0


def summary(frame: pd.DataFrame, column: str) -> str:
    e = errors(frame, column)
    return (f"MAE {e.abs().mean():6.1%}  median |e| {e.abs().median():6.1%}  median e {e.median():+6.1%}  "
            f"max |e| {e.abs().max():6.1%}  ({len(e)} rows)")


def regret(frame: pd.DataFrame, column: str, by: str = "group", per_sample: bool = False) -> pd.DataFrame:
    """Per group (``by``: ``group``, one model shape on the same GPUs with the same global batch, or
    ``model_gpus``, one model shape on the same GPUs): the measured time of the plan predicted
    fastest over the measured fastest. ``per_sample``: times per sample of the global batch (a
    step's milliseconds over its global batch: the plan that trains fastest, where the group's
    plans differ in their global batch), else a step's."""
    out = []
    for name, rows in frame.groupby(by):
        if len(rows) < 2:
            continue
        scale = rows["global_batch"] if per_sample else 1
        predicted, measured = rows[column] / scale, rows["ms"] / scale
        pick = predicted.idxmin()
        chosen = rows.loc[pick]
        out.append({"group": name, "plans": len(rows), "regret": float(measured[pick] / measured.min() - 1.0),
                    "chosen": f"tp{chosen.tp} pp{chosen.pp} dp{chosen.dp} mb{chosen.micro_batch}"})
    return pd.DataFrame(out)


def check_against_profile_model(frame: pd.DataFrame) -> None:
    """The cached count of two blocks, repeated and costed here, equals ``profile_model``'s table
    for one row of the file (the public path, its whole model counted)."""
    from pipexplore.models.profile import profile_model

    row = frame[(frame["tp"] == 2) & (frame["global_batch"] // frame["dp"] > frame["micro_batch"])].iloc[0]
    batch = int(row.global_batch) // int(row.dp)
    devices = [f"{NODE}:{i}" for i in range(int(row.gpus))]
    vocabulary = -(-VOCABULARY // (128 * int(row.tp))) * 128 * int(row.tp)
    sample = torch.zeros(batch, int(row.sequence), dtype=torch.long, device="meta")
    public = profile_model(gpt(int(row.heads), int(row.hidden), int(row.layers), vocabulary, int(row.sequence)),
                           sample, devices=devices, gpus_per_node=GPUS_PER_NODE,
                           chunks=batch // int(row.micro_batch), tp=int(row.tp), tp_plan=TP_PLAN,
                           optimizer=fused_adam, mixed_precision=True, loss_fn=cross_entropy(int(row.tp)),
                           target=torch.zeros_like(sample))
    mine = layer_table(row, None)
    assert list(mine["name"]) == list(public["name"]) and list(mine["kind"]) == list(public["kind"])
    for column in ("forward_a", "forward_b", "backward_a", "backward_b", "forward_comm", "backward_comm", "optimizer",
                   "output_bytes", "saved_bytes", "param_bytes", "rank_param_bytes"):
        np.testing.assert_allclose(mine[column].to_numpy(dtype=float), public[column].to_numpy(dtype=float),
                                   rtol=1e-9, err_msg=column)


#: What :func:`learn` learnt on the learning half the last time it ran (benchmarks/README.md): the
#: launch floor, the large-GEMM fraction of peak and the time per pipeline action. ``--learnt`` plans
#: with it without learning again; tests/test_kernels.py holds a few held-out rows to it.
LEARNT = Learnt(Efficiency(flops=0.942, launch=44.8e-6), action=0.554e-3)
#: The learning's start: a launch of 20 µs (eager PyTorch's per-operator host time, before a
#: framework's own), the catalogue's large-GEMM fraction, and 0.1 ms an action (a step of Python).
START = (20e-6, CATALOGUE[BASE].flops_efficiency, 1e-4)


def learnt_at(x: np.ndarray) -> Learnt:
    """What is learnt at ``x = (log launch, log large-GEMM fraction, log seconds an action)``."""
    return Learnt(Efficiency(flops=float(min(1.0, math.exp(x[1]))), launch=float(math.exp(x[0]))),
                  float(math.exp(x[2])))


def learn(rows: pd.DataFrame, *, iterations: int = 6, log: Any = print) -> Learnt:
    """The launch floor, the large-GEMM fraction and the time per action that make the predictions
    of ``rows`` closest to their measured steps: least squares over the relative errors of all the
    rows at once, by Gauss–Newton (derivatives by finite differences of the whole prediction, 5 %
    steps of each parameter in log space), from :data:`START`."""
    measured = rows["ms"].to_numpy(dtype=float)
    x = np.log(np.array(START))
    step = 0.05
    for _ in range(iterations):
        base = predict(rows, learnt_at(x)) / measured - 1.0
        jacobian = np.stack([(predict(rows, learnt_at(x + step * np.eye(len(x))[k])) / measured - 1.0 - base) / step
                             for k in range(len(x))], axis=1)
        delta, *_ = np.linalg.lstsq(jacobian, -base, rcond=None)
        delta = np.clip(delta, -1.0, 1.0)
        log(f"    launch {math.exp(x[0]) * 1e6:5.1f} µs, large GEMMs {min(1.0, math.exp(x[1])):.3f} of peak, "
            f"{math.exp(x[2]) * 1e3:.3f} ms an action: MAE {np.abs(base).mean():.2%}, "
            f"RMS {np.sqrt((base ** 2).mean()):.2%}")
        x = x + delta
        x[1] = min(x[1], 0.0)  # at most the peak
        if np.abs(delta).max() < 0.01:
            break
    return learnt_at(x)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", default=str(DATA), help="the vTrain single-node CSV")
    parser.add_argument("--sample", type=int, default=1, help="every N-th row only (a quick look)")
    parser.add_argument("--learnt", action="store_true", help="plan with LEARNT (what the last learning gave) "
                                                             "instead of learning again")
    parser.add_argument("--out", default="", help="write every row with its predictions to this CSV")
    args = parser.parse_args(argv)
    node_spec()
    frame = load(pathlib.Path(args.data))
    if args.sample > 1:
        frame = frame.iloc[:: args.sample].copy()
    print(f"machine: {machine()}")
    started = time.perf_counter()
    check_against_profile_model(frame)
    frame["default"] = predict(frame, None)
    print(f"planned {len(frame)} rows with the catalogue's defaults in {time.perf_counter() - started:.0f} s "
          f"({len(_COUNTS)} shapes counted)")
    learning, held_out = frame[frame["half"] == 0], frame[frame["half"] == 1]
    if args.learnt:
        learnt = LEARNT
    else:
        started = time.perf_counter()
        print(f"learning on the learning half ({len(learning)} rows):")
        learnt = learn(learning)
        print(f"  learnt in {time.perf_counter() - started:.0f} s")
    efficiency = learnt.efficiency
    print(f"learnt: launch {efficiency.launch_for(device_spec(NODE)) * 1e6:.1f} µs, large GEMMs "
          f"{efficiency.flops_for('float16', device_spec(NODE)):.3f} of peak, {learnt.action * 1e3:.3f} ms an action")
    frame["learnt"] = predict(frame, learnt)
    learning, held_out = frame[frame["half"] == 0], frame[frame["half"] == 1]
    for column in ("default", "learnt"):
        for name, part in (("learning half", learning), ("held-out half", held_out), ("whole file", frame)):
            print(f"  {column:8} {name:13}: {summary(part, column)}")
    for by, what, per_sample in (("model_gpus", "model shape, GPUs: a step", False),
                                 ("model_gpus", "model shape, GPUs: a sample", True),
                                 ("group", "model shape, GPUs, global batch", False)):
        for column in ("default", "learnt"):
            table = regret(frame, column, by, per_sample)
            print(f"regret ({column:7}), {len(table):3} groups ({what}): median {table['regret'].median():5.1%}, "
                  f"mean {table['regret'].mean():5.1%}, max {table['regret'].max():5.1%}; "
                  f"{(table['regret'] <= 0.05).sum()} within 5 %")
    if args.out:
        frame.to_csv(args.out, index=False)
    by = frame.assign(e=errors(frame, "learnt")).groupby(["tp", "micro_batch"])["e"].median().unstack()
    print("median error by tp (rows) and micro-batch (columns), learnt:")
    print(by.map(lambda v: f"{v:+.0%}").to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
