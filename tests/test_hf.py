"""Hugging Face models as they are (tiny configs, CPU, no downloads): split points between their
blocks, keyword inputs, ModelOutput losses, tied weights, and pipelined steps equal to the unsplit model."""
from __future__ import annotations

import copy
import logging

import pytest
import torch

from pipexplore.models import trace
from pipexplore.executors import forkserver, pool
from pipexplore.plan import Plan
from pipexplore.executors.traced import run_traced_step

logging.getLogger("transformers").setLevel(logging.ERROR)

VOCAB, BATCH, SEQ = 64, 8, 8
COMMON = dict(vocab_size=VOCAB, attn_implementation="eager", use_cache=False, bos_token_id=0, eos_token_id=0,
              pad_token_id=0)


def gpt2() -> torch.nn.Module:
    import transformers  # the test extra, imported where used (not at collection)

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_positions=32, n_embd=32, n_layer=4, n_head=4, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, **COMMON)
    return transformers.GPT2LMHeadModel(config)


def llama() -> torch.nn.Module:
    import transformers  # the test extra, imported where used (not at collection)

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=False, **COMMON)
    return transformers.LlamaForCausalLM(config)


def bert() -> torch.nn.Module:
    import transformers  # the test extra, imported where used (not at collection)

    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, **COMMON)
    return transformers.BertForMaskedLM(config)


def batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def model_loss(output, target):
    """The loss the model computed from ``labels``, read as an attribute of its ModelOutput."""
    return output.loss


def logits_loss(output, target):
    """A loss of the logits, read by key: the ModelOutput is rebuilt as the model returns it."""
    logits = output["logits"]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


MODELS = {"gpt2": (gpt2, "transformer.h"), "llama": (llama, "model.layers"), "bert": (bert, "bert.encoder.layer")}


def test_candidates_are_the_blocks_wherever_they_sit():
    assert [name for name, _ in trace.candidate_modules(gpt2())] == [
        "transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0", "transformer.h.1",
        "transformer.h.2", "transformer.h.3", "transformer.ln_f", "lm_head"]
    assert [name for name, _ in trace.candidate_modules(llama())] == [
        "model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2", "model.layers.3", "model.norm",
        "model.rotary_emb", "lm_head"]
    assert [name for name, _ in trace.candidate_modules(bert())] == [
        "bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1", "bert.encoder.layer.2",
        "bert.encoder.layer.3", "cls"]
    children = [name for name, _ in trace.candidate_modules(gpt2(), granularity="children")]
    assert children[3:7] == ["transformer.h.0.ln_1", "transformer.h.0.attn", "transformer.h.0.ln_2",
                             "transformer.h.0.mlp"]


def test_profile_runs_the_model_with_keyword_inputs_in_execution_order():
    table = trace.candidates(llama(), batch(), loss_fn=model_loss, repeats=1)
    assert table["name"].tolist() == ["model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1",
                                      "model.layers.2", "model.layers.3", "model.norm", "lm_head"]
    # the rotary embedding's (cos, sin) feed every layer: values that skip over blocks
    assert table.loc[1, "stash"] == "v1>3,v1>4,v1>5"
    assert table.loc[2, "pop"] == "v0>2"  # the embedding's output skips the rotary embedding
    assert table.loc[2, "output_bytes"] == BATCH * SEQ * 32 * 4
    assert (table.loc[2:5, "forward"] > 0).all() and (table.loc[2:5, "backward"] > 0).all()


def reference_step(model, inputs, loss_fn, target=None):
    reference = copy.deepcopy(model)
    loss = loss_fn(reference(**inputs), target)
    loss.backward()
    return loss.item(), dict(reference.named_parameters(remove_duplicate=False))


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("blocks,schedule", [((2,), "1f1b"), ((1, 3), "gpipe")])
def test_pipelined_step_equals_the_unsplit_model(name, blocks, schedule):
    build, prefix = MODELS[name]
    model, inputs = build(), batch()
    table = trace.candidates(copy.deepcopy(model), inputs, loss_fn=model_loss, repeats=1)
    names = table["name"].tolist()
    splits = tuple(names.index(f"{prefix}.{k}") for k in blocks)
    plan = Plan(table, splits, ("cpu",) * (len(splits) + 1), chunks=4, schedule=schedule, checkpoint="except_last")
    result = run_traced_step(model, inputs, plan, loss_fn=model_loss, warmup=0, repeats=1, return_grads=True)
    loss, named = reference_step(model, inputs, model_loss)
    assert result.loss == pytest.approx(loss, rel=1e-5)
    grads = result.metrics["grads"]
    stages = {key.split(".", 1)[0] for key in grads}
    assert stages == {str(s) for s in range(len(splits) + 1)}
    # every trained parameter of the model has its gradient from some stage (tied ones by any of their names)
    covered = {id(named[key.split(".", 1)[1]]) for key in grads}
    assert covered == {id(p) for p in named.values() if p.grad is not None}
    for key, grad in grads.items():
        torch.testing.assert_close(grad, named[key.split(".", 1)[1]].grad, rtol=1e-4, atol=1e-6)


def test_loss_fn_reads_the_model_output_by_key_and_gets_the_target():
    model, inputs = gpt2(), batch()
    target = torch.roll(inputs["input_ids"], -1, dims=1)
    del inputs["labels"]
    table = trace.candidates(copy.deepcopy(model), inputs, loss_fn=logits_loss, target=target, repeats=1)
    plan = Plan(table, (table["name"].tolist().index("transformer.h.2"),), ("cpu", "cpu"), chunks=2,
                schedule="zero-bubble", checkpoint="never")
    result = run_traced_step(model, inputs, plan, target=target, loss_fn=logits_loss, warmup=0, repeats=1,
                             return_grads=True)
    loss, named = reference_step(model, inputs, logits_loss, target)
    assert result.loss == pytest.approx(loss, rel=1e-5)
    for key, grad in result.metrics["grads"].items():
        torch.testing.assert_close(grad, named[key.split(".", 1)[1]].grad, rtol=1e-4, atol=1e-6)


def test_tied_embedding_and_head_in_different_stages_train_as_one_weight():
    model, inputs = gpt2(), batch()
    assert model.lm_head.weight is model.transformer.wte.weight
    table = trace.candidates(copy.deepcopy(model), inputs, loss_fn=model_loss, repeats=1)
    assert table.set_index("name").loc[["transformer.wte", "lm_head"], "shared"].tolist() == ["lm_head.weight"] * 2
    splits = (table["name"].tolist().index("transformer.h.2"),)
    plan = Plan(table, splits, ("cpu", "cpu"), chunks=4, schedule="1f1b", checkpoint="never")
    result = run_traced_step(model, inputs, plan, loss_fn=model_loss, warmup=0, repeats=1, return_grads=True)
    grads = result.metrics["grads"]
    # each stage's copy holds the gradient of both uses, as the one tied weight of the unsplit model does
    _, named = reference_step(model, inputs, model_loss)
    torch.testing.assert_close(grads["0.transformer.wte.weight"], named["transformer.wte.weight"].grad,
                               rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grads["1.lm_head.weight"], named["transformer.wte.weight"].grad, rtol=1e-4, atol=1e-6)


def test_tied_copies_stay_equal_over_optimizer_steps():
    from pipexplore.models.inputs import first_microbatch
    from pipexplore.executors.traced import TracedExecutor

    model, inputs = gpt2(), batch()
    pipe = trace.split(copy.deepcopy(model), first_microbatch(inputs, 2), ["transformer.h.2"])
    executor = TracedExecutor(pipe, devices=["cpu", "cpu"], chunks=2, schedule="1f1b", loss_fn=model_loss)
    optimizer = torch.optim.Adam(executor.parameters(), lr=0.01)
    reference = copy.deepcopy(model)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    for _ in range(3):
        optimizer.zero_grad()
        loss = executor.step(inputs).loss
        optimizer.step()
        reference_optimizer.zero_grad()
        reference_loss = reference(**inputs).loss
        reference_loss.backward()
        reference_optimizer.step()
        assert loss == pytest.approx(reference_loss.item(), rel=1e-4)
    first = executor.stage_modules[0].get_parameter("transformer.wte.weight")
    last = executor.stage_modules[1].get_parameter("lm_head.weight")
    assert first is not last
    torch.testing.assert_close(first, last, rtol=0, atol=0)
    torch.testing.assert_close(first, reference.transformer.wte.weight, rtol=1e-4, atol=1e-5)


# GPT-2 only: what processes add (keyword inputs sent to the first rank, a tied weight copied per
# stage) is the same for every model; Llama's graph runs split in this process above.
@pytest.mark.parametrize("name", ["gpt2"])
def test_keyword_inputs_run_in_processes_like_the_unsplit_model(name):
    from pipexplore.executors.distributed import run_processes

    build, prefix = MODELS[name]
    model, inputs = build(), batch()
    inputs.pop("labels")  # torch's stages take the model's inputs in the first stage only: the labels are the target
    target = batch()["labels"]
    table = trace.candidates(copy.deepcopy(model), inputs, loss_fn=logits_loss, target=target, repeats=1)
    splits = (table["name"].tolist().index(f"{prefix}.2"),)
    plan = Plan(table, splits, ("cpu", "cpu"), chunks=2, schedule="gpipe", checkpoint="never", executor="processes")
    result = run_processes(model, inputs, plan, target=target, loss_fn=logits_loss, warmup=0, return_grads=True,
                           timeout=120)
    loss, named = reference_step(model, inputs, logits_loss, target)
    assert result.loss == pytest.approx(loss, rel=1e-5)
    assert set(result.timeline["stage"]) == {0, 1}
    if forkserver.supported():  # the model's transformers modules: imported once, by the fork server
        assert f"transformers.models.{name}.modeling_{name}" in pool._server.preloaded
    grads = {key.split(".", 1)[1]: grad for key, grad in result.metrics["grads"].items()}
    assert set(grads) >= {key for key, p in named.items() if p.grad is not None}
    # torch's stages each hold a copy of the tied embedding and head: each copy has both uses' gradient,
    # as the model's one tensor (named under both names) has
    for key, grad in grads.items():
        torch.testing.assert_close(grad, named[key].grad, rtol=1e-4, atol=1e-6, msg=key)


def test_inputs_read_by_a_later_stage_are_refused_for_processes_before_any_starts():
    from pipexplore.executors.distributed import run_processes

    model, inputs = gpt2(), batch()
    table = trace.candidates(copy.deepcopy(model), inputs, loss_fn=model_loss, repeats=1)
    splits = (table["name"].tolist().index("transformer.h.2"),)
    plan = Plan(table, splits, ("cpu", "cpu"), chunks=2, schedule="gpipe", executor="processes")
    with pytest.raises(ValueError, match=r"later stages read 'labels' \(stage 1\): run in this process"):
        run_processes(model, inputs, plan, loss_fn=model_loss, warmup=0)


def test_explorer_takes_a_hugging_face_model_with_keyword_inputs_and_runs_it_in_process():
    from pipexplore.widgets import explore

    model, inputs = gpt2(), batch()
    before = copy.deepcopy(model.state_dict())
    ex = explore(model, inputs, loss_fn=model_loss, devices=["cpu", "cpu"], chunks=4, profile_repeats=1)
    assert ex.traced and ex.plan.executor == "threads"
    names = ex.layer_table["name"].tolist()
    ex.splits = [names.index("transformer.h.2")]
    assert ex.module_fqns_per_model_part[1][0] == "transformer.h.2"
    assert ex.shared_parameters() == {"lm_head.weight": [0, 1]}
    assert "parameters used by several stages: lm_head.weight (stages 0, 1)" in ex.w_stages.value
    row = ex.run()
    assert row["executor"] == "threads" and set(ex.timeline("measured")["stage"]) == {0, 1}
    assert {"forward", "backward", "recompute"} <= set(ex.timeline("measured")["phase"])
    # the steps trained a copy: the user's model and its tie are as they were
    assert model.lm_head.weight is model.transformer.wte.weight
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_explorer_offers_the_children_of_blocks():
    from pipexplore.widgets import explore

    ex = explore(gpt2(), batch(), loss_fn=model_loss, devices=["cpu", "cpu"], chunks=2, profile_repeats=1,
                 granularity="children")
    names = ex.layer_table["name"].tolist()
    assert "transformer.h.1.attn" in names and "transformer.h.1.mlp" in names and "transformer.h.1" not in names
    with pytest.raises(ValueError, match="granularity must be one of 'blocks', 'children', got 'layers'"):
        explore(gpt2(), batch(), loss_fn=model_loss, granularity="layers")


@pytest.mark.gpu
def test_gpt2_small_split_in_four_on_one_gpu_equals_the_unsplit_model():
    import transformers  # the test extra, imported where used (not at collection)

    torch.manual_seed(0)
    config = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
                                     use_cache=False)  # GPT-2 small: 12 blocks of 768, vocabulary 50257
    model = transformers.GPT2LMHeadModel(config).cuda()
    ids = torch.randint(0, config.vocab_size, (8, 128), device="cuda")
    inputs = {"input_ids": ids, "labels": ids}
    table = trace.candidates(copy.deepcopy(model), inputs, loss_fn=model_loss, repeats=1)
    names = table["name"].tolist()
    splits = tuple(names.index(f"transformer.h.{k}") for k in (3, 6, 9))
    plan = Plan(table, splits, ("cuda:0",) * 4, chunks=4, schedule="1f1b", checkpoint="except_last")
    result = run_traced_step(model, inputs, plan, loss_fn=model_loss, warmup=0, repeats=1, return_grads=True)
    loss, named = reference_step(model, inputs, model_loss)
    assert result.loss == pytest.approx(loss, rel=1e-4)
    assert set(result.timeline["device"]) == {"cuda:0"} and set(result.timeline["stage"]) == {0, 1, 2, 3}
    for key, grad in result.metrics["grads"].items():
        torch.testing.assert_close(grad, named[key.split(".", 1)[1]].grad.cpu(), rtol=1e-3, atol=1e-5)
