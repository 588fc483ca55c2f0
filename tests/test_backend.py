"""Expert backends: schemas, task pools that batch, the runtime, and a pipeline of backends."""
from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from torch import nn

from pipexplore.backend import (BackendPipeline, BatchTensorProto, ExpertBackend, Runtime, TaskPool,
                                nested_flatten, nested_pack)


def linear_backend(name="ffn", width=8, lr=0.1, **options):
    torch.manual_seed(1)
    expert = nn.Sequential(nn.Linear(width, width), nn.Tanh())
    return ExpertBackend(name, expert, torch.optim.SGD(expert.parameters(), lr=lr),
                         args_schema=(BatchTensorProto(width),), **options)


def test_batch_tensor_proto():
    proto = BatchTensorProto(8)
    assert proto.make_empty(3).shape == (3, 8) and proto.make_empty(3).dtype == torch.float32
    assert (BatchTensorProto.from_tensor(torch.zeros(5, 2, 3, dtype=torch.int64))
            == BatchTensorProto(2, 3, dtype=torch.int64))
    proto.check(torch.zeros(4, 8))
    with pytest.raises(ValueError, match=r"x: expected shape \[\*, 8\] float32, got \[4, 7\] float32"):
        proto.check(torch.zeros(4, 7), "x")
    with pytest.raises(ValueError, match=r"expected dtype \[\*, 8\] float32, got \[4, 8\] float64"):
        proto.check(torch.zeros(4, 8, dtype=torch.float64))


def test_nested_structures_round_trip():
    structure = ((1, [2, 3]), {"b": 5, "a": 4})
    flat = list(nested_flatten(structure))
    assert flat == [1, 2, 3, 4, 5]
    assert nested_pack([10, 20, 30, 40, 50], structure) == ((10, [20, 30]), {"a": 40, "b": 50})
    with pytest.raises(ValueError, match="1 values more than the structure holds"):
        nested_pack([1, 2, 3, 4, 5, 6], structure)


def test_forward_and_backward_equal_the_module():
    backend = linear_backend()
    reference = copy.deepcopy(backend.expert)
    x = torch.randn(6, 8)
    with Runtime({"ffn": backend}):
        (y,) = backend.forward_pool.submit_task(x).result(timeout=10)
        torch.testing.assert_close(y, reference(x))
        grad = torch.randn(6, 8)
        (gx,) = backend.backward_pool.submit_task(x, grad).result(timeout=10)
    xr = x.clone().requires_grad_()
    reference(xr).backward(grad)
    torch.testing.assert_close(gx, xr.grad)
    # The optimizer stepped: w ← w − lr·∂w, exactly.
    for p, r in zip(backend.expert.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, r - 0.1 * r.grad)


def test_outputs_schema_is_inferred_and_info_reported():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 3)

        def forward(self, x, *, scale):
            return self.linear(x) * scale, x.sum(-1, keepdim=True)

    expert = Two()
    backend = ExpertBackend("two", expert, None, args_schema=(BatchTensorProto(4),),
                            kwargs_schema={"scale": BatchTensorProto(1)})
    assert backend.outputs_schema == (BatchTensorProto(3), BatchTensorProto(1))
    info = backend.get_info()
    assert info["keyword_names"] == ["scale"] and info["args_schema"] == (BatchTensorProto(4),)
    with Runtime({"two": backend}):
        x, scale = torch.randn(5, 4), torch.full((5, 1), 2.0)
        a, b = backend.forward_pool.submit_task(x, scale).result(timeout=10)
        torch.testing.assert_close(a, expert.linear(x) * 2)
        ga, gs = backend.backward_pool.submit_task(x, scale, torch.ones(5, 3), torch.zeros(5, 1)).result(timeout=10)
        assert ga.shape == (5, 4) and gs.shape == (5, 1)


def test_an_input_schema_is_required():
    with pytest.raises(ValueError, match="ExpertBackend 'e' needs an input schema"):
        ExpertBackend("e", nn.Linear(2, 2), None)


def test_pending_tasks_merge_into_batches_and_each_caller_gets_its_rows():
    backend = linear_backend(max_batch_size=8)
    reference = copy.deepcopy(backend.expert)
    inputs = [torch.randn(2, 8) for _ in range(10)]
    futures = [backend.forward_pool.submit_task(x) for x in inputs]  # queued before the runtime starts
    runtime = Runtime({"ffn": backend})
    with runtime:
        results = [f.result(timeout=10)[0] for f in futures]
    for x, y in zip(inputs, results, strict=True):
        torch.testing.assert_close(y, reference(x))
    batches = runtime.timeline
    assert batches["batch_size"].tolist() == [8, 8, 4] and batches["tasks"].tolist() == [4, 4, 2]
    assert set(batches["pool"]) == {"ffn_forward"} and set(batches["phase"]) == {"forward"}


def test_concurrent_callers_from_threads_are_batched():
    backend = linear_backend(max_batch_size=64, min_batch_size=16, timeout=0.5)
    reference = copy.deepcopy(backend.expert)
    results: dict[int, torch.Tensor] = {}
    inputs = {k: torch.full((2, 8), float(k)) for k in range(16)}

    def caller(k):
        results[k] = backend.forward_pool.submit_task(inputs[k]).result(timeout=10)[0]

    runtime = Runtime({"ffn": backend})
    with runtime:
        threads = [threading.Thread(target=caller, args=(k,)) for k in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(results) == 16
    for k, y in results.items():
        torch.testing.assert_close(y, reference(inputs[k]))
    assert len(runtime.timeline) < 16  # fewer batches than tasks
    assert runtime.timeline["batch_size"].sum() == 32


def test_oversized_and_mismatched_tasks_fail_alone():
    backend = linear_backend(max_batch_size=4)
    good = backend.forward_pool.submit_task(torch.randn(2, 8))
    too_big = backend.forward_pool.submit_task(torch.randn(5, 8))
    wrong_shape = backend.forward_pool.submit_task(torch.randn(2, 7))
    wrong_dtype = backend.forward_pool.submit_task(torch.randn(2, 8, dtype=torch.float64))
    wrong_count = backend.forward_pool.submit_task(torch.randn(2, 8), torch.randn(2, 8))
    with pytest.raises(ValueError, match=r"a task of 5 rows is larger than max_batch_size \(4\)"):
        too_big.result(timeout=1)
    with pytest.raises(ValueError, match=r"ffn_forward: input 0: expected shape \[\*, 8\] float32, got \[2, 7\]"):
        wrong_shape.result(timeout=1)
    with pytest.raises(ValueError, match="expected dtype"):
        wrong_dtype.result(timeout=1)
    with pytest.raises(ValueError, match="expected 1 tensors, got 2"):
        wrong_count.result(timeout=1)
    with Runtime({"ffn": backend}):
        assert good.result(timeout=10)[0].shape == (2, 8)


def test_a_failing_task_fails_alone_and_the_rest_of_its_batch_gets_results():
    calls = []

    def process(x):
        calls.append(len(x))
        if (x < 0).any():
            raise ArithmeticError("negative input in this batch")
        return (x * 2,)

    pool = TaskPool(process, max_batch_size=8)
    a = pool.submit_task(torch.ones(2, 1))
    b = pool.submit_task(-torch.ones(2, 1))
    c = pool.submit_task(torch.full((3, 1), 3.0))
    pool.process_batch(pool.take_batch())  # one batch of 7 rows: it fails, then its halves are retried apart
    with pytest.raises(ArithmeticError, match="negative input in this batch"):
        b.result(timeout=1)
    torch.testing.assert_close(a.result(timeout=1)[0], torch.full((2, 1), 2.0))
    torch.testing.assert_close(c.result(timeout=1)[0], torch.full((3, 1), 6.0))
    assert calls[0] == 7 and len(calls) > 1


class RefusesNegative(nn.Module):
    """A linear layer that raises on a negative input: a request the schema passes can still fail."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        if (x < 0).any():
            raise ArithmeticError("this layer takes no negative input")
        return self.linear(x)


def test_a_request_that_makes_the_layer_fail_fails_only_itself():
    torch.manual_seed(2)
    expert = RefusesNegative(4)
    reference = copy.deepcopy(expert)
    backend = ExpertBackend("picky", expert, None, args_schema=(BatchTensorProto(4),), max_batch_size=64)
    good = [torch.rand(3, 4) for _ in range(3)]
    bad = -torch.rand(2, 4)
    grads = [torch.randn(3, 4) for _ in good]
    # Queued before the runtime starts: the first batch holds every request, the bad one among them.
    forwards = [backend.forward_pool.submit_task(x) for x in (good[0], bad, good[1], good[2])]
    backwards = [backend.backward_pool.submit_task(x, g) for x, g in zip(
        good[:1] + [bad] + good[1:], grads[:1] + [torch.randn(2, 4)] + grads[1:], strict=True)]
    with Runtime({"picky": backend}):
        results = [f.exception(timeout=10) or f.result() for f in forwards]
        back = [f.exception(timeout=10) or f.result() for f in backwards]
    assert isinstance(results[1], ArithmeticError) and isinstance(back[1], ArithmeticError)
    assert "this layer takes no negative input" in str(results[1])
    for x, (y,) in zip(good, results[:1] + results[2:], strict=True):
        torch.testing.assert_close(y, reference(x))
    # Input gradients of the good requests equal the layer's; the parameters hold exactly their
    # gradients (no optimizer), nothing of the failed batch.
    for x, g, (gx,) in zip(good, grads, back[:1] + back[2:], strict=True):
        xr = x.clone().requires_grad_()
        reference(xr).backward(g)
        torch.testing.assert_close(gx, xr.grad)
    for p, r in zip(expert.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad)


def test_shutdown_fails_pending_tasks_and_leaves_no_thread():
    before = set(threading.enumerate())
    backend = linear_backend(min_batch_size=100, max_batch_size=128, timeout=60)
    runtime = Runtime({"ffn": backend}).start()
    assert any(t.name.startswith("pipexplore-runtime") for t in threading.enumerate())
    waiting = backend.forward_pool.submit_task(torch.randn(2, 8))  # not enough rows to be ready
    time.sleep(0.05)
    runtime.shutdown()
    with pytest.raises(RuntimeError, match="ffn_forward: the runtime was shut down before this task ran"):
        waiting.result(timeout=1)
    late = backend.forward_pool.submit_task(torch.randn(2, 8))
    with pytest.raises(RuntimeError, match="shut down"):
        late.result(timeout=1)
    assert set(threading.enumerate()) == before


def test_pool_arguments_are_checked():
    with pytest.raises(ValueError, match="max_batch_size must be at least 1"):
        TaskPool(lambda x: (x,), 0)
    with pytest.raises(ValueError, match=r"min_batch_size must be between 1 and max_batch_size \(4\)"):
        TaskPool(lambda x: (x,), 4, min_batch_size=5)


def _stages(lr=0.05):
    torch.manual_seed(3)
    layers = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 2)]
    backends = [ExpertBackend(f"s{k}", m, torch.optim.SGD(m.parameters(), lr=lr), args_schema=(BatchTensorProto(8),))
                for k, m in enumerate(layers)]
    return layers, backends


def test_pipeline_of_backends_with_one_chunk_equals_a_plain_step():
    layers, backends = _stages()
    reference = copy.deepcopy(nn.Sequential(*layers))
    x, target = torch.randn(16, 8), torch.randn(16, 2)
    loss_fn = nn.functional.mse_loss
    runtime = Runtime({b.name: b for b in backends})
    with runtime:
        losses = BackendPipeline(backends).step(x, target, loss_fn, chunks=1)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    loss = loss_fn(reference(x), target)
    loss.backward()
    optimizer.step()
    assert losses == [pytest.approx(loss.item())]
    for p, r in zip(nn.Sequential(*layers).parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, r)
    assert runtime.timeline.groupby("phase").size().to_dict() == {"backward": 3, "forward": 3}


def test_pipeline_of_backends_batches_micro_batches_and_learns():
    layers, backends = _stages()
    x, target = torch.randn(32, 8), torch.randn(32, 2)
    runtime = Runtime({b.name: b for b in backends})
    before = [p.clone() for p in nn.Sequential(*layers).parameters()]
    with runtime:
        pipeline = BackendPipeline(backends)
        first = sum(pipeline.step(x, target, nn.functional.mse_loss, chunks=8))
        for _ in range(20):
            last = sum(pipeline.step(x, target, nn.functional.mse_loss, chunks=8))
    assert last < first
    assert any(not torch.equal(a, b) for a, b in zip(before, nn.Sequential(*layers).parameters(), strict=True))
    batches = runtime.timeline
    assert (batches["wait"] >= 0).all() and set(batches["stage"]) == {0, 1, 2}
    # 21 steps × 8 micro-batches × 3 stages × 2 directions tasks, fewer batches.
    assert batches["tasks"].sum() == 21 * 8 * 3 * 2


def test_a_backend_can_be_served_again_by_a_new_runtime():
    backend = linear_backend()
    x = torch.randn(3, 8)
    with Runtime({"ffn": backend}):
        first = backend.forward_pool.submit_task(x).result(timeout=10)[0]
    with Runtime({"ffn": backend}):
        again = backend.forward_pool.submit_task(x).result(timeout=10)[0]
    torch.testing.assert_close(first, again)
