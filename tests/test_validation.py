"""Validation at entry: every bad value is refused where it enters, naming it; a refused call changes nothing."""
from __future__ import annotations

import copy
import math

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import plain_model
from pipexplore import GPipe, validate
from pipexplore.plan import EXECUTORS, PLAN_SCHEDULES, Plan
from pipexplore.executors.step import run_step
from pipexplore.executors.threads import ScheduleExecutor
from pipexplore.widgets import explore
from pipexplore.widgets.explorer import UPDATABLE

FEW = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Values that are wrong whatever else the call says.
NOT_A_COUNT = st.one_of(st.booleans(), st.integers(max_value=0), st.text(max_size=3), st.none(),
                        st.floats(allow_nan=True).filter(
                            lambda f: not (math.isfinite(f) and f.is_integer() and f >= 1)),
                        st.lists(st.integers(1, 4), max_size=2))
NOT_A_NAME = st.one_of(st.text(max_size=6), st.none(), st.integers(), st.booleans())
BAD_DEVICES = st.one_of(st.just([]), st.just(""), st.just(" , "), st.just(3), st.just([1.5]),
                        st.just(["cpu", None]), st.just(["tpu:0"]), st.just("cpu,npu"),
                        st.just([f"cuda:{torch.cuda.device_count()}"]))
BAD_SPLITS = st.one_of(st.none(), st.just("4"), st.just(4), st.just([0]), st.just([9]), st.just([5, 3]),
                       st.just([3, 3]), st.just([2.5]), st.just(["a"]), st.just([True]))


# ---- the checks themselves -----------------------------------------------------------------

@given(batch=st.integers(1, 64), chunks=st.integers(1, 80))
@settings(max_examples=25, deadline=None)
def test_chunks_are_refused_exactly_when_torch_chunk_makes_fewer_micro_batches(batch, chunks):
    made = len(torch.arange(batch).chunk(chunks))
    if made == chunks:
        validate.chunks_for_batch(chunks, batch)
    else:
        with pytest.raises(ValueError, match=rf"chunks={chunks} .*{batch} rows"):
            validate.chunks_for_batch(chunks, batch)
    assert all(len(torch.arange(batch).chunk(c)) == c for c in validate.valid_chunks(batch, chunks))


@given(value=NOT_A_COUNT)
@FEW
def test_a_count_that_is_not_a_positive_integer_is_refused_naming_it(value):
    with pytest.raises((TypeError, ValueError), match="chunks"):
        validate.chunks(value)
    with pytest.raises((TypeError, ValueError), match="virtual_stages"):
        validate.virtual_stages(value)


def test_integral_floats_only_where_torchgpipe_takes_them():
    assert validate.chunks(42.0, coerce_float=True) == 42 and type(validate.chunks(42.0, coerce_float=True)) is int
    assert validate.chunks(np.int64(3)) == 3
    with pytest.raises(TypeError, match=r"chunks: number of chunks must be a positive integer, got 42.0 \(float\)"):
        validate.chunks(42.0)
    with pytest.raises(TypeError, match=r"chunks: number of chunks must be a positive integer, got 2.5"):
        validate.chunks(2.5, coerce_float=True)


def test_devices_a_string_is_comma_separated_never_letters():
    assert validate.devices("cpu") == ("cpu",)
    assert validate.devices(" cpu, cpu ") == ("cpu", "cpu")
    assert validate.devices([torch.device("cpu"), "cpu"]) == ("cpu", "cpu")
    with pytest.raises(ValueError, match=r"devices is empty \(\[\]\): give one device per stage"):
        validate.devices([])
    with pytest.raises(TypeError, match=r"devices must be a list of devices .* got None"):
        validate.devices(None)


@pytest.mark.parametrize("sample,error,message", [
    ([[1.0, 2.0]], TypeError, r"sample must be a tensor .* got a list: give torch.tensor\(sample\)"),
    (np.zeros((4, 2)), TypeError, r"got a numpy array: give torch.from_numpy\(sample\)"),
    (None, TypeError, r"sample must be a tensor .* got None"),
    (torch.zeros(0, 6), ValueError, r"sample has 0 rows \(shape \[0, 6\]\)"),
    (torch.tensor(1.0), ValueError, r"sample is a 0-dim tensor"),
    ((torch.zeros(4, 2), torch.zeros(3, 2)), ValueError, r"the tensors of sample need the same rows .* \[3, 4\]"),
    ((), TypeError, "got an empty tuple"),
])
def test_samples_that_are_not_a_mini_batch(sample, error, message):
    with pytest.raises(error, match=message):
        validate.sample(sample)


@pytest.mark.parametrize("loss,error,message", [
    (0.5, TypeError, r"loss_fn must return a scalar tensor, got 0.5 \(float\)"),
    (None, TypeError, r"loss_fn must return a scalar tensor, got None \(NoneType\)"),
    (torch.ones(3), ValueError, r"loss_fn must return a scalar tensor, got a tensor of shape \[3\]: reduce it"),
    (torch.tensor(3), TypeError, "floating-point"),
])
def test_losses_that_backward_cannot_start_from(loss, error, message):
    with pytest.raises(error, match=message):
        validate.loss_value(loss)
    assert validate.loss_value(torch.ones(1)).numel() == 1


# ---- GPipe and the schedule executor -------------------------------------------------------

GPIPE_BAD = st.one_of(
    st.tuples(st.just("chunks"), NOT_A_COUNT),
    st.tuples(st.just("balance"), st.one_of(st.just([3.5, 4.5]), st.just("44"), st.just(8), st.just([4, "4"]),
                                            st.just([True, 7]))),
    st.tuples(st.just("devices"), BAD_DEVICES),
    st.tuples(st.just("checkpoint"), NOT_A_NAME.filter(lambda v: v not in ("always", "except_last", "never"))),
    st.tuples(st.just("deferred_batch_norm"), st.one_of(st.none(), st.integers(), st.text(max_size=2))),
)


@given(case=GPIPE_BAD)
@FEW
def test_gpipe_refuses_each_bad_argument_naming_it(case):
    name, value = case
    arguments = dict(balance=[4, 4], devices=["cpu", "cpu"], chunks=2)
    arguments[name] = value
    with pytest.raises((TypeError, ValueError)) as refused:
        GPipe(plain_model(), **arguments)
    assert name.split("_")[0] in str(refused.value)


def test_gpipe_takes_integral_floats_as_torchgpipe_does():
    pipe = GPipe(plain_model(), balance=[4.0, 4.0], devices=["cpu", "cpu"], chunks=42.0)
    assert pipe.chunks == 42 and type(pipe.chunks) is int and pipe.balance == [4, 4]
    with pytest.raises(TypeError, match=r"balance must be a list of ints .* got \[3.5, 0.5\]"):
        GPipe(plain_model(), balance=[3.5, 0.5])
    with pytest.raises(IndexError, match="too few devices to hold given partitions"):  # torchgpipe's error type
        GPipe(plain_model(), balance=[2, 2, 4], devices=["cpu", "cpu"])


EXECUTOR_BAD = st.one_of(
    st.tuples(st.just("chunks"), NOT_A_COUNT),
    st.tuples(st.just("devices"), BAD_DEVICES),
    st.tuples(st.just("schedule"), NOT_A_NAME.filter(
        lambda v: v not in ("gpipe", "1f1b", "interleaved", "zero-bubble"))),
    st.tuples(st.just("checkpoint"), NOT_A_NAME.filter(lambda v: v not in ("always", "except_last", "never"))),
    st.tuples(st.just("loss_fn"), st.one_of(st.integers(), st.text(max_size=2))),
)


@given(case=EXECUTOR_BAD)
@FEW
def test_schedule_executor_refuses_each_bad_argument_naming_it(case):
    name, value = case
    arguments = dict(devices=["cpu", "cpu"], chunks=2)
    arguments[name] = value
    with pytest.raises((TypeError, ValueError)) as refused:
        ScheduleExecutor(plain_model(), [4, 4], **arguments)
    assert name.split("_")[0] in str(refused.value)


def test_schedule_executor_chunks_given_as_a_string():
    with pytest.raises(TypeError, match=r"chunks: number of chunks must be a positive integer, got '2' \(str\)"):
        ScheduleExecutor(plain_model(), [4, 4], chunks="2")


# ---- the explorer --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def table():
    from pipexplore import profile

    return profile(plain_model(), torch.randn(12, 6), repeats=1, max_repeats=1, calibrate=False)


@pytest.fixture(scope="module")
def explorer(table):
    return explore(plain_model(), torch.randn(12, 6), devices=["cpu", "cpu"], splits=[4], chunks=4,
                   layer_table=table, calibrate=False)


def _state(ex):
    return (ex.plan, ex.plan.splits, ex.plan.devices, ex.plan.chunks, ex.plan.virtual_stages, ex.runs.to_dict(),
            ex.bar.splits, ex.w_chunks.value, ex.w_devices.value)


UPDATE_BAD = st.one_of(
    st.tuples(st.just("chunks"), st.one_of(NOT_A_COUNT, st.integers(13, 10_000),
                                           st.sampled_from([5, 7, 8, 9, 10, 11]))),
    st.tuples(st.just("devices"), st.one_of(BAD_DEVICES, st.none())),
    st.tuples(st.just("splits"), BAD_SPLITS),
    st.tuples(st.just("checkpoint"), NOT_A_NAME.filter(lambda v: v not in ("always", "except_last", "never"))),
    st.tuples(st.just("schedule"), NOT_A_NAME.filter(lambda v: v not in PLAN_SCHEDULES)),
    st.tuples(st.just("executor"), NOT_A_NAME.filter(lambda v: v not in EXECUTORS)),
    st.tuples(st.just("virtual_stages"), NOT_A_COUNT),
)


@given(case=UPDATE_BAD)
@FEW
def test_update_refuses_each_bad_value_naming_it_and_changes_nothing(explorer, case):
    name, value = case
    before = _state(explorer)
    with pytest.raises((TypeError, ValueError)) as refused:
        explorer.update(**{name: value})
    assert name in str(refused.value)
    assert _state(explorer) == before


@given(value=BAD_SPLITS)
@FEW
def test_setting_bad_splits_is_refused_and_changes_nothing(explorer, value):
    before = _state(explorer)
    with pytest.raises((TypeError, ValueError), match="splits"):
        explorer.splits = value
    assert _state(explorer) == before


@given(chunks=st.integers(1, 14), schedule=st.sampled_from(PLAN_SCHEDULES), checkpoint=st.sampled_from(
    ["always", "except_last", "never"]), executor=st.sampled_from(["threads", "autograd"]),
    splits=st.sampled_from([[4], [2], [2, 6], [1, 2, 3]]),
    devices=st.sampled_from(["cpu,cpu", "cpu", "cpu,cpu,cpu,cpu"]),
    virtual_stages=st.integers(1, 3))
@FEW
def test_any_combination_is_taken_or_refused_cleanly(explorer, chunks, schedule, checkpoint, executor, splits, devices,
                                                     virtual_stages):
    original = explorer.plan
    before = _state(explorer)
    changes = dict(chunks=chunks, schedule=schedule, checkpoint=checkpoint, executor=executor, splits=splits,
                   devices=devices, virtual_stages=virtual_stages)
    try:
        plan = explorer.update(**changes)
    except (TypeError, ValueError) as refused:
        assert any(name in str(refused) for name in UPDATABLE)
        assert _state(explorer) == before
        return
    assert (plan.chunks, plan.schedule, plan.checkpoint, plan.executor, list(plan.splits), plan.virtual_stages) == (
        chunks, schedule, checkpoint, executor, splits, virtual_stages)
    assert len(torch.randn(12, 6).chunk(plan.chunks)) == plan.chunks  # what a run would really run
    assert not plan.predicted.empty and explorer.bar.splits == splits
    explorer.update(**{k: getattr(original, k) for k in ("executor", "schedule", "splits", "devices", "chunks",
                                                         "checkpoint", "virtual_stages")})
    assert explorer.plan == original


EXPLORE_BAD = st.one_of(
    st.tuples(st.just("sample"), st.sampled_from([None, [[1.0] * 6], np.zeros((4, 6)), torch.zeros(0, 6),
                                                  torch.tensor(2.0)])),
    st.tuples(st.just("target"), st.sampled_from([torch.zeros(5, 6), torch.tensor(1.0)])),
    st.tuples(st.just("loss_fn"), st.one_of(st.integers(), st.text(max_size=2))),
    st.tuples(st.just("optimizer"), st.one_of(st.integers(), st.text(max_size=2))),
    st.tuples(st.just("devices"), BAD_DEVICES),
    st.tuples(st.just("chunks"), st.one_of(NOT_A_COUNT.filter(lambda v: v is not None), st.integers(13, 1000),
                                           st.sampled_from([5, 7, 8, 9]))),  # None: the default
    st.tuples(st.just("checkpoint"), NOT_A_NAME.filter(lambda v: v not in ("always", "except_last", "never"))),
    st.tuples(st.just("schedule"), NOT_A_NAME.filter(lambda v: v not in PLAN_SCHEDULES)),
    st.tuples(st.just("executor"), NOT_A_NAME.filter(lambda v: v not in EXECUTORS)),
    st.tuples(st.just("splits"), BAD_SPLITS.filter(lambda v: v is not None)),
    st.tuples(st.just("keep_timelines"), st.one_of(st.integers(max_value=-1), st.booleans(), st.text(max_size=2))),
    st.tuples(st.just("profile_repeats"), NOT_A_COUNT.filter(lambda v: v is not None)),
    st.tuples(st.just("calibrate"), st.one_of(st.none(), st.integers(), st.text(max_size=2))),
    st.tuples(st.just("layer_table"), st.sampled_from([[1, 2], "table", {"name": ["a"]}])),
)


@given(case=EXPLORE_BAD)
@FEW
def test_explore_refuses_each_bad_argument_naming_it_before_profiling(case, monkeypatch):
    import pipexplore.models.profile as profiling

    def never(*args, **kwargs):
        raise AssertionError("profiled before the arguments were checked")

    monkeypatch.setattr(profiling, "profile", never)
    name, value = case
    arguments = dict(devices=["cpu", "cpu"], chunks=4, splits=[4])
    sample = torch.randn(12, 6)
    if name == "sample":
        sample = value
    else:
        arguments[name] = value
    with pytest.raises((TypeError, ValueError)) as refused:
        explore(plain_model(), sample, **arguments)
    assert name.split("_")[0] in str(refused.value)


def test_a_sample_of_the_wrong_width_names_the_layer_that_failed():
    with pytest.raises(ValueError, match=r"sample \(shape \[16, 5\]\) does not fit the model: layer 0 \('0', Linear\) "
                                         r"failed on it with RuntimeError: mat1 and mat2 shapes cannot be multiplied"):
        explore(plain_model(), torch.randn(16, 5), devices=["cpu", "cpu"])


def test_chunks_the_batch_cannot_honour_are_refused_at_update(explorer):
    before = _state(explorer)
    with pytest.raises(ValueError, match=r"chunks=13 is more than the batch's 12 rows"):
        explorer.update(chunks=13)
    with pytest.raises(ValueError, match=r"chunks=5 cannot split a batch of 12 rows into 5 micro-batches: torch.chunk "
                                         r"makes 4 micro-batches of up to 3 rows"):
        explorer.update(chunks=5)
    assert _state(explorer) == before


def test_devices_as_a_string_is_read_as_a_list(explorer):
    with pytest.raises(ValueError, match=r"2 stages need 2 devices but 1 are chosen \(cpu\)"):
        explorer.update(devices="cpu")  # one device, never the letters 'c', 'p', 'u'
    explorer.update(devices="cpu,cpu")
    assert explorer.plan.devices == ("cpu", "cpu")


def test_update_names_what_it_cannot_change(explorer):
    with pytest.raises(TypeError, match=r"update\(\) cannot change 'chunk': it changes splits, devices, chunks"):
        explorer.update(chunk=4)


def test_every_executor_refuses_chunks_the_batch_cannot_honour_in_the_same_words(table):
    messages = set()
    for executor in ("threads", "autograd"):
        plan = Plan(table, (4,), ("cpu", "cpu"), chunks=4, executor=executor)  # no batch: checked at the run
        with pytest.raises(ValueError) as refused:
            run_step(plain_model(), torch.randn(6, 6), plan, warmup=0, repeats=1)
        messages.add(str(refused.value))
    assert messages == {"chunks=4 cannot split a batch of 6 rows into 4 micro-batches: torch.chunk makes 3 "
                        "micro-batches of up to 2 rows; choose chunks among 1, 2, 3, 6, or change the batch"}


@pytest.mark.parametrize("returned,error,message", [
    (lambda output: 0.5, TypeError, r"loss_fn must return a scalar tensor, got 0.5 \(float\)"),
    (lambda output: None, TypeError, r"loss_fn must return a scalar tensor, got None"),
    (lambda output: output.sum(dim=1), ValueError, r"got a tensor of shape \[\d+\]: reduce it"),
])
@pytest.mark.parametrize("executor", ["threads", "autograd"])
def test_a_loss_fn_that_returns_no_scalar_tensor_is_named(table, returned, error, message, executor):
    ex = explore(plain_model(), torch.randn(12, 6), devices=["cpu", "cpu"], splits=[4], chunks=2, layer_table=table,
                 calibrate=False, executor=executor, loss_fn=lambda output, target: returned(output))
    plan = ex.plan
    with pytest.raises(error, match=message):
        ex.run()
    assert ex.plan == plan and ex.runs.empty


def test_plan_fields_are_checked_on_construction(table):
    with pytest.raises(TypeError, match=r"splits must be a list of layer indices .* got None"):
        Plan(table, None)
    with pytest.raises(ValueError, match=r"virtual_stages must be an integer ≥ 1, got 0"):
        Plan(table, (4,), virtual_stages=0)
    with pytest.raises(ValueError, match="action_overhead must be a finite number of seconds"):
        Plan(table, (4,), action_overhead=math.inf)
    plan = Plan(table, (4,), ("cuda:0", "cuda:1"), chunks=4, batch=12)  # predicted for devices this machine may lack
    assert plan.devices == ("cuda:0", "cuda:1") and isinstance(plan.predicted, pd.DataFrame)
    assert copy.copy(plan) == plan
