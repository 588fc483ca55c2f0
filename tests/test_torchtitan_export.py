"""A plan with a mesh as the command that runs it with torchtitan 0.3.0: every argument in the form
its config manager reads (tyro's ``--section.field value`` over torchtitan's own config dataclasses,
parsed by them where torchtitan installs), its stages as torchtitan's Llama names its modules, and
what torchtitan does not build or run refused by name."""
from __future__ import annotations

import logging
import shlex

import pytest
import torch

from models import meta_llama
from pipexplore.export.torchtitan import TORCHTITAN_VERSION, torchtitan_fqns
from pipexplore.widgets.state import ExplorerState

logging.getLogger("transformers").setLevel(logging.ERROR)

#: torchtitan 0.3.0's fields of the sections the command sets (torchtitan/config/configs.py:
#: ParallelismConfig, TrainingConfig), with their types there.
PARALLELISM = {"data_parallel_replicate_degree": int, "data_parallel_shard_degree": int,
               "fsdp_reshard_after_forward": ("default", "always", "never"), "tensor_parallel_degree": int,
               "enable_sequence_parallel": bool, "context_parallel_degree": int, "pipeline_parallel_degree": int,
               "pipeline_parallel_schedule": str, "pipeline_parallel_microbatch_size": int,
               "module_fqns_per_model_part": list}
TRAINING = {"local_batch_size": int, "global_batch_size": int, "seq_len": int}
IDS = torch.zeros(4, 1024, dtype=torch.long, device="meta")


@pytest.fixture(scope="module")
def state():
    model = meta_llama(32, heads=32, kv_heads=8, hidden=4096, ffn=14336, vocab=128256)  # Llama 3 8B's shape
    return ExplorerState(model, IDS, devices=["H100"] * 32, gpus_per_node=8, chunks=4, schedule="1f1b",
                         checkpoint="always", mesh={"tp": 4, "pp": 4, "dp": 2}, data_parallel="fsdp")


def words(text: str) -> list[str]:
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    return shlex.split(" ".join(line.rstrip("\\ ") for line in lines))


def parse(text: str) -> tuple[list[str], dict[str, list[str]]]:
    """The command's words before the trainer's arguments, and each flag's values (none: a boolean
    flag; a subcommand: its word, no values)."""
    said = words(text)
    start = said.index("torchtitan.train") + 1
    flags: dict[str, list[str]] = {}
    flag = None
    for word in said[start:]:
        if word.startswith("--") or ":" in word:
            flag = word
            flags[flag] = []
        else:
            flags[flag].append(word)
    return said[:start], flags


def test_every_argument_is_one_torchtitan_reads(state):
    text = state.export("torchtitan")
    assert text.startswith(f"# torchtitan {TORCHTITAN_VERSION}: a pipexplore plan, tp 4 · pp 4 · dp 2 (fsdp), 1f1b")
    launch, args = parse(text)
    assert launch == ["torchrun", "--nnodes", "4", "--nproc-per-node", "8", "-m", "torchtitan.train"]
    assert args["--module"] == ["llama3"] and args["--config"] == ["llama3_8b"]
    for flag, values in args.items():
        if flag in ("--module", "--config") or not flag.startswith("--"):
            continue
        section, _, field = flag[2:].partition(".")
        kind = {"parallelism": PARALLELISM, "training": TRAINING}[section][field.removeprefix("no_")]
        if kind is int:
            assert len(values) == 1 and int(values[0]) >= 1, flag
        elif kind is bool:
            assert values == [], flag  # tyro's flag, or its no_ flag
        elif kind is list:  # a list of lists: each inner one comma-joined
            assert values and all(v and not v.startswith(",") and not v.endswith(",") for v in values), flag
        elif isinstance(kind, tuple):
            assert len(values) == 1 and values[0] in kind, flag
        else:
            assert len(values) == 1, flag
    one = {flag: values[0] for flag, values in args.items() if len(values) == 1}
    assert one["--parallelism.tensor_parallel_degree"] == "4" and one["--parallelism.pipeline_parallel_degree"] == "4"
    assert one["--parallelism.data_parallel_shard_degree"] == "2"
    assert one["--parallelism.data_parallel_replicate_degree"] == "1"
    assert one["--parallelism.fsdp_reshard_after_forward"] == "never"
    assert "--parallelism.enable_sequence_parallel" in args
    assert one["--parallelism.pipeline_parallel_schedule"] == "1F1B"
    assert one["--parallelism.pipeline_parallel_microbatch_size"] == "1"  # 4 rows, 4 micro-batches
    assert one["--training.local_batch_size"] == "4" and one["--training.global_batch_size"] == "8"
    assert one["--training.seq_len"] == "1024"
    assert "activation-checkpoint:full" in args
    parts = [value.split(",") for value in args["--parallelism.module_fqns_per_model_part"]]
    plan = state.plan
    assert parts == torchtitan_fqns(plan.layer_table, list(plan.splits)) and len(parts) == 4
    assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "lm_head"]
    assert [name for part in parts for name in part] == (["tok_embeddings"] + [f"layers.{i}" for i in range(32)]
                                                         + ["norm", "lm_head"])


def test_ddp_replicates_and_a_step_without_checkpointing_says_none(state):
    state.set_mesh({"tp": 4, "pp": 4, "dp": 2}, data_parallel="ddp")
    state.update(checkpoint="never")
    try:
        _, args = parse(state.export("torchtitan"))
        assert args["--parallelism.data_parallel_replicate_degree"] == ["2"]
        assert args["--parallelism.data_parallel_shard_degree"] == ["1"]
        assert "activation-checkpoint:none" in args
    finally:
        state.set_mesh({"tp": 4, "pp": 4, "dp": 2}, data_parallel="fsdp")
        state.update(checkpoint="always")


def test_torchtitans_own_config_dataclasses_read_the_arguments(state):
    import tyro

    configs = pytest.importorskip("torchtitan.config.configs")  # scripts/setup.sh installs it
    from dataclasses import field, make_dataclass

    Sections = make_dataclass("Sections", [  # the trainer config's two sections, as its own dataclasses
        ("parallelism", configs.ParallelismConfig, field(default_factory=configs.ParallelismConfig)),
        ("training", configs.TrainingConfig, field(default_factory=configs.TrainingConfig))])

    from torchtitan.config.manager import ConfigManager, custom_registry

    ConfigManager()  # registers torchtitan's own parsing rules (a list of lists, …)
    _, args = parse(state.export("torchtitan"))
    given = [w for flag, values in args.items() if flag.startswith(("--parallelism.", "--training."))
             for w in (flag, *values)]
    parsed = tyro.cli(Sections, args=given, registry=custom_registry)
    plan = state.plan
    assert parsed.parallelism.tensor_parallel_degree == 4 and parsed.training.seq_len == 1024
    assert parsed.parallelism.enable_sequence_parallel is True
    assert parsed.parallelism.module_fqns_per_model_part == torchtitan_fqns(plan.layer_table, list(plan.splits))


def test_what_torchtitan_does_not_build_or_run_is_refused_by_name(state):
    small = ExplorerState(meta_llama(4, heads=16), IDS[:, :256], devices=["H100"] * 8, gpus_per_node=8, chunks=4,
                          schedule="1f1b", mesh={"tp": 2, "pp": 2, "dp": 2}, data_parallel="fsdp")
    with pytest.raises(ValueError, match=r"Llama 3 flavors are llama3_8b, llama3_70b, llama3_405b; this model's shape "
                                         r"\(hidden 1024, 4 layers"):
        small.export("torchtitan")
    state.set_mesh({"tp": 4, "pp": 4, "dp": 2}, data_parallel="zero1")
    try:
        with pytest.raises(ValueError, match="ZeRO-1 is Megatron-LM's distributed optimizer"):
            state.export("torchtitan")
    finally:
        state.set_mesh({"tp": 4, "pp": 4, "dp": 2}, data_parallel="fsdp")
    from pipexplore.export.torchtitan import torchtitan_command
    gpt2 = type("Config", (), {"model_type": "gpt2"})()
    with pytest.raises(ValueError, match="gpt2 is not one this export writes"):
        torchtitan_command(state.plan, config=gpt2)
