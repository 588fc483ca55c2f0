"""Hugging Face models as they come: built from their default configs with only the sizes changed
(``use_cache=True`` and the default attention, sdpa, left as they are), explored with 2 stages,
each run's loss equal to the unsplit model's, the KV cache off in the traced step and said once in
the notes, and the user's config untouched."""
from __future__ import annotations

import copy
import math
import logging
import pathlib

import pytest
import torch
import transformers  # the test extra

from hf_default_hooks import VOCAB, gpt2, logits_loss
from pipexplore.export.torchrun import torchrun_script
from pipexplore.models import hf, trace
from pipexplore.widgets.state import ExplorerState
from ranks import torchrun_first_loss

logging.getLogger("transformers").setLevel(logging.ERROR)

ROOT = pathlib.Path(__file__).resolve().parents[1]
BATCH, SEQ = 4, 8
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64)
NOTE = ("{}'s config has use_cache=True: training never uses the KV cache, so the traced step runs with "
        "use_cache=False.")


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **SIZES))


def qwen2() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(num_key_value_heads=2, **SIZES))


def bert() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(transformers.BertConfig(**SIZES)).eval()  # eval: dropout off, to compare


def batch(labels: bool = True) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask, **({"labels": ids} if labels else {})}


def model_loss(output, target):
    return output.loss


def reference_loss(model, inputs, loss_fn, target=None) -> float:
    """The unsplit model's loss, as it is (cache on)."""
    return loss_fn(copy.deepcopy(model)(**inputs), target).item()


def explored(model, inputs, **options) -> ExplorerState:
    return ExplorerState(model, inputs, devices=["cpu", "cpu"], chunks=2, profile_repeats=1, calibrate=False,
                         **options)


# One explorer per model: (model, inputs, target, loss_fn, state).
BUILDS = {"gpt2": lambda: (gpt2(), batch(labels=False), batch()["labels"], logits_loss),
          "llama": lambda: (llama(), batch(), None, model_loss),
          "qwen2": lambda: (qwen2(), batch(), None, model_loss),
          "bert": lambda: (bert(), batch(), None, model_loss)}


@pytest.fixture(scope="module", params=sorted(BUILDS))
def explorer(request):
    model, inputs, target, loss_fn = BUILDS[request.param]()
    assert model.config.use_cache is True and model.config._attn_implementation == "sdpa"
    return model, inputs, target, loss_fn, explored(model, inputs, target=target, loss_fn=loss_fn)


def test_default_config_runs_in_two_stages_like_the_unsplit_model(explorer):
    model, inputs, target, loss_fn, state = explorer
    assert state.plan.num_stages == 2
    row = state.runner.run()
    assert row["executor"] == "threads" and set(state.log.measured_timeline()["stage"]) == {0, 1}
    assert row["loss"] == pytest.approx(reference_loss(model, inputs, loss_fn, target), rel=1e-5, abs=1e-6)


def test_a_default_gpt2_without_a_loss_runs_the_synthetic_loss_of_its_logits():
    """As a user first tries it: no loss_fn, no target. The traced step's output is a ModelOutput
    (a dict); the synthetic loss is the mean square of its logits, as the unsplit model's."""
    model, inputs = gpt2(), batch(labels=False)
    state = explored(model, inputs)
    row = state.runner.run()
    with torch.no_grad():
        logits = copy.deepcopy(model)(**inputs, use_cache=False).logits
    assert row["loss"] == pytest.approx(logits.float().pow(2).mean().item(), rel=1e-5)


def test_the_synthetic_loss_names_an_output_it_cannot_use():
    from pipexplore.training import synthetic_loss

    nested = {"logits": torch.ones(2, 3), "extra": [(torch.full((1,), 2.0), torch.arange(3))]}
    assert synthetic_loss(nested).item() == pytest.approx(1.0 + 4.0)
    with pytest.raises(TypeError, match=r"needs a floating tensor in the model's output, got dict: pass loss_fn"):
        synthetic_loss({"ids": torch.arange(3)})


def test_the_cache_note_is_said_once_and_the_users_config_keeps_its_cache(explorer):
    model, _, _, _, state = explorer
    notes = state.all_notes()
    assert notes.count(NOTE.format(type(model).__name__)) == 1
    assert sum("use_cache" in note for note in notes) == 1
    assert model.config.use_cache is True
    assert all(getattr(m, "config", model.config).use_cache is True for m in model.modules())


def test_cache_off_is_for_the_block_only_and_split_traces_a_default_model():
    model, inputs = llama(), batch()
    assert [fqn for fqn, _ in hf.cached_configs(model)] == [""]
    with hf.cache_off(model) as found:
        assert model.config.use_cache is False and len(found) == 1
    assert model.config.use_cache is True
    pipe = trace.split(model, {key: value[:2] for key, value in inputs.items()}, ["model.layers.1"])
    assert pipe.num_stages == 2 and model.config.use_cache is True
    no_cache = copy.deepcopy(model)
    no_cache.config.use_cache = False
    assert hf.cached_configs(no_cache) == [] and hf.cache_note(no_cache) == ""
    with hf.cache_off(no_cache) as found:
        assert found == []


def test_a_wrapped_hugging_face_model_is_named_by_its_fqn():
    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = gpt2()

        def forward(self, input_ids):
            return self.lm(input_ids=input_ids).logits

    note = hf.cache_note(Wrapper())
    assert note.startswith("Wrapper.lm (GPT2LMHeadModel)'s config has use_cache=True")


@pytest.mark.slow
def test_a_default_gpt2_runs_in_processes_like_the_unsplit_model():
    model, inputs = gpt2(), batch(labels=False)
    target = batch()["labels"]
    state = explored(model, inputs, target=target, loss_fn=logits_loss, executor="processes")
    # balanced past the attention mask's preparation, as processes need (a later stage reading the
    # model's inputs is refused; on 1 thread the unconstrained balance chose transformer.wpe)
    names = [str(n) for n in state.layer_table["name"]]
    assert state.layer_table.attrs["first_split"] == names.index("transformer.drop")
    assert state.plan.splits[0] >= names.index("transformer.drop")
    row = state.runner.run(timeout=120)
    assert row["executor"] == "processes" and set(state.log.measured_timeline()["stage"]) == {0, 1}
    assert row["loss"] == pytest.approx(reference_loss(model, inputs, logits_loss, target), rel=1e-5, abs=1e-6)
    assert model.config.use_cache is True


@pytest.mark.slow
def test_exported_torchrun_script_trains_a_default_gpt2(tmp_path):
    import hf_default_hooks as hooks

    model = hooks.build_model()
    inputs, target = hooks.get_batch()  # keyword inputs: the ids and an attention mask
    table = trace.candidates(copy.deepcopy(model), inputs, repeats=1)
    names = table["name"].tolist()
    script = torchrun_script(table, [names.index("transformer.h.1")], hooks="hf_default_hooks", chunks=2,
                             schedule="gpipe", device="cpu")
    assert "model = without_kv_cache(hooks.build_model())" in script
    path = tmp_path / "train_pipeline.py"
    path.write_text(script)
    unsplit = hooks.loss_fn(model(**inputs), target).item()
    assert torchrun_first_loss(path, str(ROOT / "tests")) == pytest.approx(unsplit, rel=1e-5)


def test_the_exported_script_names_the_inputs_a_later_stage_would_read(tmp_path):
    """Split where a later stage reads the model's inputs itself (torch's stages feed them to the
    first only), the script's own check names them before any step; at a block after, none."""
    import hf_default_hooks as hooks

    model = hooks.build_model()
    inputs, _ = hooks.get_batch()
    table = trace.candidates(copy.deepcopy(model), inputs, repeats=1)
    names = table["name"].tolist()
    micro = {key: value[:2] for key, value in inputs.items()}
    script = torchrun_script(table, [names.index("transformer.wpe")], hooks="hf_default_hooks", chunks=2,
                             schedule="gpipe", device="cpu")
    exported: dict = {"__name__": "train_pipeline"}
    exec(compile(script, "train_pipeline.py", "exec"), exported)
    assert exported["call_inputs"](inputs) == ((), inputs) and exported["call_inputs"](micro["input_ids"])[1] == {}
    late = trace.split(copy.deepcopy(model), micro, ["transformer.wpe"])
    assert "attention_mask" in exported["late_inputs"](late)
    assert exported["late_inputs"](trace.split(copy.deepcopy(model), micro, ["transformer.h.1"])) == []
    assert "later stages read the model's inputs" in script


def falcon() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4))


@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_a_traces_own_constants_are_kept_and_a_falcon_runs_like_the_unsplit_model(executor):
    """Falcon's attention builds tensors in its forward, which torch.export lifts into constants
    of the traced stage (``lifted_tensor_0``) that no parameter or buffer of the model holds: the
    kept pipe keeps them (before: "'NoneType' object has no attribute 'detach'" in every run)."""
    model, inputs, target = falcon(), batch(labels=False), batch()["labels"]
    state = explored(model, inputs, loss_fn=logits_loss, target=target, executor=executor)
    row = state.runner.run()
    assert row["loss"] == pytest.approx(reference_loss(model, inputs, logits_loss, target), rel=1e-5, abs=1e-6)
    again = state.runner.run()  # from the kept pipe, not traced again
    assert math.isfinite(again["loss"])
