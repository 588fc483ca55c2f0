"""GPipe: results equal the unsplit nn.Sequential; scheduling, checkpointing and portals behave."""
from __future__ import annotations

import copy
import gc
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models import Sleep, plain_model, tuple_model, unet_model
from pipexplore import GPipe, is_checkpointing, is_recomputing
from pipexplore.rng_guard import RNGGuard
from pipexplore.pipeline import clock_cycles

BALANCES = {
    "plain": [[8], [4, 4], [3, 3, 2], [1, 2, 3, 2]],
    # unet: outer skip 1→7, inner 3→5. These cross 0, 1, and several partitions.
    "unet": [[9], [6, 3], [2, 6, 1], [4, 2, 2, 1], [1, 3, 3, 2]],
}


def _reference_step(model: nn.Sequential, input):
    ref = copy.deepcopy(model)
    out = ref(input)
    (out.pow(2).sum()).backward()
    return out, [p.grad for p in ref.parameters()]


def _pipe_step(model: nn.Sequential, input, **kwargs):
    pipe = GPipe(copy.deepcopy(model), **kwargs)
    out = pipe(input)
    (out.pow(2).sum()).backward()
    return pipe, out, [p.grad for p in pipe.parameters()]


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("chunks", [1, 3, 8])
@pytest.mark.parametrize("kind,balance", [(k, b) for k, bs in BALANCES.items() for b in bs],
                         ids=lambda v: "-".join(map(str, v)) if isinstance(v, list) else v)
def test_outputs_and_gradients_equal_sequential(kind, balance, chunks, checkpoint):
    model = plain_model() if kind == "plain" else unet_model()
    x = torch.randn(10, 6, requires_grad=True)  # 10 rows: not divisible by 3 or 8
    expected, expected_grads = _reference_step(model, x)
    expected_input_grad = x.grad.clone()
    x.grad = None
    pipe, out, grads = _pipe_step(model, x, balance=balance, devices=["cpu"] * len(balance),
                                  chunks=chunks, checkpoint=checkpoint)
    torch.testing.assert_close(out, expected)
    assert len(grads) == len(expected_grads)
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e)
    torch.testing.assert_close(x.grad, expected_input_grad)


@pytest.mark.parametrize("chunks", [2, 5])
def test_every_chunk_count_1_to_8_plain(chunks):
    for c in range(1, 9):
        model = plain_model()
        x = torch.randn(7, 6)
        expected, expected_grads = _reference_step(model, x)
        _, out, grads = _pipe_step(model, x, balance=[2, 2, 2, 2], devices=["cpu"] * 4, chunks=c)
        torch.testing.assert_close(out, expected)
        for g, e in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(g, e)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_tuple_inputs_and_outputs(checkpoint):
    model = tuple_model()
    a, b = torch.randn(9, 6), torch.randn(9, 6)
    labels = torch.arange(9)
    ref = copy.deepcopy(model)
    s, p, l = ref((a, b, labels))
    (s.sum() + p.pow(2).sum()).backward()
    pipe = GPipe(copy.deepcopy(model), balance=[1, 2, 1], devices=["cpu"] * 3, chunks=4, checkpoint=checkpoint)
    ps, pp, pl = pipe((a, b, labels))
    (ps.sum() + pp.pow(2).sum()).backward()
    torch.testing.assert_close(ps, s)
    torch.testing.assert_close(pp, p)
    assert torch.equal(pl, labels + 3) and pl.dtype == torch.int64
    for g, e in zip(pipe.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(g.grad, e.grad)


def test_eval_mode_runs_without_checkpointing_and_no_grad():
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append((is_checkpointing(), torch.is_grad_enabled()))
            return x

    pipe = GPipe(nn.Sequential(nn.Linear(3, 3), Probe()), balance=[1, 1], devices=["cpu", "cpu"], chunks=2,
                 checkpoint="always")
    pipe.eval()
    with torch.no_grad():
        out = pipe(torch.randn(4, 3))
    assert not out.requires_grad
    assert seen == [(False, False), (False, False)]


def test_is_checkpointing_and_is_recomputing_seen_by_layers():
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append((is_checkpointing(), is_recomputing()))
            return x * 2

    pipe = GPipe(nn.Sequential(nn.Linear(3, 3), Probe()), balance=[1, 1], devices=["cpu", "cpu"], chunks=2,
                 checkpoint="except_last")
    out = pipe(torch.randn(4, 3))
    assert sorted(seen) == [(False, False), (True, False)]  # micro-batch 1 not checkpointed
    seen.clear()
    out.sum().backward()
    assert seen == [(False, True)]  # micro-batch 0 recomputed once


@pytest.mark.parametrize("balance", [[2, 2], [1, 1, 1, 1]])
def test_dropout_recomputation_replays_the_same_mask(balance):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 16), nn.Dropout(0.5))
    pipe = GPipe(model, balance=balance, devices=["cpu"] * len(balance), chunks=4, checkpoint="always")
    masks: dict[bool, dict[float, torch.Tensor]] = {False: {}, True: {}}

    def keep(module, args, output):
        # Key each micro-batch by its (deterministic) input, note where dropout zeroed.
        masks[is_recomputing()][round(args[0].sum().item(), 3)] = output == 0

    model[1].register_forward_hook(keep)
    model[3].register_forward_hook(keep)
    x = torch.randn(32, 16, requires_grad=True)
    out = pipe(x)
    out.sum().backward()
    assert len(masks[False]) == 8 and masks[False].keys() == masks[True].keys()
    for key, first in masks[False].items():
        assert torch.equal(first, masks[True][key])
    assert any(m.any() for m in masks[False].values()) and not all(m.all() for m in masks[False].values())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_schedule_executors_recomputation_replays_each_mask_on_a_shared_device(schedule):
    """The schedule executor's stages share the CPU's generator and draw at once, each
    checkpointed forward from a stream of its own: every recomputation draws the mask its forward
    drew, and the masks of different micro-batches and stages differ."""
    from pipexplore.executors.threads import ScheduleExecutor

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 16), nn.Dropout(0.5))
    masks: dict[bool, dict[tuple[int, float], torch.Tensor]] = {False: {}, True: {}}

    def keeping(index):
        def keep(module, args, output):
            masks[is_recomputing()][index, round(args[0].sum().item(), 3)] = output == 0
        return keep

    executor = ScheduleExecutor(model, [2, 2], devices=["cpu", "cpu"], chunks=4, schedule=schedule,
                                checkpoint="always")
    for index in (1, 3):
        executor.stage_modules[index // 2][1].register_forward_hook(keeping(index))
    executor.step(torch.randn(32, 16))
    assert len(masks[False]) == 8 and masks[False].keys() == masks[True].keys()
    assert all(torch.equal(first, masks[True][key]) for key, first in masks[False].items())
    drawn = [m for (index, _), m in masks[False].items() if index == 1]
    assert len({tuple(m.flatten().tolist()) for m in drawn}) == len(drawn)  # a stream each: no mask repeated


class _FunctionalDropouts(nn.Module):
    """Dropout through F.dropout in a plain module: nothing in the module says it draws."""

    def forward(self, x):
        for _ in range(20):
            x = F.dropout(x, p=0.02)
        return x


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_random_numbers_drawn_in_plain_code_replay_on_a_shared_device(checkpoint):
    model = nn.Sequential(_FunctionalDropouts(), nn.Identity(), _FunctionalDropouts())
    pipe = GPipe(model, [1, 1, 1], devices=["cpu"] * 3, chunks=16, checkpoint=checkpoint)
    for _ in range(2):
        x = torch.rand(32, 64, requires_grad=True)
        y = pipe(x)
        y.sum().backward()
        # d(sum y)/dx is the product of the masks' scales: zero exactly where the forward dropped.
        assert torch.equal(y != 0, x.grad != 0)
    assert [guard.draws for guard in pipe._rng_locks] == [True, False, True]


def test_rng_guard_learns_whether_a_partition_draws():
    guard = RNGGuard(threading.Lock(), torch.device("cpu"), draws=None)
    with guard.drawing():
        torch.ones(3) * 2
    assert guard.draws is False
    drawing = RNGGuard(threading.Lock(), torch.device("cpu"), draws=None)
    with drawing.drawing():
        assert not drawing.lock.locked()  # the forward does not hold it: only a draw does
        torch.rand(3)
    assert drawing.draws is True


def _as_on_a_gpu(guard: RNGGuard) -> RNGGuard:
    """``guard`` as a GPU's: a stream's operator that takes no generator (a fused dropout) runs on
    the stream's states swapped into the device's generator, so each draw from it takes the lock.
    (The paths are the device's kind's, not its kernels': the CPU's generator runs them here.)"""
    guard.swaps = True
    return guard


def test_a_draw_takes_the_devices_lock_and_the_rest_of_the_forward_does_not():
    """Two drawing partitions on one GPU overlap their forwards: only their draws take turns
    (a forward that held the lock throughout made GPT-2's stages on one host run one at a time)."""
    guard = _as_on_a_gpu(RNGGuard(threading.Lock(), torch.device("cpu"), draws=True))
    guard.lock.acquire()  # another partition is drawing now
    done = threading.Event()

    def forward():
        with guard.drawing():
            torch.ones(64, 64) @ torch.ones(64, 64)  # no draw: runs while the lock is held elsewhere
            done.set()
            torch.rand(3)  # waits for the lock

    worker = threading.Thread(target=forward)
    worker.start()
    assert done.wait(10.0) and worker.is_alive()  # computed, then waits to draw
    guard.lock.release()
    worker.join(10.0)
    assert not worker.is_alive()


def test_a_checkpointed_forward_replays_its_draws_whatever_others_drew_meanwhile():
    """Each checkpointed forward draws from a stream of its own (seeded from the shared
    generator); its recomputation replays it, though other partitions drew in between; two
    forwards' streams differ."""
    from collections import deque

    guard = RNGGuard(threading.Lock(), torch.device("cpu"), draws=True)
    first, second = deque(), deque()
    with guard.checkpointed(first):
        a = torch.rand(8)
    with guard.checkpointed(second):
        b = torch.rand(8)
    kept = deque(first)
    torch.rand(100)  # another partition draws from the shared generator
    with guard.drawing():
        torch.rand(100)
    with guard.recomputing(second):
        b_again = torch.rand(8)
    with guard.recomputing(first):
        a_again = torch.rand(8)
    assert torch.equal(a, a_again) and torch.equal(b, b_again) and not torch.equal(a, b)
    state = torch.get_rng_state()
    with guard.checkpointed(deque()):
        torch.rand(8)
    assert not torch.equal(state, torch.get_rng_state())  # the stream's seed came from the shared generator
    moved = torch.get_rng_state()
    with guard.recomputing(kept):
        torch.rand(8)
    assert torch.equal(moved, torch.get_rng_state())  # a replay leaves the shared generator as it was


class _CountingLock:
    """A lock that counts how many times it was taken."""

    def __init__(self) -> None:
        self.lock, self.taken = threading.Lock(), 0

    def __enter__(self):
        self.lock.acquire()
        self.taken += 1
        return self

    def __exit__(self, *exc):
        self.lock.release()

    def locked(self) -> bool:
        return self.lock.locked()


class _Watched(nn.Module):
    """Notes, each forward, the torch dispatch modes running and whether a guard watches this thread."""

    def __init__(self, seen: list) -> None:
        super().__init__()
        self.seen = seen

    def forward(self, x):
        from pipexplore import rng_guard

        key = rng_guard._random_key()
        self.seen.append((torch._C._len_torch_dispatch_stack(), torch._C._dispatch_tls_is_dispatch_key_included(key)))
        return x


def _encoder_layer(dropout: float) -> nn.Module:
    return nn.TransformerEncoderLayer(16, 2, 32, dropout=dropout, batch_first=True)


def test_a_partition_whose_dropouts_are_0_draws_nothing_and_runs_unwatched():
    """Dropout 0 everywhere (the encoder's dropout modules and its attention's ``dropout_p``): the
    first forward shows the guard that nothing draws; every forward after runs as without a
    guard, no dispatch mode, no key of the guard's, its lock never taken, no stream kept."""
    torch.manual_seed(0)
    seen: list = []
    model = nn.Sequential(_encoder_layer(0.0), _Watched(seen), _encoder_layer(0.0), _Watched(seen))
    pipe = GPipe(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=2, checkpoint="except_last")
    assert [guard.draws for guard in pipe._rng_locks] == [None, None]  # not known: no layer has p > 0
    for guard in pipe._rng_locks:
        guard.lock = _CountingLock()
    x = torch.randn(4, 8, 16, requires_grad=True)
    pipe(x).sum().backward()
    assert [guard.draws for guard in pipe._rng_locks] == [False, False]
    seen.clear()
    reference = copy.deepcopy(model)
    taken = [guard.lock.taken for guard in pipe._rng_locks]
    y = pipe(x)
    y.sum().backward()
    assert seen and all(s == (0, False) for s in seen)  # forwards and recomputations alike
    assert [guard.lock.taken for guard in pipe._rng_locks] == taken
    assert torch.allclose(y, reference(x), atol=1e-6)  # the same model, as without a guard


def test_random_operators_that_draw_nothing_do_not_count_as_draws():
    """Dropout of 0 or out of training, attention with ``dropout_p=0`` (an operator torch tags
    random, which leaves the generator as it was): a guard learns that the partition draws nothing."""
    guard = RNGGuard(threading.Lock(), torch.device("cpu"), draws=None)
    x, q = torch.randn(4, 16), torch.randn(1, 2, 8, 4)
    with guard.drawing():
        F.dropout(x, 0.0)
        F.dropout(x, 0.5, training=False)
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.0)
    assert guard.draws is False


def test_a_forward_drawing_on_a_cpu_is_not_watched_and_takes_no_lock():
    """On a CPU nothing swaps a stream's states into the shared generator, so a forward that draws
    from it runs as without a guard (no key of the guard's, the lock never taken), while another
    partition holds the lock; a checkpointed forward still draws from its stream and replays."""
    from collections import deque

    seen: list = []
    guard = RNGGuard(_CountingLock(), torch.device("cpu"), draws=True)
    assert guard.swaps is False
    guard.lock.lock.acquire()  # another partition takes the lock: nothing here waits for it
    x = torch.randn(8, 8)
    with guard.drawing():
        y = _Watched(seen)(F.dropout(x, 0.5)) * torch.rand(x.shape)
    assert seen == [(0, False)] and guard.lock.taken == 0 and (y == 0).any()
    guard.lock.lock.release()
    kept: deque = deque()
    with guard.checkpointed(kept):
        first = F.dropout(x, 0.5) * torch.rand(x.shape)
    with guard.drawing():
        torch.rand(100)  # another forward draws from the shared generator meanwhile
    with guard.recomputing(kept):
        assert torch.equal(first, F.dropout(x, 0.5) * torch.rand(x.shape))
    assert guard.lock.taken == 1  # the stream's seed, drawn from the shared generator


#: Torch's random operators that take no generator, as a CPU runs them: each draws through an
#: operator that takes one (``bernoulli_``, ``uniform_``, ...), or draws nothing on a CPU (its
#: flash attention has no dropout, ``_fused_sdp_choice`` only chooses). A new one must join with
#: a call below, or the guard must swap states on a CPU again.
_CPU_RANDOM_WITHOUT_GENERATOR = {
    "aten::rand": lambda x: torch.rand(5),
    "aten::rand.out": lambda x: torch.rand(5, out=torch.empty(5)),
    "aten::rand_like": lambda x: torch.rand_like(x),
    "aten::rand_like.out": lambda x: torch.ops.aten.rand_like.out(x, out=torch.empty_like(x)),
    "aten::randn": lambda x: torch.randn(5),
    "aten::randn_like": lambda x: torch.randn_like(x),
    "aten::randn_like.out": lambda x: torch.ops.aten.randn_like.out(x, out=torch.empty_like(x)),
    "aten::randint": lambda x: torch.randint(10, (5,)),
    "aten::randint.out": lambda x: torch.randint(10, (5,), out=torch.empty(5, dtype=torch.long)),
    "aten::randint.low": lambda x: torch.randint(3, 10, (5,)),
    "aten::randint.low_out": lambda x: torch.randint(3, 10, (5,), out=torch.empty(5, dtype=torch.long)),
    "aten::randint_like": lambda x: torch.randint_like(x, 10),
    "aten::randint_like.out": lambda x: torch.ops.aten.randint_like.out(x, 10, out=torch.empty_like(x)),
    "aten::randint_like.Tensor": lambda x: torch.ops.aten.randint_like.Tensor(x, torch.tensor(10)),
    "aten::randint_like.Tensor_out": lambda x: torch.ops.aten.randint_like.Tensor_out(
        x, torch.tensor(10), out=torch.empty_like(x)),
    "aten::randint_like.low_dtype": lambda x: torch.randint_like(x, 3, 10),
    "aten::randint_like.low_dtype_out": lambda x: torch.ops.aten.randint_like.low_dtype_out(
        x, 3, 10, out=torch.empty_like(x)),
    "aten::randperm": lambda x: torch.randperm(7),
    "aten::randperm.out": lambda x: torch.randperm(7, out=torch.empty(7, dtype=torch.long)),
    "aten::native_dropout": lambda x: torch.native_dropout(x, 0.5, True)[0],
    "aten::native_dropout.out": lambda x: torch.ops.aten.native_dropout.out(
        x, 0.5, True, out0=torch.empty_like(x), out1=torch.empty_like(x, dtype=torch.bool))[0],
    "aten::_scaled_dot_product_flash_attention_for_cpu": lambda x: F.scaled_dot_product_attention(x, x, x),
    "aten::_fused_sdp_choice": lambda x: F.scaled_dot_product_attention(x, x, x, dropout_p=0.5),
}


#: Kernels for no CPU, though torch's registry says otherwise: the attention a backend of its own
#: overrides (on a CPU it raises), and the out= form of Triton's attention.
_NOT_ON_A_CPU = {"aten::_scaled_dot_product_fused_attention_overrideable", "aten::_triton_scaled_dot_attention.out"}


def test_every_random_operator_without_a_generator_replays_on_a_cpu_without_the_shared_generator():
    """The premise of running a CPU's draws unwatched: in a checkpointed forward each of torch's
    random operators that takes no generator and runs on a CPU leaves the shared generator as it
    was and draws again what it drew, the shared generator drawn from in between."""
    from collections import deque

    def on_a_cpu(name: str) -> bool:
        kernels = ("CPU", "CompositeExplicitAutograd")
        return any(torch._C._dispatch_has_kernel_for_dispatch_key(name, k) for k in kernels)

    seeded = torch.Tag.nondeterministic_seeded
    runs_here = []
    for name in torch._C._dispatch_get_all_op_names():
        qualname, _, overload = name.partition(".")
        try:
            schema, tags = torch._C._get_schema(qualname, overload), torch._C._get_operation_overload(
                qualname, overload)[2]
        except Exception:
            continue
        if (seeded not in tags or any(a.name == "generator" for a in schema.arguments) or name in _NOT_ON_A_CPU
                or torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd")):
            continue
        # an out= form of another device's operator (cuDNN's, MIOpen's, MPS's) runs on no CPU
        if on_a_cpu(name) and (not overload.endswith("out") or on_a_cpu(qualname)):
            runs_here.append(name)
    assert sorted(runs_here) == sorted(_CPU_RANDOM_WITHOUT_GENERATOR), "torch's random operators changed"
    guard = RNGGuard(threading.Lock(), torch.device("cpu"), draws=True)
    x = torch.randn(2, 2, 8, 4)
    for name, call in _CPU_RANDOM_WITHOUT_GENERATOR.items():
        kept: deque = deque()
        with guard.checkpointed(kept):
            shared = torch.get_rng_state()
            first = call(x)
            assert torch.equal(shared, torch.get_rng_state()), name
        torch.rand(100)
        with guard.recomputing(kept):
            assert torch.equal(first, call(x)), name


def test_a_drawing_partition_takes_the_lock_for_its_random_operators_only():
    """Dropout > 0 on a GPU: no dispatch mode runs; the lock is taken once per random operator (a
    dropout's ``bernoulli_``, ``torch.rand``), never for the matmuls and the rest around them."""
    seen: list = []
    guard = _as_on_a_gpu(RNGGuard(_CountingLock(), torch.device("cpu"), draws=True))
    watched = _Watched(seen)
    x = torch.randn(8, 8)
    with guard.drawing():
        for _ in range(20):
            x = torch.tanh(x @ x.T) + 1
        x = watched(F.dropout(x, 0.5)) * torch.rand(x.shape)
    assert guard.lock.taken == 2
    assert seen == [(0, True)]


def test_a_checkpointed_forwards_dropout_draws_from_a_generator_of_its_own_without_the_lock():
    """A random operator that takes a generator is given the stream's: the checkpointed forward
    takes the lock once (its seed), leaves the shared generator as the seed left it, and its
    recomputation draws the same masks."""
    from collections import deque

    guard = RNGGuard(_CountingLock(), torch.device("cpu"), draws=True)
    x = torch.ones(64, 64)
    streams: deque = deque()
    with guard.checkpointed(streams):
        seeded = torch.get_rng_state()
        first = [F.dropout(x, 0.5) for _ in range(3)]
        assert torch.equal(seeded, torch.get_rng_state())
    torch.rand(100)  # another partition draws
    with guard.recomputing(streams):
        again = [F.dropout(x, 0.5) for _ in range(3)]
    assert guard.lock.taken == 1
    assert all(torch.equal(a, b) for a, b in zip(first, again)) and not torch.equal(first[0], first[1])


def test_a_dropout_raised_above_0_after_its_partition_was_seen_not_to_draw_is_watched_again():
    from collections import deque

    from pipexplore.rng_guard import rng_locks

    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.0))
    guard = rng_locks([model, nn.Identity()], [torch.device("cpu")] * 2)[0]
    x = torch.randn(32, 16)
    with guard.drawing():
        model(x)
    assert guard.draws is False
    model[1].p = 0.5
    streams: deque = deque()
    with guard.checkpointed(streams):
        first = model(x)
    torch.rand(100)  # another partition draws
    with guard.recomputing(streams):
        again = model(x)
    assert guard.draws is True and torch.equal(first, again) and (first == 0).any()


def test_a_forward_in_eval_mode_does_not_show_that_a_partition_never_draws():
    """Dropout in plain code draws only in training: a forward in eval mode leaves it unknown."""
    from pipexplore.rng_guard import rng_locks

    class PlainDropout(nn.Module):
        def forward(self, x):
            return F.dropout(x, 0.5, self.training)

    model = nn.Sequential(nn.Linear(16, 16), PlainDropout())
    guard = rng_locks([model, nn.Identity()], [torch.device("cpu")] * 2)[0]
    x = torch.randn(4, 16)
    with guard.drawing():
        model.eval()(x)
    assert guard.draws is None
    with guard.drawing():
        model.train()(x)
    assert guard.draws is True


def test_which_partitions_are_guarded_and_known_to_draw():
    """A guard only where partitions share a generator (CPU stages share the CPU's; a GPU's stages
    share its own); a dropout of 0 (a module's ``p``, attention's ``dropout``) is not known to draw."""
    from pipexplore.rng_guard import has_randomness, rng_locks

    cpu, gpu0, gpu1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
    parts = [nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)]
    assert rng_locks(parts[:2], [gpu0, gpu1]) == [None, None]
    guards = rng_locks(parts, [cpu, gpu0, cpu])
    assert guards[1] is None and guards[0].lock is guards[2].lock and guards[0].device == cpu
    on_one_gpu = rng_locks(parts[:2], [gpu0, gpu0])
    assert on_one_gpu[0].lock is on_one_gpu[1].lock
    assert not has_randomness(nn.Sequential(_encoder_layer(0.0), _encoder_layer(0.0)))
    assert has_randomness(_encoder_layer(0.1))
    assert has_randomness(nn.MultiheadAttention(16, 2, dropout=0.1))
    assert not has_randomness(nn.MultiheadAttention(16, 2))
    assert has_randomness(nn.RReLU()) and not has_randomness(nn.Dropout(0.0))


def test_skip_tensors_are_freed_after_backward():
    refs: list = []
    model = unet_model(refs=refs)
    pipe = GPipe(model, balance=[2, 6, 1], devices=["cpu"] * 3, chunks=4, checkpoint="except_last")
    out = pipe(torch.randn(8, 6))
    out.sum().backward()
    del out
    gc.collect()
    assert refs, "the stash layers ran"
    assert all(r() is None for r in refs)


def test_crossing_skip_is_freed_right_after_its_pop_without_checkpointing():
    refs: list = []
    model = unet_model(refs=refs)
    # outer skip 1 → 7 crosses from partition 0 to 2; nothing in autograd keeps `y * 2` alive.
    pipe = GPipe(model, balance=[2, 6, 1], devices=["cpu"] * 3, chunks=2, checkpoint="never")
    out = pipe(torch.randn(4, 6))
    gc.collect()
    outer_refs = refs[0::2]  # stash order per micro-batch: outer, inner
    assert all(r() is None for r in outer_refs)
    out.sum().backward()


def test_crossing_skip_is_kept_for_recomputation_under_checkpointing():
    refs: list = []
    pipe = GPipe(unet_model(refs=refs), balance=[2, 6, 1], devices=["cpu"] * 3, chunks=2, checkpoint="always")
    out = pipe(torch.randn(4, 6))
    gc.collect()
    assert any(r() is not None for r in refs)  # the pop partition will recompute with it
    out.sum().backward()
    del out
    gc.collect()
    assert all(r() is None for r in refs)


class _Meets(nn.Module):
    """Waits at a barrier its partner meets on ``meet`` of its calls: both must be inside their
    forward at once, or the barrier breaks (no timing: overlap or not)."""

    def __init__(self, barrier: threading.Barrier, meet: set[int]) -> None:
        super().__init__()
        self.barrier, self.meet, self.calls = barrier, meet, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.calls in self.meet:
            self.barrier.wait()
        self.calls += 1
        return x


def test_partitions_sharing_the_cpu_overlap():
    # Ticks 1..3 each run partition 0 on micro-batch i and partition 1 on micro-batch i-1 together:
    # partition 0 meets its partner on micro-batches 1-3, partition 1 on 0-2.
    barrier = threading.Barrier(2, timeout=30)
    model = nn.Sequential(_Meets(barrier, {1, 2, 3}), _Meets(barrier, {0, 1, 2}))
    pipe = GPipe(model, balance=[1, 1], devices=["cpu", "cpu"], chunks=4, checkpoint="never")
    with torch.no_grad():
        pipe(torch.ones(4, 1))
    assert not barrier.broken and model[0].calls == model[1].calls == 4


def test_one_worker_thread_per_partition_and_none_left_behind():
    names = []

    class Who(nn.Module):
        def forward(self, x):
            names.append(threading.current_thread().name)
            return x

    before = set(threading.enumerate())
    pipe = GPipe(nn.Sequential(Who(), Who(), Who()), balance=[1, 1, 1], devices=["cpu"] * 3, chunks=2)
    pipe(torch.ones(2, 1))
    assert set(names) == {"pipexplore-partition0", "pipexplore-partition1", "pipexplore-partition2"}
    assert set(threading.enumerate()) == before


def test_micro_batch_i_on_partition_j_at_tick_i_plus_j():
    assert list(clock_cycles(3, 3)) == [
        [(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1), (0, 2)], [(2, 1), (1, 2)], [(2, 2)],
    ]
    assert list(clock_cycles(1, 2)) == [[(0, 0)], [(0, 1)]]


def test_backward_runs_in_mirrored_order():
    order = []

    class _NoteGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, j):
            ctx.j, ctx.key = j, int(x[0, 0].item())
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            order.append((ctx.j, ctx.key))
            return g, None

    class Note(nn.Module):
        def __init__(self, j):
            super().__init__()
            self.j = j

        def forward(self, x):
            return _NoteGrad.apply(x, self.j)

    pipe = GPipe(nn.Sequential(Note(0), Note(1), nn.Linear(1, 1)), balance=[1, 2], devices=["cpu", "cpu"],
                 chunks=3, checkpoint="never")
    x = torch.tensor([[0.0], [1.0], [2.0]], requires_grad=True)
    pipe(x).sum().backward()
    # Every partition sees the micro-batches in reverse, and partition 1 before partition 0.
    assert [key for j, key in order if j == 1] == [2, 1, 0]
    assert [key for j, key in order if j == 0] == [2, 1, 0]
    assert order.index((1, 0)) < order.index((0, 0))


def test_deferred_batch_norm_tracks_statistics_per_mini_batch():
    bn = nn.BatchNorm1d(4)
    model = nn.Sequential(nn.Linear(4, 4), bn)
    ref = copy.deepcopy(model)
    x = torch.randn(16, 4) * 3 + 1
    ref(x)
    pipe = GPipe(model, balance=[1, 1], devices=["cpu", "cpu"], chunks=4, deferred_batch_norm=True,
                 checkpoint="always")
    pipe(x).sum().backward()  # recomputation must not count twice
    deferred = pipe.partitions[1][0]
    assert type(deferred).__name__ == "DeferredBatchNorm"
    torch.testing.assert_close(deferred.running_mean, ref[1].running_mean)
    torch.testing.assert_close(deferred.running_var, ref[1].running_var)
    assert int(deferred.num_batches_tracked) == 1


def test_attributes_and_layer_access():
    model = plain_model()
    layers = list(model)
    pipe = GPipe(model, balance=[3, 5], devices=["cpu", "cpu"], chunks=2, checkpoint="never")
    assert pipe.balance == [3, 5] and pipe.chunks == 2 and pipe.checkpoint == "never"
    assert pipe.devices == [torch.device("cpu")] * 2
    assert [len(p) for p in pipe.partitions] == [3, 5]
    assert len(pipe) == 8 and list(pipe) == layers and pipe[-1] is layers[-1] and pipe[3] is layers[3]
    assert list(pipe.partitions[1]._modules) == ["3", "4", "5", "6", "7"]


def test_default_devices_without_cuda_are_cpu():
    if torch.cuda.is_available():
        pytest.skip("machine has CUDA")
    pipe = GPipe(plain_model(), balance=[4, 4])
    assert pipe.devices == [torch.device("cpu")] * 2


# ---- errors, raised at construction with messages that say what to do ----

@pytest.mark.parametrize("kwargs,error,message", [
    (dict(balance=[4, 3]), ValueError, r"balance \[4, 3\] sums to 7 but the module has 8 layers"),
    (dict(balance=[8, 0]), ValueError, r"sums to 8 but the module has 8|partition 1 has 0 layers"),
    (dict(balance=[9, -1]), ValueError, r"partition 1 has -1 layers; every partition needs at least 1"),
    (dict(balance=[]), ValueError, r"balance is empty"),
    (dict(balance=None), ValueError, r"balance is required"),
    (dict(balance=[4, 4], chunks=0), ValueError, r"number of chunks must be a positive integer, got 0"),
    (dict(balance=[4, 4], checkpoint="sometimes"), ValueError,
     r"checkpoint is not one of 'always', 'except_last', or 'never', got 'sometimes'"),
    (dict(balance=[2, 2, 4], devices=["cpu", "cpu"]), IndexError,
     r"too few devices to hold given partitions \(devices: 2, partitions: 3\)"),
    (dict(balance=[4, 4], devices=["tpu:0", "cpu"]), (ValueError, RuntimeError), r"tpu"),
])
def test_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        GPipe(plain_model(), **kwargs)


def test_arguments_coerced_as_torchgpipe_does_and_the_rest_refused():
    class Mode:
        def __str__(self):
            return "never"

    pipe = GPipe(plain_model(), balance=(4.0, 4), devices=["cpu", "cpu"], chunks=4.0, checkpoint=Mode())
    assert pipe.balance == [4, 4] and pipe.chunks == 4 and type(pipe.chunks) is int
    assert pipe.checkpoint == "never" and type(pipe.checkpoint) is str
    with pytest.raises(TypeError, match=r"balance must be a list of ints .* got \[3.5, 4.5\]"):
        GPipe(plain_model(), balance=[3.5, 4.5])  # refused, not truncated to [3, 4]
    for chunks in (2.5, True):
        with pytest.raises(TypeError, match=rf"number of chunks must be a positive integer, got {chunks}"):
            GPipe(plain_model(), balance=[4, 4], devices=["cpu", "cpu"], chunks=chunks)
    with pytest.raises(ValueError, match="checkpoint is not one of 'always', 'except_last', or 'never', got None"):
        GPipe(plain_model(), balance=[4, 4], devices=["cpu", "cpu"], checkpoint=None)


def test_empty_module_is_the_identity():
    pipe = GPipe(nn.Sequential(), [])
    x = torch.randn(3, 2)
    assert pipe(x) is x and pipe((x, x)) == (x, x)
    with pytest.raises(TypeError, match="expected a tensor or a tuple of tensors, got int"):
        pipe(42)
    with pytest.raises(ValueError, match=r"balance \[1\] sums to 1 but the module has 0 layers: .*pipexplore.balance"):
        GPipe(nn.Sequential(), [1])


def test_tuple_tensors_of_different_batch_sizes_are_split_each_by_its_own():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, pair):
            a, b = pair
            return a * 2, self.fc(b) + a.sum()

    model = nn.Sequential(Pair(), Pair())
    a, b = torch.randn(4, 1), torch.randn(8, 2)
    pipe = GPipe(copy.deepcopy(model), balance=[1, 1], devices=["cpu", "cpu"], chunks=2, checkpoint="never")
    out_a, out_b = pipe((a, b))
    # Each micro-batch holds 2 rows of a and 4 of b: the second layer adds its micro-batch's sum of a.
    mid_a, mid_b = model[0]((a[:2], b[:4])), model[0]((a[2:], b[4:]))
    expected = [model[1](mid_a), model[1](mid_b)]
    torch.testing.assert_close(out_a, torch.cat([expected[0][0], expected[1][0]]))
    torch.testing.assert_close(out_b, torch.cat([expected[0][1], expected[1][1]]))
    with pytest.raises(ValueError, match=r"split into different numbers of micro-batches with chunks=2 "
                                         r"\(tensor 0: 1 rows into 1, tensor 1: 8 rows into 2\)"):
        pipe((torch.randn(1, 1), b))


def test_zero_partition_message():
    with pytest.raises(ValueError, match=r"partition 1 has 0 layers"):
        GPipe(plain_model(), balance=[8, 0], devices=["cpu", "cpu"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_device_without_cuda():
    with pytest.raises(ValueError, match=r"device 'cuda:0' does not exist: CUDA is not available"):
        GPipe(plain_model(), balance=[4, 4], devices=["cuda:0", "cpu"])


@pytest.mark.gpu
def test_cuda_device_that_does_not_exist():
    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"device 'cuda:{n}' does not exist: {n} CUDA device\(s\) visible"):
        GPipe(plain_model(), balance=[4, 4], devices=[f"cuda:{n}", "cpu"])


def test_non_sequential_module():
    with pytest.raises(TypeError, match="module must be nn.Sequential to be partitioned, got Linear"):
        GPipe(nn.Linear(2, 2), balance=[1])


def test_repeated_module():
    layer = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="duplicate children.*layer 2 is the same module as layer 0"):
        GPipe(nn.Sequential(layer, nn.ReLU(), layer), balance=[1, 1, 1], devices=["cpu"] * 3)


def test_parameter_shared_by_distinct_layers_is_refused_as_torchgpipe_does():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    b.weight = a.weight
    message = (r"module with duplicate parameters in distinct children is not supported: '1.weight' is the "
               r"parameter '0.weight'; put the layers that share it in one child")
    for balance in ([1, 1], [2]):
        with pytest.raises(ValueError, match=message):
            GPipe(nn.Sequential(a, b), balance=balance, devices=["cpu"] * len(balance))
    # Shared inside one child, it lives in one partition: fine, and trains as the unsplit model.
    model = nn.Sequential(nn.Sequential(a, b), nn.ReLU())
    x = torch.randn(4, 2)
    expected, expected_grads = _reference_step(model, x)
    pipe, out, grads = _pipe_step(model, x, balance=[1, 1], devices=["cpu"] * 2, chunks=2)
    torch.testing.assert_close(out, expected)
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e)


def test_unmatched_skips_are_refused_at_construction():
    model = unet_model()
    del model[7]  # the outer pop
    with pytest.raises(TypeError, match=r"no module declared 'skip' as poppable but stashed "
                                        r"\('1' \(StashLinear\) stashes it"):
        GPipe(model, balance=[4, 4], devices=["cpu"] * 2)


@pytest.mark.parametrize("move", [
    lambda p: p.cuda(), lambda p: p.cpu(), lambda p: p.to("cpu"), lambda p: p.to(torch.device("cpu")),
    lambda p: p.to(device="cpu"), lambda p: p.to(torch.zeros(1)),
])
def test_moving_is_refused(move):
    pipe = GPipe(plain_model(), balance=[4, 4], devices=["cpu", "cpu"])
    with pytest.raises(TypeError, match="denied to move parameters and buffers"):
        move(pipe)


def test_changing_dtype_is_allowed():
    pipe = GPipe(plain_model(), balance=[4, 4], devices=["cpu", "cpu"])
    pipe.to(torch.float64)
    assert all(p.dtype == torch.float64 for p in pipe.parameters())


def test_bad_input_types():
    pipe = GPipe(plain_model(), balance=[4, 4], devices=["cpu", "cpu"])
    with pytest.raises(TypeError, match="expected a tensor or a tuple of tensors, got list"):
        pipe([torch.ones(1, 6)])
    with pytest.raises(TypeError, match="got an empty tuple"):
        pipe(())


def test_layer_error_propagates_and_leaves_no_thread():
    class Boom(nn.Module):
        def forward(self, x):
            raise ArithmeticError("boom in layer")

    before = set(threading.enumerate())
    pipe = GPipe(nn.Sequential(nn.Linear(2, 2), Boom()), balance=[1, 1], devices=["cpu"] * 2, chunks=3)
    with pytest.raises(ArithmeticError, match="boom in layer"):
        pipe(torch.ones(3, 2))
    assert set(threading.enumerate()) == before


@pytest.mark.gpu
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_cuda_outputs_and_gradients_equal_sequential(checkpoint):
    n = torch.cuda.device_count()
    devices = [f"cuda:{k % n}" for k in range(3)]
    model = unet_model()
    x = torch.randn(10, 6)
    expected, expected_grads = _reference_step(model, x)
    pipe = GPipe(copy.deepcopy(model), balance=[2, 6, 1], devices=devices, chunks=4, checkpoint=checkpoint)
    out = pipe(x.to(pipe.devices[0]))
    out.pow(2).sum().backward()
    torch.testing.assert_close(out.cpu(), expected)
    for g, e in zip(pipe.parameters(), expected_grads, strict=True):
        torch.testing.assert_close(g.grad.cpu(), e)


@pytest.mark.gpu
def test_cpu_and_cuda_partitions_mixed():
    model = unet_model()
    x = torch.randn(6, 6)
    expected, expected_grads = _reference_step(model, x)
    pipe = GPipe(copy.deepcopy(model), balance=[2, 6, 1], devices=["cpu", "cuda:0", "cpu"], chunks=3)
    out = pipe(x)
    out.pow(2).sum().backward()
    torch.testing.assert_close(out, expected)
    for g, e in zip(pipe.parameters(), expected_grads, strict=True):
        torch.testing.assert_close(g.grad.cpu(), e)


def test_a_partition_runs_its_next_micro_batch_without_waiting_for_a_slower_partition():
    # Stage 0 takes 5 ms a micro-batch, stage 1 takes 30 ms. Tick by tick, stage 0 would wait for
    # stage 1 at every tick (its 4 forwards ending after ~65 ms); as soon as its own inputs are
    # there, it runs them back to back (~20 ms) while stage 1 works through its queue.
    from models import SleepFB
    from pipexplore.timeline import record

    model = nn.Sequential(SleepFB(0.005, 0.001), SleepFB(0.030, 0.001))
    pipe = GPipe(model, balance=[1, 1], devices=["cpu", "cpu"], chunks=4, checkpoint="never")
    x = torch.ones(4, 1, requires_grad=True)
    reference = copy.deepcopy(model)
    with record() as rec:
        pipe(x).sum().backward()
    forward = rec.timeline[rec.timeline["phase"] == "forward"]
    stage0_done = forward[forward["stage"] == 0]["end"].max()
    stage1 = forward[forward["stage"] == 1].sort_values("start")
    assert stage0_done < stage1["end"].iloc[1]  # all of stage 0 before stage 1's second micro-batch ends
    # The same gradients as the plain model.
    x2 = x.detach().clone().requires_grad_()
    reference(x2).sum().backward()
    assert torch.allclose(x.grad, x2.grad)
    for a, b in zip(pipe.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad)


def test_each_partitions_worker_starts_its_own_tasks_after_the_first():
    # The caller starts (0, 0); then each partition's worker takes its task's output back and
    # starts its own next task (no hand-off through the caller), the next partition's worker
    # starting its tasks once poked. The graph, and so the gradients, are the clock order's.
    import pipexplore.pipeline as pipeline

    starters = {}
    start = pipeline.Pipeline._start

    def spy(self, i, j, *args):
        starters[(i, j)] = threading.current_thread().name
        return start(self, i, j, *args)

    model = nn.Sequential(nn.Linear(3, 3), nn.GELU(), nn.Linear(3, 3), nn.Linear(3, 1))
    x = torch.randn(6, 3)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline.Pipeline, "_start", spy)
        pipe, out, grads = _pipe_step(model, x, balance=[2, 1, 1], devices=["cpu"] * 3, chunks=3)
    assert starters.pop((0, 0)) == threading.current_thread().name
    assert starters == {key: f"pipexplore-partition{key[1]}" for key in starters} and len(starters) == 8
    expected_out, expected = _reference_step(model, x)
    torch.testing.assert_close(out, expected_out)
    for a, b in zip(grads, expected, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("where", ["fence", "_finish"])
def test_an_error_while_a_worker_builds_the_graph_is_raised_once_and_leaves_no_thread(where):
    import pipexplore.pipeline as pipeline

    real = getattr(pipeline.Pipeline, where)
    calls = []

    def failing(self, i, j, *args):
        calls.append((i, j))
        if (i, j) == (2, 1):
            raise RuntimeError(f"{where} failed at (2, 1)")
        return real(self, i, j, *args)

    before = set(threading.enumerate())
    pipe = GPipe(nn.Sequential(Sleep(0.002), Sleep(0.002)), balance=[1, 1], devices=["cpu"] * 2, chunks=6)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline.Pipeline, where, failing)
        with pytest.raises(RuntimeError, match=rf"{where} failed at \(2, 1\)"):
            pipe(torch.ones(6, 1))
    assert set(threading.enumerate()) == before
    assert (5, 1) not in calls  # nothing more started after the error
    assert pipe(torch.ones(6, 1)).shape == (6, 1)  # and the next step runs whole
