"""A tensor-parallel rank here is timed as torch's DTensor shard of each kind of block runs it, beside
the whole block; where a block does not run sharded for real, the count's share of its FLOPs stays."""
from __future__ import annotations

import math

import pytest
import torch
import transformers

from pipexplore.models import rank_timing, sharded
from pipexplore.models.meta import count_layers
from pipexplore.models.opcount import meta_copy, to_meta
from pipexplore.models.profile import profile_model
from pipexplore.models.rank_here import rank_here


def tiny_llama():
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config), torch.randint(0, 128, (4, 8))


def test_each_kind_of_block_is_timed_once_sharded_and_scales_its_rows():
    model, ids = tiny_llama()
    table = profile_model(model, ids, devices=["cpu"] * 4, repeats=1)
    rank = rank_here(model, ids, table, tp=2, microbatch_rows=2)
    timed = rank.attrs["tp_timed"]
    # the decoder layers (attention and MLP projections sharded) and the head (colwise), each kind once
    assert set(timed) == {"model.layers.0", "model.layers.1", "lm_head"}
    assert timed["model.layers.0"] == timed["model.layers.1"]
    assert all(math.isfinite(r) and r > 0 for ratios in timed.values() for r in ratios)
    by_name = rank.set_index("name")
    whole = table.set_index("name")
    for name, (forward, backward) in timed.items():
        # each row's seconds at the rank's ratio, with the phase's all-reduces on its path
        for phase, ratio in (("forward", forward), ("backward", backward)):
            assert by_name.loc[name, f"{phase}_a"] == pytest.approx(whole.loc[name, f"{phase}_a"] * ratio)
            assert by_name.loc[name, f"{phase}_b"] == pytest.approx(
                whole.loc[name, f"{phase}_b"] * ratio + by_name.loc[name, f"{phase}_comm"] / rank.attrs["batch"])
    kept = ["model.embed_tokens", "model.norm"]  # not divided: each rank computes them whole
    assert (by_name.loc[kept, "forward"] == whole.loc[kept, "forward"]).all()


def test_a_block_that_does_not_run_sharded_keeps_its_share_of_the_flops(monkeypatch):
    model, ids = tiny_llama()
    table = profile_model(model, ids, devices=["cpu"] * 4, repeats=1)
    counted = rank_here(model, ids, table, tp=2, microbatch_rows=2)
    real = sharded.shard

    def meta_only(*args, on_meta=True, **kwargs):
        if not on_meta:
            raise RuntimeError("cannot run here")
        return real(*args, **kwargs)

    monkeypatch.setattr(sharded, "shard", meta_only)
    rank = rank_here(model, ids, table, tp=2, microbatch_rows=2)
    assert rank.attrs["tp_timed"] == {}
    layer = rank.set_index("name").loc["model.layers.0"]
    whole = table.set_index("name").loc["model.layers.0"]
    # the count's share of the layer's FLOPs (its projections split in two: half of them), of the whole
    # forward as the profile's fit gives it at the batch's rows (a call's cost and its rows'; the
    # measured median beside it differs by the fit's residual)
    count = count_layers(meta_copy(model), to_meta(ids), microbatch_rows=2, tp=2).set_index("name")
    share = count.loc["model.layers.0", "rank_forward_flops"] / count.loc["model.layers.0", "forward_flops"]
    assert share == pytest.approx(0.5)
    fitted = whole["forward_a"] + whole["forward_b"] * rank.attrs["batch"]
    assert layer["forward"] - layer["forward_comm"] == pytest.approx(share * fitted)
    assert counted.attrs["tp_timed"]  # (timed where it runs)


def test_a_blocks_inputs_are_fresh_leaves_and_what_is_no_tensor_is_left_out():
    model, ids = tiny_llama()
    (args, kwargs), = rank_timing.first_calls(model, ids, ["model.layers.0"]).values()
    fresh_args, fresh_kwargs = rank_timing._fresh((args, kwargs))
    assert fresh_args[0].requires_grad and fresh_args[0].is_leaf and torch.equal(fresh_args[0], args[0])
    assert all(t.requires_grad for t in fresh_kwargs["position_embeddings"])
    assert not fresh_kwargs["position_ids"].requires_grad  # integers ask for no gradient
    assert kwargs.get("cache", kwargs.get("past_key_values")) is None  # (taken with the KV cache off)
    assert model.config.use_cache  # the user's config as it was
    cache = object()  # what is no tensor, nor a container of them, nor a plain value: left out
    assert rank_timing._fresh(({"cache": cache, "use_cache": False}, [cache])) == ({"cache": None, "use_cache": False},
                                                                               [None])
