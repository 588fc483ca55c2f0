"""Traced models in other processes: one process per rank with torch.distributed.pipelining, equal
to the unsplit model, and the exported torchrun script's split."""
from __future__ import annotations

import copy

import pytest

from pipexplore.export.torchrun import torchrun_script
from pipexplore.models import trace
from pipexplore.models.trace import pipes as traced_pipes
from pipexplore.executors.distributed import run_processes
from pipexplore.plan import Plan
from ranks import assert_equals_unsplit
from tiny_transformer import build_model, get_batch, loss_fn


def test_a_split_sent_to_another_process_computes_what_it_computed():
    """What the ranks are sent (``trace.sent``): the split, its unflattened modules and its nodes'
    meta (the shapes torch's stage receives and sends) as they were; it computes what it computed,
    to the bit, in a process that never traced the model."""
    import subprocess
    import sys

    import torch

    from pipexplore.models.trace import sent

    model = build_model()
    tokens, _ = get_batch()
    pipe = traced_pipes.traced_pipe(model, (tokens[:2],), ["layers.2"])
    data = sent.dumps((pipe, tokens[:2]))
    assert data is not None
    back, _ = sent.loads(data)
    for stage in ("submod_pp_0", "submod_pp_1"):
        ours, theirs = (getattr(p.split_gm, stage).graph.nodes for p in (pipe, back))
        vals = [(n.name, tuple(n.meta["val"].shape)) for n in ours if n.op == "placeholder"]
        assert vals and vals == [(n.name, tuple(n.meta["val"].shape)) for n in theirs if n.op == "placeholder"]
    with torch.no_grad():
        expected = pipe(tokens[:2])[0]
    program = ("import pickle, sys, torch\n"
               "from pipexplore.models.trace import sent\n"
               "pipe, tokens = sent.loads(sys.stdin.buffer.read())\n"
               "with torch.no_grad():\n"
               "    sys.stdout.buffer.write(pickle.dumps(pipe(tokens)[0]))\n")
    done = subprocess.run([sys.executable, "-c", program], input=data, capture_output=True, check=True, timeout=120)
    assert torch.equal(__import__("pickle").loads(done.stdout), expected)


@pytest.mark.slow
@pytest.mark.parametrize("splits,ranks,schedule,chunks", [((3,), 2, "gpipe", 4), ((2, 4), 3, "1f1b", 8)])
def test_traced_transformer_in_processes_equals_the_unsplit_model(splits, ranks, schedule, chunks):
    model = build_model()
    tokens, target = get_batch()
    table = trace.candidates(copy.deepcopy(model), (tokens,), repeats=1)
    plan = Plan(table, splits, ("cpu",) * ranks, chunks=chunks, schedule=schedule, executor="processes")
    result = run_processes(model, tokens, plan, target=target, loss_fn=loss_fn, return_grads=True, warmup=0)
    assert_equals_unsplit(result, model, tokens, target, loss_fn)


def test_exported_torchrun_script_names_the_split_for_torchtitan_and_compiles():
    """The script of a traced model's split: its split points and torchtitan's module names per
    part. Scripts like it run under torchrun in other tests, each a world of interpreters importing
    torch's pipelining (~7 s of CPU a rank): this model under DualPipeV
    (test_new_schedules.py) and under a CSV schedule (test_schedule_csv.py), GPT-2 from its default
    config (test_hf_defaults.py), a Sequential under 1F1B and interleaved 1F1B on two node agents
    (test_cluster_roundtrip.py)."""
    tokens, _ = get_batch()
    table = trace.candidates(build_model(), (tokens,), repeats=1)
    script = torchrun_script(table, [3], hooks="tiny_transformer", chunks=4, schedule="1f1b", device="cpu")
    assert ("MODULE_FQNS_PER_MODEL_PART = [['embed', 'layers.0', 'layers.1'], ['layers.2', 'layers.3', 'norm', 'head']]"
            in script)
    assert "SPLIT_POINTS = ['layers.2']" in script and "SCHEDULE_CLASS = Schedule1F1B" in script
    compile(script, "train_pipeline.py", "exec")


@pytest.mark.slow
def test_a_rerun_of_the_same_split_is_not_traced_here_again(monkeypatch):
    """The processes executor traces a split here before any rank starts (to refuse it early);
    once per split of a model of this shape in the session (the pipes traced are kept:
    ``traced_pipes``): another split, other input shapes or a changed model is traced again. The
    ranks trace nothing: each builds its stages from the split made here, sent to it
    (``trace.sent``); where it cannot be sent, each rank traces it, and keeps it as the pipes here
    are kept."""
    from pipexplore.models.trace import sent
    from pipexplore.models.trace.pipes import forget_traced

    forget_traced()  # (the module's tests before this one traced this split)
    model = build_model()
    tokens, target = get_batch()
    table = trace.candidates(copy.deepcopy(model), (tokens,), repeats=1)
    traced_here = []
    original = traced_pipes.split_marked

    def counting(*args, **kwargs):
        traced_here.append(kwargs.get("mb_kwargs"))
        return original(*args, **kwargs)

    monkeypatch.setattr(traced_pipes, "split_marked", counting)
    plan = Plan(table, (3,), ("cpu", "cpu"), chunks=4, schedule="gpipe", executor="processes")
    run = lambda p, x=tokens, y=target: run_processes(model, x, p, target=y, loss_fn=loss_fn, warmup=0)  # noqa: E731
    first = run(plan)
    assert len(traced_here) == 1 and first.metrics["traced_ranks"] == 0  # sent to the ranks
    again = run(plan)
    assert len(traced_here) == 1  # the same split: not traced here again
    assert again.metrics["traced_ranks"] == 0  # nor in the warm pool's ranks: each copied its kept pipe
    assert again.loss == pytest.approx(first.loss, rel=1e-6)
    run_processes(build_model(), tokens, plan, target=target, loss_fn=loss_fn, warmup=0)
    assert len(traced_here) == 1  # another model of the same shape
    other = run(plan.with_options(splits=(2,)))
    assert len(traced_here) == 2 and other.metrics["traced_ranks"] == 0  # another split (from the kept export)
    assert other.loss == pytest.approx(first.loss, rel=1e-5)  # the same model at the same weights
    run(plan.with_options(batch=16), *get_batch(16))
    assert len(traced_here) == 3  # micro-batches of another shape
    monkeypatch.setattr(sent, "dumps", lambda pipe: None)  # a split that cannot be sent
    unsent = run(plan.with_options(splits=(1,)))
    assert unsent.metrics["traced_ranks"] == unsent.metrics["exported_ranks"] == 2  # each rank traced it
    assert unsent.loss == pytest.approx(first.loss, rel=1e-5)
    monkeypatch.setattr(sent, "dumps", lambda pipe: b"not a pickle")  # one the ranks cannot rebuild
    unread = run(plan.with_options(splits=(4,)))
    assert unread.metrics["traced_ranks"] == 2 and unread.metrics["exported_ranks"] == 0  # from their kept export
    assert unread.loss == pytest.approx(first.loss, rel=1e-5)
    model.head.weight.requires_grad_(False)
    changed = run(plan)
    assert len(traced_here) == 6  # the model changed
    assert changed.metrics["traced_ranks"] == changed.metrics["exported_ranks"] == 2  # so did the ranks' key