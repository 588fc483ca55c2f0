"""Expert parallelism counted by torch as tensor parallelism is: a mixture of experts' layer as one
ep rank runs it on a fake process group (its stacked experts ``Shard(0)``, the split counts and the
tokens exchanged by ``all_to_all_single``, the local grouped GEMMs at the rank's tokens), its
all-to-alls' bytes against the hand formula, the busiest rank's at ``capacity_factor``, and the
planned table's all-to-alls costed over the ep group's links."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import transformers

from pipexplore.devices import Mesh
from pipexplore.models import ep_rank
from pipexplore.models.expert_parallel import count_expert_layers, expert_parallel, layer_exchange_bytes
from pipexplore.models.experts import routed_experts
from pipexplore.models.opcount import meta_copy
from pipexplore.predict.collectives import linear_cost

HIDDEN, FFN, EXPERTS, TOP_K, ROWS, TOKENS = 64, 32, 8, 2, 2, 16
MIXTRAL = ("MixtralConfig", "MixtralForCausalLM",
           dict(hidden_size=HIDDEN, intermediate_size=FFN, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
QWEN3_MOE = ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
             dict(hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=FFN, num_experts=EXPERTS,
                  num_experts_per_tok=TOP_K, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=128))


def build(shape, dtype=torch.float32, layers=2):
    config_class, model_class, options = shape
    config = getattr(transformers, config_class)(**options, num_hidden_layers=layers)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, model_class)(config).to(dtype)


def ids():
    return torch.zeros(ROWS, TOKENS, dtype=torch.long, device="meta")


def routed_bytes(tokens, size):
    """A rank's routed tokens: top_k copies of each of its tokens' hidden states."""
    return tokens * TOP_K * HIDDEN * size


@pytest.mark.parametrize("shape,dtype", [(MIXTRAL, torch.float32), (QWEN3_MOE, torch.bfloat16)],
                         ids=["mixtral-fp32", "qwen3_moe-bf16"])
@pytest.mark.parametrize("ep", [2, 4])
def test_the_counted_all_to_alls_move_the_hand_formulas_bytes(shape, dtype, ep):
    """Dispatch and combine each send tokens × top_k × hidden × bytes × (ep−1)/ep over the ep group
    (a rank keeps its own split), forward and backward; the split counts go first, forward only."""
    size = torch.empty((), dtype=dtype).element_size()
    layers = count_expert_layers(build(shape, dtype), ids(), ep=ep)
    assert [layer.name for layer in layers] == ["model.layers.0"]  # the second layer is the same kind
    sent = routed_bytes(ROWS * TOKENS, size) * (ep - 1) // ep
    assert layer_exchange_bytes(layers, "forward") == [2 * sent]
    assert layer_exchange_bytes(layers, "backward") == [2 * sent]
    for exchange in layers[0].exchanges:
        assert exchange.group == "ep" and exchange.ranks == ep
        if exchange.step != "counts":
            assert exchange.sent_bytes == exchange.received_bytes == exchange.bytes == sent
            assert exchange.tensor_bytes == routed_bytes(ROWS * TOKENS, size)


def test_one_moe_layers_collectives_in_order():
    """The list of collectives one Mixtral layer's rank runs at ep 4: the split counts (one int64
    an expert), the dispatch and the combine forward, the combine's and the dispatch's gradients
    backward; nothing else (tp 1: no tensor-parallel all-reduce)."""
    (layer,) = count_expert_layers(build(MIXTRAL), ids(), ep=4)
    sent = routed_bytes(ROWS * TOKENS, 4) * 3 // 4
    assert [(e.phase, e.step, e.group, e.bytes) for e in layer.exchanges] == [
        ("forward", "counts", "ep", EXPERTS * 8 * 3 // 4), ("forward", "dispatch", "ep", sent),
        ("forward", "combine", "ep", sent), ("backward", "combine", "ep", sent), ("backward", "dispatch", "ep", sent)]
    collectives = [(r["phase"], r["collective"]) for r in layer.count.records if r["collective"]]
    assert collectives == [("forward", "all_to_all")] * 3 + [("backward", "all_to_all")] * 2


def test_the_local_experts_compute_the_balanced_share_and_the_busiest_rank_more():
    """The local experts' grouped GEMMs run at a rank's tokens × top_k rows whatever ep is (the
    all-to-all trades tokens: 2·rows·hidden·2ffn + 2·rows·ffn·hidden forward, twice that backward);
    the busiest rank at capacity_factor 1.5 computes and receives 1.5 times that."""
    rows = ROWS * TOKENS * TOP_K
    forward = 2 * rows * HIDDEN * 2 * FFN + 2 * rows * FFN * HIDDEN
    for ep in (2, 4):
        (layer,) = count_expert_layers(build(MIXTRAL), ids(), ep=ep)
        assert layer.routed_rows == rows
        assert layer.expert_flops == {"forward": forward, "backward": 2 * forward}
    (hot,) = count_expert_layers(build(MIXTRAL), ids(), ep=4, capacity_factor=1.5)
    assert hot.routed_rows == rows * 3 // 2
    assert hot.expert_flops == {"forward": forward * 1.5, "backward": 2 * forward * 1.5}
    dispatch = next(e for e in hot.exchanges if e.step == "dispatch" and e.phase == "forward")
    assert dispatch.received_bytes == routed_bytes(ROWS * TOKENS, 4) * 3 // 4 * 3 // 2
    assert dispatch.sent_bytes == routed_bytes(ROWS * TOKENS, 4) * 3 // 4


def test_with_tensor_parallelism_a_rank_exchanges_its_share_of_the_tokens():
    """At tp 2 · ep 4 a rank holds half the tokens (sequence parallelism): its all-to-alls move half
    the bytes, and its attention's all-reduces run over the tp group beside them."""
    (layer,) = count_expert_layers(build(MIXTRAL), ids(), ep=4, tp=2)
    sent = routed_bytes(ROWS * TOKENS // 2, 4) * 3 // 4
    assert layer_exchange_bytes([layer], "forward") == [2 * sent]
    assert layer.routed_rows == ROWS * TOKENS // 2 * TOP_K
    assert any(r["collective"] == "all_reduce" for r in layer.count.records)


def test_the_stacked_experts_are_sharded_on_the_ep_group():
    from torch.distributed.tensor import DTensor, Shard

    model = build(QWEN3_MOE)
    info = routed_experts(model)
    with ep_rank.fake_meshes(1, 4) as (_, mesh):
        block = meta_copy(model.model.layers[0])
        (wrapper,) = expert_parallel(block, "model.layers.0", info, mesh)
        for name in ("gate_up_proj", "down_proj"):
            weight = wrapper.experts.get_parameter(name)
            assert isinstance(weight, DTensor) and weight.placements == (Shard(0),)
            assert weight.shape[0] == EXPERTS and weight.to_local().shape[0] == EXPERTS // 4
        assert block.mlp.experts is wrapper


def test_what_cannot_be_counted_is_refused_by_name():
    model = build(MIXTRAL)
    with pytest.raises(ValueError, match=r"capacity_factor .* from 1 \(balanced\) to ep = 4, got 5"):
        count_expert_layers(model, ids(), ep=4, capacity_factor=5)
    with pytest.raises(ValueError, match=r"ep 3 does not divide the 8 routed experts.*ep can be 1, 2, 4, 8"):
        count_expert_layers(model, ids(), ep=3)
    with pytest.raises(ValueError, match=r"ep is 1: every expert is on every rank"):
        count_expert_layers(model, ids(), ep=1)
    assert ep_rank.expert_splits(10, 4) == ([3, 3, 2, 2], [3, 3, 2, 2])
    assert ep_rank.expert_splits(8, 4, 2.0) == ([2, 2, 2, 2], [4, 4, 4, 4])


def test_the_planned_tables_all_to_alls_are_counted_and_costed_over_the_ep_group():
    """The planned layer table carries the all-to-alls torch counted (a row's bytes, the calls each
    phase), equal to two of ``dispatch_bytes`` each way; ``ep_seconds`` costs them over the ep
    group's links (inside a node: NVLink) with the NCCL model, and the busiest rank's more."""
    from pipexplore.models.profile import planned_layers
    from pipexplore.predict.mesh_costs import mesh_layer_table

    devices = [f"H100:{i}" for i in range(16)]
    table = planned_layers(build(QWEN3_MOE, torch.bfloat16), ids(), chunks=2, devices=devices[:8], tp=2)
    shares = table.attrs["expert_shares"]
    moe = (table["expert_params"] > 0).to_numpy()
    row = table["dispatch_bytes"].to_numpy() / table.attrs["batch"] / 2  # a row's routed tokens of a tp rank
    assert shares["exchange_bytes"] == pytest.approx(np.stack([2 * row, 2 * row]))
    assert (shares["exchange_calls"][:, moe] == [[3], [2]]).all() and (shares["exchange_calls"][:, ~moe] == 0).all()
    for ep, per_node in ((4, 8), (8, 4)):  # inside a node; across two
        mesh = Mesh(tp=2, dp=8, ep=ep)
        group = [devices[r] for r in mesh.group("ep", 0)]
        assert mesh.nodes_of("ep", 0, per_node) == (1 if per_node == 8 else 2)
        rows, batch = table.attrs["rows"][0], table.attrs["batch"]
        first = int(np.flatnonzero(moe)[0])
        latency, per_byte = linear_cost("all_to_all", row[first] * rows, group, per_node)
        folded = mesh_layer_table(table, mesh, devices, gpus_per_node=per_node)
        assert folded["ep_seconds"].iloc[first] == pytest.approx(5 * latency * batch / rows
                                                                 + 4 * per_byte * row[first] * batch)
        assert (folded["ep_seconds"][~moe] == 0).all()
        hot = mesh_layer_table(table, mesh, devices, gpus_per_node=per_node, capacity_factor=2.0)
        assert (hot["ep_seconds"][moe] > folded["ep_seconds"][moe]).all()
        assert (hot["forward"][moe] > folded["forward"][moe]).all()
    with pytest.raises(ValueError, match=r"capacity_factor .* to ep = 4, got 0.5"):
        mesh_layer_table(table, Mesh(tp=2, dp=8, ep=4), devices, capacity_factor=0.5)
