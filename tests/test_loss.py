"""The synthetic loss (``pipexplore.loss``): one function for every place a step trains without a
``loss_fn`` — the executors, the traced model's block timing and the meta-device count."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipexplore.executors import base
from pipexplore.loss import synthetic_loss
from pipexplore.models import meta, trace


class Blocks(nn.Module):
    """Two blocks, not an ``nn.Sequential`` (so the traced and meta paths take it)."""

    def __init__(self, integer_output: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.integer_output = integer_output

    def forward(self, x: torch.Tensor):
        for layer in self.layers:
            x = layer(x)
        return x.argmax(-1) if self.integer_output else {"hidden": x, "pair": (x * 2, torch.arange(3))}


def test_every_floating_tensor_counts_however_nested_and_integers_do_not():
    a, b = torch.ones(2, 2), torch.full((3,), 2.0, dtype=torch.float16)
    loss = synthetic_loss({"a": a, "rest": [b, (torch.arange(4),)]})
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(1.0 + 4.0)
    assert base.synthetic_loss is synthetic_loss  # the executors' default is this one


def test_an_output_with_nothing_floating_is_named():
    with pytest.raises(TypeError, match=r"needs a floating tensor in the model's output, got dict: pass loss_fn="):
        synthetic_loss({"ids": torch.arange(3)})


def test_the_traced_block_timing_trains_on_the_same_loss():
    """The blocks timed inside whole passes get their backward from the same loss as a run: the
    gradient of the first block's weight equals that of synthetic_loss on the model's output."""
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(8, 4)
    seen = {}

    def keep(weight: torch.Tensor) -> None:
        seen["grad"] = weight.grad.clone()

    model.layers[0].weight.register_post_accumulate_grad_hook(keep)
    table = trace.candidates(model, x, repeats=1, warmup=0, time_optimizer=False)
    assert list(table["name"]) == ["layers.0", "layers.1"] and (table["backward"] > 0).all()
    reference = Blocks()
    reference.load_state_dict(model.state_dict())
    synthetic_loss(reference(x)).backward()
    torch.testing.assert_close(seen["grad"], reference.layers[0].weight.grad)


def test_the_traced_block_timing_names_an_output_it_cannot_differentiate():
    """Before, the sum of nothing (0) was differentiated: "'int' object has no attribute 'backward'"."""
    with pytest.raises(TypeError, match=r"needs a floating tensor in the model's output, got Tensor"):
        trace.candidates(Blocks(integer_output=True), torch.randn(8, 4), repeats=1, warmup=0, time_optimizer=False)


def test_the_meta_count_takes_an_integer_output_as_a_forward_alone():
    """Counting on the meta device needs no loss to go on: an output with nothing to differentiate
    is counted as a floating one is (the backward by its formulas), where a run refuses it."""
    with torch.device("meta"):
        integer, floating = Blocks(integer_output=True), Blocks()
    x = torch.empty(8, 4, device="meta")
    counted, both = meta.count_layers(integer, x), meta.count_layers(floating, x)
    assert list(counted["forward_flops"]) == list(both["forward_flops"]) == [2 * 8 * 4 * 4] * 2
    assert list(counted["backward_flops"]) == list(both["backward_flops"]) == [2 * 2 * 8 * 4 * 4] * 2
