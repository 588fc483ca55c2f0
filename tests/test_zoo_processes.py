"""The transformers zoo through the exported torchrun script: some architectures with tiny real
weights, two ranks (gloo), each first loss the unsplit model's. (A file of its own: the suite's
workers take a file each. Every architecture's run one process a stage is in test_zoo.py, where it
reuses the export its run on two CPU stages made.)"""
from __future__ import annotations

import logging

import pytest

from pipexplore.widgets.state import ExplorerState
from tests.test_zoo import unsplit_loss
from tests.zoo_models import tiny

logging.getLogger("transformers").setLevel(logging.ERROR)


#: A hooks module for the exported script: the zoo's tiny model by name, its sample, the synthetic loss.
ZOO_HOOKS = '''
import sys
import torch
sys.path.insert(0, {root!r})
from tests.zoo_models import tiny
from pipexplore.training import synthetic_loss

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
