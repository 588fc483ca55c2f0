"""A stage's weights from a safetensors checkpoint (``pipexplore.export.weights``), as an exported
script's ``init_stage`` fills a stage of a model built on the meta device."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from pipexplore.export.weights import checkpoint_files, load_stage
from pipexplore.widgets.state import ExplorerState


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def _sharded(tmp_path, state: dict) -> None:
    """Two shards and their index, as Hugging Face writes them."""
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in halves.items():
        save_file({name: state[name].contiguous() for name in part}, str(tmp_path / file))
    weight_map = {name: file for file, part in halves.items() for name in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_a_stage_is_filled_by_its_names_and_what_is_not_there_is_returned(tmp_path):
    torch.manual_seed(0)
    source = _net()
    state = {k: v for k, v in source.state_dict().items() if k != "1.running_var"}
    save_file(state, str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        stage = _net()
    stage.to_empty(device="cpu")
    assert load_stage(stage, tmp_path) == ["1.running_var"]
    for name, value in state.items():
        torch.testing.assert_close(stage.state_dict()[name], value, rtol=0, atol=0)


def test_shards_are_opened_only_for_the_tensors_the_stage_holds(tmp_path):
    torch.manual_seed(0)
    source = _net()
    _sharded(tmp_path, source.state_dict())
    files = checkpoint_files(tmp_path)
    assert set(files) == set(source.state_dict()) and {f.name for f in files.values()} == {
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    first_shard = [name for name, f in files.items() if f.name.startswith("model-00001")]
    (tmp_path / "model-00002-of-00002.safetensors").unlink()  # a rank whose stage needs none of it
    holder = nn.Module()
    for name in first_shard:
        holder.register_buffer(name.replace(".", "_"), torch.empty_like(source.state_dict()[name]))
    aliases = {name.replace(".", "_"): name for name in first_shard}
    assert load_stage(holder, tmp_path, aliases=aliases) == []
    for alias, name in aliases.items():
        torch.testing.assert_close(holder.get_buffer(alias), source.state_dict()[name], rtol=0, atol=0)


def test_a_wrong_shape_and_a_missing_checkpoint_are_named(tmp_path):
    save_file({"0.weight": torch.zeros(3, 4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"0.weight: the checkpoint's 0.weight has shape \(3, 4\), the stage's "
                                         r"tensor \(4, 4\)"):
        load_stage(_net(), tmp_path)
    with pytest.raises(FileNotFoundError, match="no safetensors checkpoint at .*empty: give a .safetensors file"):
        load_stage(_net(), tmp_path / "empty")


LLAMA_HOOKS = '''
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from pipexplore.export.weights import load_stage

CHECKPOINT = {checkpoint!r}
CONFIG = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def build_model():
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(CONFIG)


def init_stage(module):
    left = load_stage(module, CHECKPOINT)  # the rotary embedding's buffers are in no checkpoint
    rotary = dict(LlamaRotaryEmbedding(config=CONFIG).named_buffers(prefix="model.rotary_emb"))
    for name in left:
        module.get_buffer(name).copy_(rotary[name])
    print("left", ",".join(left), flush=True)


def get_batch():
    ids = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(1))
    return {{"input_ids": ids}}, ids


def loss_fn(output, target):
    logits = output.logits if hasattr(output, "logits") else output
    logits = logits[0] if isinstance(logits, (tuple, list)) else logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
'''


def test_a_llama_on_meta_trains_from_its_sharded_checkpoint(tmp_path):
    """The whole path of a model no host holds: saved sharded (as Hugging Face saves one), built on
    meta by the hooks, each rank reading only its stage's tensors: the first loss is the loss of
    the model the checkpoint was saved from."""
    import transformers

    from ranks import run_ranks

    torch.manual_seed(0)
    hooks = LLAMA_HOOKS.format(checkpoint=str(tmp_path / "ckpt"))
    namespace: dict = {}
    exec(hooks, namespace)  # noqa: S102
    saved = transformers.LlamaForCausalLM(namespace["CONFIG"])
    saved.save_pretrained(tmp_path / "ckpt", max_shard_size="40KB")
    files = checkpoint_files(tmp_path / "ckpt")
    assert set(files) == set(saved.state_dict()) and len(set(files.values())) > 2  # shards, and an index
    (tmp_path / "llama_ckpt_hooks.py").write_text(hooks)
    ids = torch.zeros(4, 8, dtype=torch.long, device="meta")
    planned = ExplorerState(namespace["build_model"](), {"input_ids": ids}, devices=["H100"] * 2, chunks=2,
                            schedule="1f1b", checkpoint="never", calibrate=False)
    script = tmp_path / "train_pipeline.py"
    script.write_text(planned.export("torchrun", hooks="llama_ckpt_hooks"))
    outputs = run_ranks(script, ["--device", "cpu"], ranks=2, pythonpath=str(tmp_path))
    assert any(line.startswith("left model.rotary_emb.") for line in outputs[0].splitlines())
    inputs, target = namespace["get_batch"]()
    expected = namespace["loss_fn"](saved(**inputs), target).item()
    loss = float(outputs[1].split("step 0 loss=")[1].split()[0])
    assert loss == pytest.approx(expected, rel=1e-5)


def test_without_safetensors_the_package_to_install_is_named(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "safetensors", None)  # as if not installed
    with pytest.raises(ImportError, match="needs the safetensors package: pip install safetensors"):
        load_stage(_net(), tmp_path)
