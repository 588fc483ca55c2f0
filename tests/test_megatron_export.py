"""A plan with a mesh as Megatron-LM's arguments: every option in its documented form, and the
pipeline's layout parsed and checked by Megatron-Core's own ``PipelineParallelLayerLayout``."""
from __future__ import annotations

import logging
import warnings

import pytest
import torch
import transformers

from models import meta_llama
from pipexplore.export.megatron import megatron_layout
from pipexplore.widgets.state import ExplorerState

logging.getLogger("transformers").setLevel(logging.ERROR)


def llama(layers: int = 8):
    return meta_llama(layers, heads=16)


IDS = torch.zeros(16, 512, dtype=torch.long, device="meta")


def arguments(text: str) -> dict[str, str]:
    """``--flag value`` lines as a mapping (a flag alone: '')."""
    out = {}
    for line in text.splitlines()[1:]:
        flag, _, value = line.rstrip(" \\").partition(" ")
        out[flag] = value.strip('"')
    return out


def parsed(layout: str, pp: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    return PipelineParallelLayerLayout(layout, pipeline_model_parallel_size=pp)


def test_every_option_is_written_as_megatron_lm_documents_it():
    state = ExplorerState(llama(), IDS, devices=["H100"] * 16, gpus_per_node=8, chunks=8, schedule="1f1b",
                          checkpoint="always", mesh={"tp": 4, "pp": 2, "dp": 2}, data_parallel="zero1")
    state.set_mesh({"tp": 4, "pp": 2, "dp": 2})
    blocks = [i for i, t in enumerate(state.layer_table["type"]) if t == "LlamaDecoderLayer"]
    state.update(splits=[blocks[4]])  # Megatron-LM's own even split: no layout needed
    text = state.export("megatron")
    assert text.startswith("# Megatron-LM arguments for pretrain_gpt.py, from a pipexplore plan: tp 4 · pp 2 · dp 2")
    args = arguments(text)
    assert args["--tensor-model-parallel-size"] == "4" and args["--pipeline-model-parallel-size"] == "2"
    assert "--sequence-parallel" in args and "--use-distributed-optimizer" in args
    assert args["--micro-batch-size"] == "2" and args["--global-batch-size"] == "32"  # 16 rows a replica, dp 2
    assert args["--num-layers"] == "8" and "--pipeline-model-parallel-layout" not in args
    assert args["--recompute-granularity"] == "full" and args["--recompute-method"] == "uniform"
    assert args["--hidden-size"] == "1024" and args["--ffn-hidden-size"] == "2816"
    assert args["--num-attention-heads"] == "16" and args["--num-query-groups"] == "4"
    assert "--group-query-attention" in args and "--swiglu" in args and args["--normalization"] == "RMSNorm"
    assert args["--seq-length"] == "512" and "--untie-embeddings-and-output-weights" in args
    state.set_mesh({"tp": 4, "pp": 2, "dp": 2}, data_parallel="fsdp")
    assert "--use-torch-fsdp2" in arguments(state.export("megatron"))


def test_an_uneven_split_is_a_layout_megatron_core_parses_to_the_same_stages():
    state = ExplorerState(llama(), IDS, devices=["H100"] * 16, gpus_per_node=8, chunks=8, schedule="1f1b",
                          mesh={"tp": 4, "pp": 4, "dp": 1})
    blocks = [i for i, t in enumerate(state.layer_table["type"]) if t == "LlamaDecoderLayer"]
    state.update(splits=[blocks[1], blocks[4], blocks[6]])  # 1, 3, 2, 2 decoder layers
    layout = arguments(state.export("megatron"))["--pipeline-model-parallel-layout"]
    assert layout == "Et|t*3|tt|ttL"
    megatron = parsed(layout, 4)
    megatron.validate_layer_layout(num_layers=8, mtp_num_layers=None)
    assert [len(stage[0]) for stage in megatron.layout] == [2, 3, 2, 3]  # E + t, t*3, tt, tt + L


def test_an_interleaved_even_split_says_its_layers_a_virtual_stage():
    state = ExplorerState(llama(), IDS, devices=["H100"] * 16, gpus_per_node=8, chunks=8, schedule="interleaved",
                          mesh={"tp": 4, "pp": 2, "dp": 2})
    blocks = [i for i, t in enumerate(state.layer_table["type"]) if t == "LlamaDecoderLayer"]
    state.update(splits=[blocks[2], blocks[4], blocks[6]])
    args = arguments(state.export("megatron"))
    assert args["--num-layers-per-virtual-pipeline-stage"] == "2"
    layout = megatron_layout(state.layer_table, list(state.plan.splits))
    parsed(layout, 2).validate_layer_layout(num_layers=8, mtp_num_layers=None)  # the same split, as a layout


def test_what_megatron_lm_does_not_build_or_run_is_refused_by_name():
    config = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=8, vocab_size=1024)
    with torch.device("meta"):
        gpt2 = transformers.GPT2LMHeadModel(config)
    state = ExplorerState(gpt2, torch.zeros(8, 64, dtype=torch.long, device="meta"), devices=["H100"] * 4,
                          chunks=4, schedule="1f1b")
    with pytest.raises(ValueError, match=r"a gpt2 config is not one this export writes \(llama, mistral"):
        state.export("megatron")
    zb = ExplorerState(llama(), IDS, devices=["H100"] * 4, chunks=8, schedule="zero-bubble")
    with pytest.raises(ValueError, match=r"Megatron-LM runs 1F1B and its interleaved schedule, not 'zero-bubble'"):
        zb.export("megatron")
    table = zb.layer_table
    names = list(table["name"])
    with pytest.raises(ValueError, match=r"stage 0 holds the output layer: Megatron-LM places it with the last"):
        megatron_layout(table, [names.index("lm_head")])  # the final norm split from the head
