"""Mixtures of experts exported: Megatron-LM's MoE arguments parsed by a parser built from
Megatron-Core's own ``TransformerConfig`` (as Megatron-LM builds its own) and validated by it, each
value the plan's; torchtitan's command with the mesh's ``expert_parallel_degree`` for a flavor it
has (the flavors' shapes read from torchtitan's own source), read by its own config dataclasses;
what either cannot run refused by name."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import logging
import typing
import warnings
from pathlib import Path

import pytest
import torch
import transformers

from models import meta_llama
from pipexplore.export.torchtitan import TORCHTITAN_MOE
from pipexplore.widgets.state import ExplorerState
from test_torchtitan_export import parse as torchtitan_parse

logging.getLogger("transformers").setLevel(logging.ERROR)

#: Tiny mixtures of experts (4 or 8 layers at hidden 256): the arguments' values are the config's.
MIXTRAL = transformers.MixtralConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                     num_attention_heads=8, num_key_value_heads=4, num_local_experts=8,
                                     num_experts_per_tok=2, vocab_size=1024, router_aux_loss_coef=0.02,
                                     rope_theta=1e6)
#: torchtitan's ``qwen3_moe_debug`` flavor's shape; its first layer dense in :data:`QWEN3_DENSE_FIRST`.
QWEN3_MOE = dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 moe_intermediate_size=768, intermediate_size=1024, num_experts=64, num_experts_per_tok=8,
                 vocab_size=2048, norm_topk_prob=True)
QWEN2_MOE = transformers.Qwen2MoeConfig(hidden_size=256, intermediate_size=1024, moe_intermediate_size=128,
                                        shared_expert_intermediate_size=512, num_hidden_layers=4,
                                        num_attention_heads=8, num_key_value_heads=4, num_experts=16,
                                        num_experts_per_tok=4, vocab_size=1024)
#: torchtitan's ``deepseek_v3_debugmodel`` flavor's shape.
DEEPSEEK_V3 = dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=16, vocab_size=2048, q_lora_rank=None,
                   kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2,
                   intermediate_size=1024, first_k_dense_replace=1, n_group=1, topk_group=1)
MODELS = {"MixtralConfig": "MixtralForCausalLM", "Qwen3MoeConfig": "Qwen3MoeForCausalLM",
          "Qwen2MoeConfig": "Qwen2MoeForCausalLM", "DeepseekV3Config": "DeepseekV3ForCausalLM"}


def plan_of(config, mesh, data_parallel="zero1", devices=16, **options):
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(transformers, MODELS[type(config).__name__])(config)
    return ExplorerState(model, torch.zeros(8, 128, dtype=torch.long, device="meta"), devices=["H100"] * devices,
                         gpus_per_node=8, chunks=4, schedule="1f1b", mesh=mesh, data_parallel=data_parallel,
                         **options)


# ---- Megatron-LM -------------------------------------------------------------------------------------


def moe_freq(text: str):
    """Megatron-LM's ``moe_freq_type``: a whole number, or a Python list expression."""
    return int(text) if text.isdigit() else eval(text, {"__builtins__": {}})  # the export's own text


def megatron_parser() -> argparse.ArgumentParser:
    """The model's arguments as Megatron-LM's ``arguments.py`` adds them: every field of
    Megatron-Core's ``TransformerConfig`` (with ``ModelParallelConfig``'s) a flag, named and typed
    by the rule of its ``ArgumentGroupFactory`` (``--field-name``; a boolean ``store_true``, or
    ``--no-``/``--disable-`` where it defaults to True; a ``Literal`` its choices; the field's
    ``argparse_meta`` over all), and the MoE flags it adds by hand (``_add_moe_args``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.transformer_config import TransformerConfig

    hints = typing.get_type_hints(TransformerConfig)
    parser = argparse.ArgumentParser(allow_abbrev=False)
    for field in dataclasses.fields(TransformerConfig):
        if not field.init or field.name == "num_moe_experts":  # Megatron-LM names it --num-experts
            continue
        kind, meta = hints[field.name], dict(field.metadata.get("argparse_meta", {}))
        args = typing.get_args(kind)
        if typing.get_origin(kind) is typing.Union and len(args) == 2 and type(None) in args:
            kind = args[0]
        names = ["--" + field.name.replace("_", "-")]
        kwargs: dict = {"dest": field.name, "default": None}
        if kind is bool:
            kwargs["action"] = "store_true" if field.default is False else "store_false"
            if field.default is not False:
                names = ["--no-" + field.name.replace("_", "-"), "--disable-" + field.name.replace("_", "-")]
        elif kind in (int, float, str):
            kwargs["type"] = kind
        elif typing.get_origin(kind) is typing.Literal:
            kwargs.update(type=type(typing.get_args(kind)[0]), choices=typing.get_args(kind))
        elif not meta.get("type"):
            continue  # a type Megatron-LM's arguments.py names by hand
        names = meta.pop("arg_names", names)
        meta.pop("default", None)
        parser.add_argument(*names, **{**kwargs, **meta})
    parser.add_argument("--num-experts", dest="num_moe_experts", type=int)
    parser.add_argument("--moe-layer-freq", type=moe_freq)
    parser.add_argument("--moe-router-load-balancing-type", nargs="+",
                        choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"])
    parser.add_argument("--moe-aux-loss-coeff", type=float, nargs="+")
    return parser


#: Megatron-LM's own flags outside TransformerConfig that the export writes (training, network size).
TRAINING_FLAGS = {"--micro-batch-size", "--global-batch-size", "--use-distributed-optimizer", "--use-torch-fsdp2",
                  "--swiglu", "--group-query-attention", "--position-embedding-type", "--rotary-base",
                  "--untie-embeddings-and-output-weights", "--seq-length", "--max-position-embeddings",
                  "--recompute-method", "--recompute-num-layers"}


def megatron_config(text: str):
    """The export's arguments parsed by :func:`megatron_parser`, then Megatron-Core's own
    ``TransformerConfig`` built from them (its ``__post_init__`` checks the MoE values together)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.transformer_config import TransformerConfig

    words = [word.strip('"') for line in text.splitlines()[1:] for word in line.rstrip(" \\").split(" ", 1)]
    parsed, unknown = megatron_parser().parse_known_args(words)
    assert {word for word in unknown if word.startswith("--")} <= TRAINING_FLAGS, unknown
    given = {name: value for name, value in vars(parsed).items() if value is not None}
    if "moe_router_load_balancing_type" in given:
        given["moe_router_load_balancing_type"] = given["moe_router_load_balancing_type"][0]
        given["moe_aux_loss_coeff"] = given["moe_aux_loss_coeff"][0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformerConfig(**given, pipeline_dtype=torch.bfloat16)


def test_mixtral_and_qwen3_moe_are_megatron_cores_moe_with_the_plans_degrees():
    mixtral = plan_of(MIXTRAL, {"tp": 2, "pp": 2, "dp": 4, "ep": 4, "etp": 2})
    config = megatron_config(mixtral.export("megatron"))
    mesh = mixtral.plan.mesh
    assert (config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (mesh.ep, mesh.etp) == (4, 2)
    assert (config.num_moe_experts, config.moe_router_topk) == (8, 2)
    assert config.tensor_model_parallel_size == 2 and config.pipeline_model_parallel_size == 2
    assert config.moe_token_dispatcher_type == "alltoall" and config.moe_grouped_gemm is True
    assert config.moe_ffn_hidden_size == 512 and config.moe_shared_expert_intermediate_size is None
    assert config.moe_router_load_balancing_type == "aux_loss" and config.moe_aux_loss_coeff == 0.02
    assert config.moe_router_pre_softmax is False  # Mixtral renormalises its top 2
    assert config.moe_layer_freq == 1 and config.add_bias_linear is False and config.num_query_groups == 4
    assert "--rotary-base 1000000" in mixtral.export("megatron")  # transformers 5 keeps it in rope_parameters

    qwen3 = plan_of(transformers.Qwen3MoeConfig(**QWEN3_MOE, mlp_only_layers=[0]), {"tp": 2, "pp": 2, "dp": 4, "ep": 8})
    config = megatron_config(qwen3.export("megatron"))
    assert qwen3.plan.layer_table.attrs["experts"] == {"count": 64, "top_k": 8}
    assert (config.num_moe_experts, config.moe_router_topk) == (64, 8)
    assert (config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (8, 1)
    assert config.moe_ffn_hidden_size == 768 and config.ffn_hidden_size == 1024  # the experts', the dense layer's
    assert config.moe_layer_freq == [0] + [1] * 7  # layer 0 is in mlp_only_layers
    assert config.kv_channels == 128 and config.qk_layernorm is True  # head_dim 128 at hidden 256, 16 heads
    assert config.moe_aux_loss_coeff == pytest.approx(0.001)


def test_qwen2_moe_writes_its_gated_shared_expert_and_the_routers_softmax_over_every_expert():
    state = plan_of(QWEN2_MOE, {"tp": 2, "pp": 2, "dp": 4, "ep": 2})
    config = megatron_config(state.export("megatron"))
    assert (config.num_moe_experts, config.moe_router_topk, config.expert_model_parallel_size) == (16, 4, 2)
    assert config.moe_shared_expert_intermediate_size == 512 and config.moe_shared_expert_gate is True
    assert config.moe_router_pre_softmax is True and config.add_qkv_bias is True  # norm_topk_prob False


def test_a_dense_plan_gains_no_moe_flag_and_deepseek_is_refused_by_name():
    state = ExplorerState(meta_llama(4, heads=16), torch.zeros(8, 128, dtype=torch.long, device="meta"),
                          devices=["H100"] * 8, chunks=4, schedule="1f1b", mesh={"tp": 2, "pp": 2, "dp": 2})
    text = state.export("megatron")
    flags = [line.split(" ")[0] for line in text.splitlines()[1:]]
    assert not [flag for flag in flags if flag.startswith(("--moe", "--num-experts", "--expert-"))]
    assert megatron_config(text).num_moe_experts is None
    deepseek = plan_of(transformers.DeepseekV3Config(**DEEPSEEK_V3), {"tp": 2, "pp": 2, "dp": 4, "ep": 4})
    with pytest.raises(ValueError, match=r"a deepseek_v3 config is not one this export writes \(llama, mistral"):
        deepseek.export("megatron")


# ---- torchtitan --------------------------------------------------------------------------------------------------


def torchtitan_source(path: str) -> ast.Module:
    """A file of the installed torchtitan, parsed (its model packages import what a CPU build lacks)."""
    spec = importlib.util.find_spec("torchtitan")
    if spec is None or spec.origin is None:
        pytest.skip("torchtitan is not installed (scripts/setup.sh installs it)")
    return ast.parse((Path(spec.origin).parent / path).read_text())


def flavor_values(module: ast.Module, registry: str, flavors: str) -> dict[str, dict[str, int]]:
    """Each config registry function's model: the whole numbers its flavor function names (its own
    assignments and the keywords it passes), read from torchtitan's source."""
    functions = {node.name: node for node in module.body if isinstance(node, ast.FunctionDef)}
    registries = {node.name: node for node in torchtitan_source(registry).body if isinstance(node, ast.FunctionDef)}
    table = next(node.value for node in module.body
                 if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == flavors)
    named = {key.value: value.id for key, value in zip(table.keys, table.values)}  # type: ignore[union-attr]
    out = {}
    for name, function in registries.items():
        calls = [node for node in ast.walk(function) if isinstance(node, ast.Call)
                 and getattr(node.func, "id", "") == "model_registry" and node.args]
        if not calls:
            continue
        flavor = ast.literal_eval(calls[0].args[0])
        values: dict[str, int] = {}
        for node in ast.walk(functions[named[flavor]]):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                values[getattr(node.targets[0], "id", "")] = node.value.value
        for node in ast.walk(functions[named[flavor]]):
            if isinstance(node, ast.keyword) and node.arg and node.arg not in values:
                if isinstance(node.value, ast.Constant):
                    values[node.arg] = node.value.value
                elif isinstance(node.value, ast.Name) and node.value.id in values:
                    values[node.arg] = values[node.value.id]
        out[name] = values
    return out


def test_the_moe_flavors_are_torchtitans_own():
    """Each flavor's shape in :data:`TORCHTITAN_MOE` is the one torchtitan's config registry
    function builds (its model function's numbers, in torchtitan's names)."""
    qwen3 = flavor_values(torchtitan_source("models/qwen3/__init__.py"), "models/qwen3/config_registry.py",
                          "qwen3_configs")
    for name, shape in TORCHTITAN_MOE["qwen3_moe"][1].items():
        theirs = qwen3[name]
        assert (theirs["dim"], theirs["n_layers"], theirs["n_heads"], theirs["n_kv_heads"], theirs["head_dim"],
                theirs["vocab_size"], theirs["moe_hidden_dim"], theirs["num_experts"], theirs["top_k"], 0) == tuple(
            shape.values()), name
    deepseek = flavor_values(torchtitan_source("models/deepseek_v3/__init__.py"),
                             "models/deepseek_v3/config_registry.py", "deepseekv3_configs")
    for name, shape in TORCHTITAN_MOE["deepseek_v3"][1].items():
        theirs = deepseek[name]
        assert (theirs["dim"], theirs["n_layers"], theirs["n_heads"], theirs["vocab_size"], theirs["q_lora_rank"],
                theirs["kv_lora_rank"], theirs["qk_nope_head_dim"], theirs["rope_dim"], theirs["v_head_dim"],
                theirs["moe_hidden_dim"], theirs["num_experts"], theirs["router_top_k"],
                theirs["num_shared_experts"], theirs["dense_hidden_dim"], theirs["n_dense_layers"]) == tuple(
            shape.values()), name


def test_a_qwen3_moe_flavor_runs_with_the_plans_expert_parallel_degree():
    state = plan_of(transformers.Qwen3MoeConfig(**QWEN3_MOE), {"tp": 2, "pp": 2, "dp": 4, "ep": 4},
                    data_parallel="fsdp")
    text = state.export("torchtitan")
    assert text.startswith("# torchtitan 0.3.0: a pipexplore plan, tp 2 · pp 2 · dp 4 · ep 4 (fsdp)")
    _, args = torchtitan_parse(text)
    assert args["--module"] == ["qwen3"] and args["--config"] == ["qwen3_moe_debug"]
    assert args["--parallelism.expert_parallel_degree"] == [str(state.plan.mesh.ep)] == ["4"]
    assert args["--parallelism.module_fqns_per_model_part"][-1].endswith("layers.7,norm,lm_head")
    import tyro

    configs = pytest.importorskip("torchtitan.config.configs")
    from torchtitan.config.manager import ConfigManager, custom_registry

    ConfigManager()
    given = [w for flag, values in args.items() if flag.startswith("--parallelism.") for w in (flag, *values)]
    parallelism = tyro.cli(configs.ParallelismConfig, args=[w.replace("--parallelism.", "--") for w in given],
                           registry=custom_registry)
    assert parallelism.expert_parallel_degree == 4 and parallelism.tensor_parallel_degree == 2
    # torchtitan's sparse mesh: efsdp = dp_shard · cp · tp / ep ranks, each expert's replicas
    assert parallelism.data_parallel_shard_degree * parallelism.context_parallel_degree * \
        parallelism.tensor_parallel_degree // parallelism.expert_parallel_degree == state.plan.mesh.edp == 2


def test_deepseek_v3s_debug_flavor_is_found_by_its_shape():
    state = plan_of(transformers.DeepseekV3Config(**DEEPSEEK_V3), {"tp": 2, "pp": 2, "dp": 4, "ep": 8},
                    data_parallel="fsdp")
    _, args = torchtitan_parse(state.export("torchtitan"))
    assert args["--module"] == ["deepseek_v3"] and args["--config"] == ["deepseek_v3_debugmodel"]
    assert args["--parallelism.expert_parallel_degree"] == ["8"]


def test_what_torchtitans_experts_cannot_run_is_refused_by_name():
    mixtral = plan_of(MIXTRAL, {"tp": 2, "pp": 2, "dp": 4, "ep": 4}, data_parallel="fsdp")
    with pytest.raises(ValueError, match=r"torchtitan 0.3.0 builds no mixtral mixture of experts: its MoE flavors are "
                                         r"qwen3_moe_debug, qwen3_30b_a3b \(qwen3\); deepseek_v3_debugmodel, "
                                         r"deepseek_v3_16b, deepseek_v3_671b \(deepseek_v3\)"):
        mixtral.export("torchtitan")
    other = plan_of(transformers.Qwen3MoeConfig(**{**QWEN3_MOE, "num_hidden_layers": 4}),
                    {"tp": 2, "pp": 2, "dp": 4, "ep": 4}, data_parallel="fsdp")
    with pytest.raises(ValueError, match=r"qwen3_moe flavors are qwen3_moe_debug, qwen3_30b_a3b; this model's shape "
                                         r"\(hidden_size 256, num_hidden_layers 4,"):
        other.export("torchtitan")
    state = plan_of(transformers.Qwen3MoeConfig(**QWEN3_MOE), {"tp": 2, "pp": 2, "dp": 4, "ep": 4, "etp": 2},
                    data_parallel="fsdp")
    with pytest.raises(ValueError, match=r"shards no expert by tensor parallelism .* etp 2 cannot be written"):
        state.export("torchtitan")
    state.set_mesh({"tp": 2, "pp": 2, "dp": 4, "ep": 8}, data_parallel="ddp")
    with pytest.raises(ValueError, match=r"ep borrows from the ranks of dp_shard · cp · tp = 2 \(its data parallelism "
                                         r"is ddp.*ep 8 does not divide them"):
        state.export("torchtitan")
    state.set_mesh({"tp": 2, "pp": 2, "dp": 4, "ep": 2}, data_parallel="ddp")
    _, args = torchtitan_parse(state.export("torchtitan"))
    assert args["--parallelism.expert_parallel_degree"] == ["2"]  # within tp: DDP leaves it whole


# ---- the exports that write pipeline ranks only ------------------------------------------------------------------


def test_the_pipeline_only_exports_refuse_expert_parallelism_by_name():
    state = plan_of(MIXTRAL, {"tp": 2, "pp": 2, "dp": 4, "ep": 4})
    for kind in ("gpipe", "pipelining"):
        with pytest.raises(ValueError, match=rf"mesh \(tp 2 · pp 2 · dp 4 · ep 4\) is planned, but the '{kind}' export "
                                             r"writes pipeline ranks only: its tensor, data and expert parallelism"):
            state.export(kind)


def test_a_plan_that_overlaps_its_all_to_alls_asks_megatron_core_for_the_overlap_or_is_refused_where_it_would_be():
    qwen3 = transformers.Qwen3MoeConfig(**QWEN3_MOE)
    overlapped = plan_of(qwen3, {"tp": 2, "pp": 1, "dp": 8, "ep": 4}, moe_overlap=True)
    config = megatron_config(overlapped.export("megatron"))  # Megatron-Core's own checks of the overlap pass
    assert config.overlap_moe_expert_parallel_comm is True and config.bf16 is True
    assert config.expert_model_parallel_size == 4
    plain = plan_of(qwen3, {"tp": 2, "pp": 1, "dp": 8, "ep": 4})
    assert megatron_config(plain.export("megatron")).overlap_moe_expert_parallel_comm is False
    piped = plan_of(qwen3, {"tp": 2, "pp": 2, "dp": 4, "ep": 4}, moe_overlap=True)
    with pytest.raises(ValueError, match="interleaved schedule, not '1f1b'"):
        piped.export("megatron")
    overlapped.update(checkpoint="always")
    with pytest.raises(ValueError, match="without full recomputation"):
        overlapped.export("megatron")


def test_a_plan_that_sends_a_token_once_a_node_asks_for_megatron_cores_flex_dispatcher_with_its_backend():
    qwen3 = transformers.Qwen3MoeConfig(**QWEN3_MOE)
    for backend in ("hybridep", "deepep"):
        config = megatron_config(plan_of(qwen3, {"tp": 2, "pp": 2, "dp": 4, "ep": 8}, moe_dispatcher=backend)
                                 .export("megatron"))
        assert config.moe_token_dispatcher_type == "flex" and config.moe_flex_dispatcher_backend == backend
