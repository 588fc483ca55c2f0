"""Traced models in other processes: one process per rank with torch.distributed.pipelining, and the
exported torchrun script, each equal to the unsplit model."""
from __future__ import annotations

import copy
import pathlib

import pytest

from pipexplore import trace
from pipexplore.distributed import run_processes
from pipexplore.plan import Plan
from ranks import assert_equals_unsplit, torchrun_first_loss
from tiny_transformer import build_model, get_batch, loss_fn

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("splits,ranks,schedule,chunks", [((3,), 2, "gpipe", 4), ((2, 4), 3, "1f1b", 8)])
def test_traced_transformer_in_processes_equals_the_unsplit_model(splits, ranks, schedule, chunks):
    model = build_model()
    tokens, target = get_batch()
    table = trace.candidates(copy.deepcopy(model), (tokens,), repeats=1)
    plan = Plan(table, splits, ("cpu",) * ranks, chunks=chunks, schedule=schedule, executor="processes")
    result = run_processes(model, tokens, plan, target=target, loss_fn=loss_fn, return_grads=True, warmup=0)
    assert_equals_unsplit(result, model, tokens, target, loss_fn)


@pytest.mark.slow
def test_exported_torchrun_script_trains_one_step_like_a_single_process(tmp_path):
    tokens, target = get_batch()
    table = trace.candidates(build_model(), (tokens,), repeats=1)
    script = trace.torchrun_script(table, [3], hooks="tiny_transformer", chunks=4, schedule="1f1b", device="cpu")
    assert ("MODULE_FQNS_PER_MODEL_PART = [['embed', 'layers.0', 'layers.1'], ['layers.2', 'layers.3', 'norm', 'head']]"
            in script)
    path = tmp_path / "train_pipeline.py"
    path.write_text(script)
    unsplit = loss_fn(build_model()(tokens), target).item()
    assert torchrun_first_loss(path, str(ROOT / "tests")) == pytest.approx(unsplit, rel=1e-5)


@pytest.mark.slow
def test_a_rerun_of_the_same_split_is_not_traced_here_again(monkeypatch):
    """The processes executor traces a split here before any rank starts (to refuse it early);
    once per split of the model as it is: another split, other input shapes or a changed model
    is traced again, and a split that failed is never taken as checked."""
    import pipexplore.models.trace as tracing

    model = build_model()
    tokens, target = get_batch()
    table = trace.candidates(copy.deepcopy(model), (tokens,), repeats=1)
    traced_here = []
    original = tracing.split

    def counting(*args, **kwargs):
        traced_here.append(kwargs.get("mb_kwargs"))
        return original(*args, **kwargs)

    monkeypatch.setattr(tracing, "split", counting)
    plan = Plan(table, (3,), ("cpu", "cpu"), chunks=4, schedule="gpipe", executor="processes")
    run = lambda p, x=tokens, y=target: run_processes(model, x, p, target=y, loss_fn=loss_fn, warmup=0)  # noqa: E731
    first = run(plan)
    assert len(traced_here) == 1
    again = run(plan)
    assert len(traced_here) == 1  # the same split: not traced here again
    assert again.loss == pytest.approx(first.loss, rel=1e-6)
    run(plan.with_options(splits=(2,)))
    assert len(traced_here) == 2  # another split
    run(plan.with_options(batch=16), *get_batch(16))
    assert len(traced_here) == 3  # micro-batches of another shape
    model.head.weight.requires_grad_(False)
    run(plan)
    assert len(traced_here) == 4  # the model changed
