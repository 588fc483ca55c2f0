"""The transformers zoo in other processes: every architecture with tiny real weights run one process
a stage (torch.distributed.pipelining, gloo), and some through the exported torchrun script, each
first loss the unsplit model's; what cannot run so refused by name. (A file of its own: the suite's
workers take a file each.)"""
from __future__ import annotations

import logging

import pytest

from pipexplore.widgets.state import ExplorerState
from tests.test_zoo import ZOO, tiny, unsplit_loss

logging.getLogger("transformers").setLevel(logging.ERROR)


#: What the processes executor refuses, by name: an encoder-decoder returns its encoder's last hidden
#: state beside the logits, which torch's stages never hand loss_fn (the last stage's outputs only);
#: or, where the balanced split (from measured times) begins the second stage before the decoder
#: reads its inputs, those inputs, which torch's stages feed to the first stage only.
ENCODER_DECODER = (r"returns values that stages before the last make|"
                   r"later stages read 'decoder_input_ids' \(stage 1\)")
REFUSED_IN_PROCESSES = {"t5": ENCODER_DECODER, "bart": ENCODER_DECODER}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_runs_in_processes_with_the_unsplit_models_loss(name):
    """One process a stage (torch.distributed.pipelining, gloo): every value crossing a stage laid
    out contiguously (BERT's, ViT's, OPT's, GPT-J's and CodeGen's failed before with "input tensor
    has to be contiguous"), the first loss the unsplit model's; or refused by name."""
    model, sample = tiny(name)
    state = ExplorerState(model, sample, devices=["cpu", "cpu"], chunks=2, profile_repeats=1, calibrate=False,
                          executor="processes", profile_stages=False)
    if name in REFUSED_IN_PROCESSES:
        with pytest.raises(ValueError, match=REFUSED_IN_PROCESSES[name]):
            state.runner.run()
        return
    row = state.runner.run()
    assert row["executor"] == "processes"
    assert row["loss"] == pytest.approx(unsplit_loss(model, sample), rel=1e-5, abs=1e-7)


#: A hooks module for the exported script: the zoo's tiny model by name, its sample, the synthetic loss.
ZOO_HOOKS = '''
import sys
import torch
sys.path.insert(0, {root!r})
from tests.test_zoo import tiny
from pipexplore.loss import synthetic_loss

NAME = {name!r}


def build_model():
    return tiny(NAME)[0]


def get_batch():
    return tiny(NAME)[1], torch.zeros(4)  # (torch splits a target into the micro-batches: one a row)


def loss_fn(output, target):
    return synthetic_loss(output)
'''


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_the_exported_torchrun_script_runs_with_the_unsplit_models_loss(name, tmp_path):
    """The plan exported for torchrun (two ranks, gloo on the CPU): its first loss is the unsplit model's."""
    import pathlib

    from ranks import run_ranks

    model, sample = tiny(name)
    hooks = f"zoo_{name}_hooks"
    (tmp_path / f"{hooks}.py").write_text(ZOO_HOOKS.format(root=str(pathlib.Path(__file__).parent.parent),
                                                          name=name))
    state = ExplorerState(model, sample, devices=["cpu", "cpu"], chunks=2, profile_repeats=1, calibrate=False,
                          profile_stages=False, executor="processes")
    script = tmp_path / "train_pipeline.py"
    script.write_text(state.export("torchrun", hooks=hooks))
    outputs = run_ranks(script, ["--device", "cpu"], ranks=2, pythonpath=str(tmp_path))
    loss = float(outputs[1].split("step 0 loss=")[1].split()[0])
    assert loss == pytest.approx(unsplit_loss(model, sample), rel=1e-5, abs=1e-7)
