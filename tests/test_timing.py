"""Timing with the caches flushed: before every timed call, never inside it."""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import pipexplore
from pipexplore.models.blockwise import profile_blockwise
from pipexplore.profiling import timing
from pipexplore.profiling.timing import CacheFlush, Timer, flush_bytes

SLOW_FLUSH = 0.02  # seconds a flush takes in these tests: far more than a tiny layer's call


@pytest.fixture
def slow_flushes(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every CacheFlush call recorded (its time) and made slow, so that a flush timed with a call shows."""
    calls: list[float] = []

    def flush(self: CacheFlush) -> None:
        calls.append(time.perf_counter())
        time.sleep(SLOW_FLUSH)

    monkeypatch.setattr(timing.CacheFlush, "__call__", flush)
    return calls


def test_a_flush_writes_more_than_a_cores_private_caches() -> None:
    flush = CacheFlush(torch.device("cpu"))
    assert flush.buffer.numel() == flush_bytes(torch.device("cpu")) >= 16 * 2**20 // 2
    flush.buffer.zero_()
    flush()
    assert bool((flush.buffer == 1).all())
    assert CacheFlush(torch.device("cpu"), nbytes=1024).buffer.numel() == 1024


def test_the_timer_flushes_before_each_call_outside_its_time(slow_flushes: list[float]) -> None:
    timer = Timer(torch.device("cpu"), CacheFlush(torch.device("cpu"), nbytes=64))
    for _ in range(3):
        timer(lambda: None)
    assert len(slow_flushes) == 3
    # (the median: one preemption may hold one call; a flush inside the timed call would hold all)
    assert sorted(timer.wall)[1] < SLOW_FLUSH / 2
    plain = Timer(torch.device("cpu"))
    plain(lambda: None)
    assert len(slow_flushes) == 3


def test_profile_with_cold_caches_flushes_before_every_timed_call(slow_flushes: list[float]) -> None:
    torch.manual_seed(0)
    model, sample = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), torch.randn(8, 8)
    table = pipexplore.profile(model, sample, repeats=3, max_repeats=3, microbatch_rows=[4, 8],
                               split_backward=False, cold_cache=True)
    # each size: three rounds of a forward and a backward per layer, and the whole model's
    # forward and two backwards after one untimed round and three timed ones
    layers_timed = 2 * 3 * 2 * len(model)
    whole_model = 2 * 4 * 3
    assert len(slow_flushes) == layers_timed + whole_model
    assert float((table["forward"] + table["backward"]).max()) < SLOW_FLUSH  # no flush timed
    slow_flushes.clear()
    pipexplore.profile(model, sample, repeats=3, max_repeats=3, microbatch_rows=[4, 8], split_backward=False)
    assert slow_flushes == []  # warm caches unless asked


def test_blockwise_profile_with_cold_caches_flushes_before_every_timed_call(slow_flushes: list[float]) -> None:
    torch.manual_seed(0)
    model, sample = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)), torch.randn(8, 8)
    table = profile_blockwise(model, sample, device="cpu", microbatch_rows=[4, 8], repeats=2, cold_cache=True)
    kinds = 2  # the two Linear layers are one kind, timed once
    assert len(slow_flushes) == kinds * 2 * 2 * 2  # kinds × sizes × repeats × (forward, backward)
    assert float((table["forward"] + table["backward"]).max()) < SLOW_FLUSH


def test_a_cuda_flush_is_twice_the_l2_or_tritons_256_mib(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA branch, read without a GPU: twice the card's L2 where its properties give it."""
    import types

    cuda = torch.device("cuda", 0)
    l2 = types.SimpleNamespace(L2_cache_size=50 * 2**20)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: l2)
    assert flush_bytes(cuda) == 100 * 2**20
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace())
    assert flush_bytes(cuda) == 256 * 2**20


def test_a_cpu_flush_is_eight_times_the_largest_cache_of_one_core(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Caches shared between cores (the last level) do not count; 32 MiB where /sys says nothing."""
    caches = {"index0": ("48K", "0"), "index2": ("2048K", "0"), "index3": ("307200K", "0-1")}
    for name, (size, shared) in caches.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "size").write_text(size + "\n")
        (tmp_path / name / "shared_cpu_list").write_text(shared + "\n")
    (tmp_path / "uevent").write_text("")
    monkeypatch.setattr(timing, "CPU_CACHES", str(tmp_path))
    assert flush_bytes(torch.device("cpu")) == 8 * 2048 * 2**10
    (tmp_path / "index2" / "shared_cpu_list").write_text("0,1\n")  # no cache of one core's own
    assert flush_bytes(torch.device("cpu")) == 8 * 48 * 2**10
    monkeypatch.setattr(timing, "CPU_CACHES", str(tmp_path / "absent"))
    assert flush_bytes(torch.device("cpu")) == 32 * 2**20
