"""Training memory per stage: parameters, gradients, optimizer state, activations, and whether it fits."""
import functools
import math

import pandas as pd
import pytest
import torch

from pipexplore.predict.memory import optimizer_state_ratio, stage_memory


@pytest.mark.parametrize("optimizer, ratio", [
    (None, 0.0),
    (torch.optim.SGD, 0.0),
    (functools.partial(torch.optim.SGD, momentum=0.9), 1.0),
    (torch.optim.AdamW, 2.0),
    (functools.partial(torch.optim.Adam, amsgrad=True), 3.0),
    # not a known class: one step on a probe parameter counts what torch.optim allocates
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 1.0),
    (lambda ps: torch.optim.Adam(ps, lr=1e-3), 2.0),
    (lambda ps: torch.optim.Adagrad(ps), 1.0),
    (lambda ps: torch.optim.SGD(ps, lr=0.1), 0.0),
])
def test_optimizer_state_is_what_torch_optim_allocates(optimizer, ratio):
    assert optimizer_state_ratio(optimizer) == ratio


def test_the_known_classes_agree_with_a_step_of_them():
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.NAdam):
        assert optimizer_state_ratio(cls) == optimizer_state_ratio(lambda ps, cls=cls: cls(ps)), cls.__name__


def test_an_optimizer_factory_that_gives_no_optimizer_is_refused():
    with pytest.raises(TypeError, match="must return a torch.optim.Optimizer, got list"):
        optimizer_state_ratio(lambda ps: list(ps))


TABLE = pd.DataFrame({"param_bytes": [4e6, 8e6, 8e6, 2e6], "grad_bytes": [4e6, 8e6, 8e6, 0.0],
                      "params": [1e6, 2e6, 2e6, 0.5e6]})


def test_stage_memory_adds_parameters_gradients_states_and_the_peak_activations():
    mem = stage_memory(TABLE, [2], peak_activations=[5e6, 1e6], optimizer=torch.optim.Adam, capacity=[40e6, 30e6])
    assert mem["param_bytes"].tolist() == [12e6, 10e6]
    assert mem["grad_bytes"].tolist() == [12e6, 8e6]  # the frozen layer's parameters have no gradient
    assert mem["optimizer_bytes"].tolist() == [24e6, 16e6]  # Adam: two states per trained parameter
    assert mem["peak_bytes"].tolist() == [53e6, 35e6]
    assert mem["fits"].tolist() == [False, False]
    assert stage_memory(TABLE, [2], peak_activations=[0, 0], capacity=[50e6, 50e6])["fits"].all()  # SGD: no state


def test_without_a_capacity_every_stage_fits_and_says_nan():
    mem = stage_memory(TABLE, [1, 3], peak_activations=[1.0, 2.0, 3.0])
    assert mem["fits"].all() and mem["capacity"].isna().all()
    with pytest.raises(ValueError, match="peak_activations has 2 values for 3 stages"):
        stage_memory(TABLE, [1, 3], peak_activations=[1.0, 2.0])


def test_mixed_precision_adam_is_megatrons_18_bytes_a_parameter():
    """Megatron-LM (theoretical_memory_usage): 16-bit weights, fp32 gradients, fp32 master weights
    and Adam's two fp32 states: 2 + 4 + 4 + 8 bytes a parameter."""
    bf16 = pd.DataFrame({"param_bytes": [2e6, 4e6], "params": [1e6, 2e6]})
    mem = stage_memory(bf16, [1], peak_activations=[0, 0], optimizer=torch.optim.AdamW, mixed_precision=True)
    assert (mem["peak_bytes"] / bf16["params"]).tolist() == [18.0, 18.0]
    assert mem["param_bytes"].tolist() == [2e6, 4e6] and mem["grad_bytes"].tolist() == [4e6, 8e6]
    # SGD with momentum under mixed precision: 2 + 4 + 4 (master) + 4 (momentum)
    sgd = stage_memory(bf16, [1], peak_activations=[0, 0], optimizer=functools.partial(torch.optim.SGD, momentum=0.9),
                       mixed_precision=True)
    assert (sgd["peak_bytes"] / bf16["params"]).tolist() == [14.0, 14.0]
    assert not math.isnan(sgd["peak_bytes"].sum())
