"""A published table, predicted: Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM" (SC'21), Table 1 — GPT models of 1.7B to 1T parameters
on A100 80 GB GPUs, tensor × pipeline × data parallel, the TFLOP/s a GPU each run achieved.

Every row is planned from documented defaults only, nothing fitted to the table:

- the model: a GPT of the row's heads, hidden size and layers, vocabulary 51,200, sequence 2,048
  (§5.1), fp16 (§5: mixed precision), written below as Megatron-LM's code of 2021 computes it (its
  fused kernels on by default: scale-mask-softmax, bias-GeLU; dropout 0.1, its defaults; attention
  with the scores materialised: no flash attention yet), on the meta device, sharded by its own
  tensor parallelism's layout (:data:`TP_PLAN`);
- the mesh: t and p as published, d = GPUs / (t·p), 8 GPUs a node (Selene's DGX A100 nodes);
- the batch: the row's global batch, B/d rows a replica; the micro-batch size and the interleaved
  schedule's model chunks of Megatron-LM's own ``examples/sc21/run_table_1.sh`` (the paper names
  neither per row): micro-batches of 16, 16, 16, 8, 4, 2, 2, 1, 1, 1 rows; 3, 2, 2 and 3 chunks a
  rank for 76B, 145B, 310B and 530B, one (1F1B) for the rest;
- the layers: Megatron-LM's even split (l / (p·v) blocks a stage, the embedding with the first,
  the head with the last), full recomputation (§5.1: every layer checkpointed);
- data parallelism: gradients all-reduced at the step's end (Megatron-LM's "local" DDP of 2021);
  the sends between stages 1/t of a micro-batch's activations (§4.1's scatter/gather, which
  ``sequence_parallel=True`` counts alike); Adam with fp32 master weights;
- the device: the catalogue's ``A100-80GB`` (its datasheet's peak and bandwidths, its documented
  efficiency defaults; links: NVLink 300 GB/s a direction inside a node, 25 GB/s a GPU across).

Predicted TFLOP/s a GPU uses the paper's own count, 96·B·s·l·h²·(1 + s/6h + V/16lh) an iteration
(equation 3), over the predicted step and the GPUs. Run: ``python benchmarks/mesh_published.py``.
"""
from __future__ import annotations

import statistics
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

#: Table 1 (the paper's §5.1; Megatron-LM's README image of April 2021 holds the same numbers),
#: with the micro-batch and model chunks of ``examples/sc21/run_table_1.sh``.
TABLE_1 = [
    # name, heads, hidden, layers, t, p, GPUs, batch, achieved TFLOP/s a GPU, micro-batch, chunks a rank
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 16, 1),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 16, 1),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 16, 1),
    ("18B", 48, 6144, 40, 8, 1, 256, 1024, 135, 8, 1),
    ("39B", 64, 8192, 48, 8, 2, 512, 1536, 138, 4, 1),
    ("76B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 3),
    ("145B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 2),
    ("310B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 2),
    ("530B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 3),
    ("1T", 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, 1),
]
SEQUENCE, VOCABULARY, DEVICE = 2048, 51200, "A100-80GB"


def paper_flops(batch: int, layers: int, hidden: int) -> float:
    """Equation 3: the FLOPs of one iteration with full recomputation."""
    s, h, l, v = SEQUENCE, hidden, layers, VOCABULARY
    return 96 * batch * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


class Attention(nn.Module):
    """Megatron-LM's self-attention of 2021: one fused q|k|v projection laid out head by head (so a
    column shard holds whole heads), the scores by one GEMM (its ``baddbmm``), its fused
    scale-mask-softmax as one fp16 kernel over them, attention dropout, the context GEMM, the output
    projection. (No flash attention: it came in 2022.)"""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.query_key_value = nn.Linear(hidden, 3 * hidden)
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.query_key_value(x).view(b, s, -1, 3 * self.head_dim).transpose(1, 2)  # this rank's heads
        q, k, v = qkv.split(self.head_dim, dim=-1)
        probs = F.dropout(torch.softmax(q @ k.transpose(-1, -2), dim=-1), 0.1, self.training)
        return self.dense((probs @ v).transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense_h_to_4h = nn.Linear(hidden, 4 * hidden)
        self.dense_4h_to_h = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))  # Megatron-LM fuses the bias into the GeLU


class Block(nn.Module):
    """A pre-LayerNorm GPT block as Megatron-LM's ``ParallelTransformerLayer`` (hidden dropout 0.1 on
    each residual branch, its defaults)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden)
        self.attention = Attention(hidden, heads)
        self.post_attention_layernorm = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.dropout(self.attention(self.input_layernorm(x)), 0.1, self.training)
        return x + F.dropout(self.mlp(self.post_attention_layernorm(x)), 0.1, self.training)


class GPT(nn.Module):
    """Megatron-LM's GPT: word and position embeddings, the blocks, a final LayerNorm, the logits (the
    head's weight untied here: the same GEMMs)."""

    def __init__(self, heads: int, hidden: int, layers: int, vocabulary: int = VOCABULARY,
                 sequence: int = SEQUENCE) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocabulary, hidden)
        self.position_embeddings = nn.Embedding(sequence, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.final_layernorm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocabulary, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = F.dropout(self.word_embeddings(ids) + self.position_embeddings(positions), 0.1, self.training)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.final_layernorm(x))


#: Megatron-LM's tensor parallelism of the GPT above: its vocabulary-parallel embedding (an
#: all-reduce after it), column- then row-parallel projections, the logits left sharded by vocabulary
#: (its parallel cross-entropy never gathers them).
TP_PLAN = {"word_embeddings": "embedding_rowwise", "layers.*.attention.query_key_value": "colwise",
           "layers.*.attention.dense": "rowwise", "layers.*.mlp.dense_h_to_4h": "colwise",
           "layers.*.mlp.dense_4h_to_h": "rowwise", "head": "colwise"}


def gpt(heads: int, hidden: int, layers: int, vocabulary: int = VOCABULARY, sequence: int = SEQUENCE) -> nn.Module:
    with torch.device("meta"):
        return GPT(heads, hidden, layers, vocabulary, sequence).to(torch.float16)


def even_splits(table, stages: int) -> list[int]:
    """Megatron-LM's split: the blocks evenly, the embedding with the first stage, the head with the last."""
    blocks = [i for i, kind in enumerate(table["type"]) if kind == "Block"]
    per = len(blocks) // stages
    return [blocks[k * per] for k in range(1, stages)]


def predict(row: tuple) -> dict:
    from pipexplore.models.profile import profile_model
    from pipexplore.plan import Plan

    name, heads, hidden, layers, t, p, gpus, batch, achieved, micro, chunks_a_rank = row
    d = gpus // (t * p)
    rows = batch // d
    started = time.perf_counter()
    sample = torch.zeros(rows, SEQUENCE, dtype=torch.long, device="meta")
    devices = [f"{DEVICE}:{i}" for i in range(gpus)]
    table = profile_model(gpt(heads, hidden, layers), sample, devices=devices, gpus_per_node=8, chunks=rows // micro,
                          tp=t, tp_plan=TP_PLAN if t > 1 else None, optimizer=torch.optim.Adam, mixed_precision=True)
    schedule = "interleaved" if chunks_a_rank > 1 else "1f1b"
    plan = Plan(table, splits=tuple(even_splits(table, p * chunks_a_rank)), devices=tuple(devices),
                chunks=rows // micro, checkpoint="always", schedule=schedule, virtual_stages=max(2, chunks_a_rank),
                executor="processes", batch=rows, gpus_per_node=8, mesh={"tp": t, "pp": p, "dp": d},
                data_parallel="ddp", sequence_parallel=True)
    predicted = plan.predicted
    step = float(predicted["end"].max() - predicted["start"].min())
    tflops = paper_flops(batch, layers, hidden) / step / gpus / 1e12
    return {"model": name, "t": t, "p": p, "d": d, "micro": micro, "chunks": rows // micro, "step_s": step,
            "predicted": tflops, "published": achieved, "error": tflops / achieved - 1,
            "seconds": time.perf_counter() - started}


#: Kept aside to check the method, never tuned to: the Llama 3 paper's Table 4 (arXiv 2407.21783,
#: §3.3.2), Llama 3 405B on H100s: GPUs, tp, cp, pp, dp, sequence length, sequences a replica,
#: TFLOP/s a GPU published.
LLAMA3_TABLE_4 = [(8192, 8, 1, 16, 64, 8192, 32, 430), (16384, 8, 1, 16, 128, 8192, 16, 400),
                  (16384, 8, 16, 16, 8, 131072, 16, 380)]


def llama3_405b() -> nn.Module:
    """Llama 3 405B's shape (Table 3; the released checkpoint's vocabulary of 128,256), bf16, on meta."""
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=126, hidden_size=16384, intermediate_size=53248,
                                      num_attention_heads=128, num_key_value_heads=8, vocab_size=128256,
                                      max_position_embeddings=131072, rope_theta=500000.0)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def predict_llama3(row: tuple) -> dict:
    """One row of Llama 3's Table 4 from what the paper documents: FSDP sharding gradients and
    optimizer state without resharding after forward, no activation checkpointing (documented at
    8K, kept at 128K where the paper is silent), an interleaved schedule whose first chunk holds the
    embedding alone and last the output alone (one layer a chunk: 128 chunks on 16 ranks, 8 a
    rank), context parallelism gathering keys and values, micro-batches of one sequence (not
    documented: the smallest), TFLOP/s by PaLM's count (6N + 12·L·H·Q·T a token, the MFU the
    paper cites)."""
    from pipexplore.models.profile import profile_model
    from pipexplore.plan import Plan

    gpus, t, c, p, d, tokens, sequences, published = row
    started = time.perf_counter()
    model = llama3_405b()
    sample = torch.zeros(sequences, tokens, dtype=torch.long, device="meta")
    devices = [f"H100:{i}" for i in range(gpus)]
    table = profile_model(model, sample, devices=devices, gpus_per_node=8, chunks=sequences, tp=t,
                          optimizer=torch.optim.AdamW, mixed_precision=True)
    names = list(table["name"])
    blocks = [i for i, name in enumerate(names) if name.startswith("model.layers.")]
    splits = [blocks[0], *blocks[1:], names.index("model.norm")]  # the embedding alone, a layer a stage, the head
    plan = Plan(table, splits=tuple(splits), devices=tuple(devices), chunks=sequences, checkpoint="never",
                schedule="interleaved", virtual_stages=(len(splits) + 1) // p, executor="processes",
                batch=sequences, gpus_per_node=8, mesh={"tp": t, "pp": p, "dp": d, "cp": c}, data_parallel="fsdp",
                reshard_after_forward=False)
    predicted = plan.predicted
    step = float(predicted["end"].max() - predicted["start"].min())
    params = sum(q.numel() for q in model.parameters())
    per_token = 6 * params + 12 * 126 * 128 * 128 * tokens
    tflops = per_token * sequences * d * tokens / step / gpus / 1e12
    return {"model": f"405B/{gpus}" + (f"/cp{c}" if c > 1 else ""), "t": t, "p": p, "d": d, "micro": 1,
            "chunks": sequences, "step_s": step,
            "predicted": tflops, "published": published, "error": tflops / published - 1,
            "seconds": time.perf_counter() - started}


def main() -> int:
    print(f"{'model':>6} {'t':>2} {'p':>3} {'d':>3} {'mb':>3} {'m':>4} {'step s':>8} {'predicted':>10} "
          f"{'published':>10} {'error':>7} {'planned in':>10}")
    errors = []
    for row in TABLE_1:
        out = predict(row)
        errors.append(abs(out["error"]))
        print(f"{out['model']:>6} {out['t']:>2} {out['p']:>3} {out['d']:>3} {out['micro']:>3} {out['chunks']:>4} "
              f"{out['step_s']:>8.2f} {out['predicted']:>10.1f} {out['published']:>10} {out['error']:>+7.1%} "
              f"{out['seconds']:>9.1f}s", flush=True)
    print(f"median |error| {statistics.median(errors):.1%}, max {max(errors):.1%} (goal: ≤ 10 %, ≤ 20 %)")
    if "--table-1-only" not in sys.argv:
        print("kept aside: Llama 3 405B, Table 4 of its paper (H100, 8K sequences)")
        for row in LLAMA3_TABLE_4:
            out = predict_llama3(row)
            print(f"{out['model']:>10} {out['t']:>2} {out['p']:>3} {out['d']:>3} {out['micro']:>3} {out['chunks']:>4} "
                  f"{out['step_s']:>8.2f} {out['predicted']:>10.1f} {out['published']:>10} {out['error']:>+7.1%} "
                  f"{out['seconds']:>9.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
