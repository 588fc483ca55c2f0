"""The exported torchrun script's activation checkpointing (``pipexplore.export.torchrun``): each
stage's forward per micro-batch as the plan says, on the cluster a plan is for."""
from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn

from pipexplore.export.torchrun import CHECKPOINT_SOURCE, torchrun_script
from pipexplore.widgets.state import ExplorerState


class _Counted(nn.Module):
    """A stage's module that counts its forwards with autograd on."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
        self.forwards = 0

    def forward(self, x):
        self.forwards += torch.is_grad_enabled()
        return self.body(x)


def _step(mode: str, module: nn.Module, batch: torch.Tensor, chunks: int = 4) -> _Counted:
    """One step of ``chunks`` micro-batches through a stage whose module is a copy of ``module``,
    checkpointed by the script's own function, as torch's stage calls it: a forward without
    autograd first (as shape inference may), then every forward, then every backward."""
    namespace = {"torch": torch}
    exec(CHECKPOINT_SOURCE, namespace)  # noqa: S102 - the exported script's function, as it stands there
    stage = types.SimpleNamespace(submod=copy.deepcopy(module))
    namespace["checkpoint_stage"](stage, chunks, mode)
    with torch.no_grad():
        stage.submod(batch[:1])
    outputs = [stage.submod(part) for part in batch.chunk(chunks)]
    for output in outputs:
        output.square().sum().backward()
    return stage.submod


@pytest.mark.parametrize("mode,forwards", [("never", 4), ("always", 8), ("except_last", 7)])
def test_a_checkpointed_stage_runs_its_forward_again_in_backward_with_the_same_gradients(mode, forwards):
    module, batch = _Counted(), torch.randn(8, 4)
    ran = _step(mode, module, batch)
    assert ran.forwards == forwards  # micro-batch forwards, and again in backward for each one checkpointed
    kept = _step("never", module, batch)
    for (name, ours), (_, theirs) in zip(ran.named_parameters(), kept.named_parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=0, msg=name)


def test_an_export_for_catalogue_gpus_applies_the_plans_checkpointing_and_one_for_here_none():
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    batch = torch.randn(8, 8)
    planned = ExplorerState(model, batch, devices=["H100"] * 2, chunks=4, checkpoint="always", calibrate=False)
    script = planned.export("torchrun")
    assert "CHECKPOINT = 'always'" in script and "checkpoint_stage(stage, CHUNKS, CHECKPOINT)" in script
    compile(script, "train_pipeline.py", "exec")
    planned.update(checkpoint="except_last")
    assert "CHECKPOINT = 'except_last'" in planned.export("torchrun")
    here = ExplorerState(model, batch, devices=["cpu"] * 2, chunks=4, checkpoint="always", calibrate=False,
                         profile_repeats=1)
    # this machine's processes and the page's torchrun run torch's runtime without recomputation
    assert "CHECKPOINT = 'never'" in here.export("torchrun") and here.plan.run_checkpoint == "always"
    with pytest.raises(ValueError, match="checkpoint is not one of 'always', 'except_last', or 'never', got 'sometimes'"):
        torchrun_script(here.layer_table, [2], hooks="m", chunks=4, checkpoint="sometimes")
