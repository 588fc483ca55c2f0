"""The transformers zoo, planned on meta: architectures built from their own config class's defaults
(only the number of layers cut to 4), planned for catalogue GPUs with block candidates, a finite
predicted step, and a moved split predicted again. Decoder-only LMs of every family (dense, tied and
untied heads, parallel residual, ALiBi, rotary, sliding window, multi-query, mixture of experts with
routed and shared experts, multi-latent attention), encoders (a masked LM, an image classifier) and
encoder-decoders (whose decoder reads the encoder's output across stages)."""
from __future__ import annotations

import logging
import math
import warnings

import pytest
import torch
import transformers  # the test extra

from pipexplore.widgets.state import ExplorerState
from tests.zoo_models import MOE, ZOO, on_meta, tiny

logging.getLogger("transformers").setLevel(logging.ERROR)


def test_the_zoo_holds_every_family_the_issue_names():
    assert len(ZOO) >= 25 and MOE <= set(ZOO) and {"bert", "vit", "t5", "bart", "bloom", "falcon"} <= set(ZOO)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_planned_on_meta_for_catalogue_gpus(name):
    model, sample = on_meta(name)
    state = ExplorerState(model, sample, devices=["H100"] * 4, gpus_per_node=8, chunks=4)
    table = state.layer_table
    assert all(p.is_meta for p in model.parameters())  # nothing made real
    assert len(table) >= 5 and state.plan.num_stages == 4
    blocks = table[table["forward_flops"] > 0]
    assert len(blocks) >= 4 and not table["forward_flops"].isna().any(), table[["name", "forward_flops"]]
    step = state.figures()["predicted_step_time"]
    assert math.isfinite(step) and step > 0
    moved = list(state.plan.splits)
    moved[0] += 1 if moved[0] + 1 < moved[1] else -1
    state.update(splits=moved)
    assert math.isfinite(state.figures()["predicted_step_time"])


@pytest.mark.parametrize("name", sorted(MOE))
def test_a_mixture_of_experts_counts_its_experts(name):
    """Their experts run torch's grouped GEMM, whose meta kernel takes bfloat16 only: counted as if
    in it, with its own FLOP formula (2·rows·k·n a group), a decoder layer's experts dominate it."""
    model, sample = on_meta(name)
    from pipexplore.models.meta import count_layers

    counted = count_layers(model, sample, microbatch_rows=2)
    ops = counted.attrs["ops"]
    grouped = ops[ops["op"] == "aten._grouped_mm"]
    assert len(grouped) and (grouped["flops"] > 0).all() and (grouped["dtype"] == "float32").all()
    config = model.config
    rows = 2 * 128 * config.num_experts_per_tok  # every token, once per expert it is routed to
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    expected = 2 * rows * config.hidden_size * width * 3  # gate, up and down projections
    forward = grouped[(grouped["phase"] == "forward") & (grouped["kind"] == grouped["kind"].iloc[-1])]
    assert forward["flops"].sum() == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_an_encoder_decoder_without_decoder_inputs_is_refused_naming_them(name):
    model, sample = on_meta(name)
    with pytest.raises(ValueError, match=r"is an encoder-decoder: its decoder needs decoder_input_ids of shape "
                                         r"\(batch, target length\) \(or labels.*the sample has input_ids$"):
        ExplorerState(model, {"input_ids": sample["input_ids"]}, devices=["H100"] * 2, chunks=2)
    assert ExplorerState(model, sample, devices=["H100"] * 2, chunks=2).plan.num_stages == 2  # with them: planned


def test_an_image_model_given_token_ids_is_refused_naming_its_input():
    model, _ = on_meta("vit")
    ids = torch.zeros(8, 64, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match=r"ViTForImageClassification takes images: pixel_values of shape "
                                         r"\(batch, 3, 224, 224\), floating; "
                                         r"the sample is a int64 tensor of shape \(8, 64\)"):
        ExplorerState(model, ids, devices=["H100"] * 2, chunks=2)


def unsplit_loss(model, sample) -> float:
    """The unsplit model's synthetic loss (no loss_fn given: the mean square of every floating output)."""
    import copy

    from pipexplore.training import synthetic_loss

    copied = copy.deepcopy(model)
    extra = {"use_cache": False} if getattr(model.config, "use_cache", None) is not None else {}
    with torch.no_grad():
        output = copied(**sample, **extra) if isinstance(sample, dict) else copied(sample, **extra)
    return synthetic_loss(output).item()


#: What the processes executor refuses, by name: an encoder-decoder returns its encoder's last hidden
#: state beside the logits, which torch's stages never hand loss_fn (the last stage's outputs only);
#: or, where the balanced split (from measured times) begins the second stage before the decoder
#: reads its inputs, those inputs, which torch's stages feed to the first stage only.
ENCODER_DECODER = (r"returns values that stages before the last make|"
                   r"later stages read 'decoder_input_ids' \(stage 1\)")
REFUSED_IN_PROCESSES = {"t5": ENCODER_DECODER, "bart": ENCODER_DECODER}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_runs_on_two_cpu_stages_and_in_processes_with_the_unsplit_models_loss(name):
    """On two CPU stages (threads), then one process a stage (torch.distributed.pipelining, gloo),
    which reuses the export of the model the first run made (one test: the export is kept for the
    next split of the same model): every value crossing a stage laid out contiguously (BERT's,
    ViT's, OPT's, GPT-J's and CodeGen's failed before with "input tensor has to be contiguous"),
    each first loss the unsplit model's; or refused by name."""
    model, sample = tiny(name)
    expected = unsplit_loss(model, sample)
    state = ExplorerState(model, sample, devices=["cpu", "cpu"], chunks=2, profile_repeats=1, calibrate=False,
                          profile_stages=False)  # (the loss is what this holds: no stage timings needed)
    assert state.plan.num_stages == 2 and state.traced
    row = state.runner.run()
    assert row["executor"] == "threads"
    assert row["loss"] == pytest.approx(expected, rel=1e-5, abs=1e-7)
    state = ExplorerState(model, sample, devices=["cpu", "cpu"], chunks=2, profile_repeats=1, calibrate=False,
                          executor="processes", profile_stages=False)
    if name in REFUSED_IN_PROCESSES:
        with pytest.raises(ValueError, match=REFUSED_IN_PROCESSES[name]):
            state.runner.run()
        return
    row = state.runner.run()
    assert row["executor"] == "processes"
    assert row["loss"] == pytest.approx(expected, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_a_tied_embedding_is_a_candidate_where_forward_calls_it(name):
    """T5's and BART's ``shared`` embedding is also their encoder's and decoder's ``embed_tokens``:
    it is a candidate once, as ``encoder.embed_tokens`` (forward never calls ``shared`` by that name),
    and the blocks are profiled as the stages their runs trace, no fallback warned."""
    model, sample = tiny(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        state = ExplorerState(model, sample, devices=["cpu", "cpu"], chunks=2, profile_repeats=1, calibrate=False)
    names = list(state.layer_table["name"])
    embedding = "encoder.embed_tokens" if name == "t5" else "model.encoder.embed_tokens"
    assert embedding in names and not any(n.endswith("shared") for n in names)
    assert not any(n.endswith("dropout") for n in names)  # T5's stacks call theirs again and again
    assert state.layer_table.attrs.get("stage_extra")  # profiled as the traced stages


def test_a_large_model_here_is_timed_block_by_block_each_kind_once(monkeypatch):
    """A model whose step is too costly for whole passes here (the threshold lowered to take GPT-2
    of four identical blocks as one) is timed block by block with its own weights, each kind of
    identical block once; a note says so with the timing's spread; it runs with the unsplit loss."""
    from pipexplore.models import blockwise, profile

    monkeypatch.setattr(profile, "BLOCKWISE_STEP_FLOPS", 0.0)
    timed: list[str] = []
    real_time_kind = blockwise._time_kind
    monkeypatch.setattr(blockwise, "_time_kind", lambda block, *a, **k: timed.append(type(block).__name__)
                        or real_time_kind(block, *a, **k))
    small, sample = tiny("gpt2")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(type(small.config)(**{**small.config.to_dict(), "n_layer": 4})).eval()
    state = ExplorerState(model, sample, devices=["cpu", "cpu"], chunks=2, profile_repeats=1, calibrate=False)
    table = state.layer_table
    assert table.attrs["source"] == "blockwise" and timed.count("GPT2Block") == 1
    assert (table[table["type"] == "GPT2Block"]["forward"].nunique() == 1)  # one timing, every block
    assert any("4 × GPT2Block (spread" in note for note in state.notes)
    assert (table["optimizer"] > 0).any()
    row = state.runner.run()
    assert row["loss"] == pytest.approx(unsplit_loss(model, sample), rel=1e-5, abs=1e-7)
