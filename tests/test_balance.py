"""Exact balancing, split points ⇄ balance, and layer profiles."""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from torch import nn

from models import Sleep, unet_model
from pipexplore.balance import (balance_by_size, balance_by_time, balance_cost, blockpartition, largest_stage,
                                optimal_splits)
from pipexplore.profiling.sequential import LAYER_COLUMNS, profile
from pipexplore.splits import SplitError, balance_to_splits, check_splits, splits_to_balance


def _bottleneck(costs, splits):
    points = [0, *splits, len(costs)]
    return max(sum(costs[a:b]) for a, b in zip(points, points[1:]))


def _brute_force(costs, partitions):
    n = len(costs)
    return min(_bottleneck(costs, list(cut)) for cut in itertools.combinations(range(1, n), partitions - 1))


def _stage_sums(costs, splits):
    points = [0, *splits, len(costs)]
    return [sum(costs[a:b]) for a, b in zip(points, points[1:])]


def _brute_force_even(costs, partitions):
    """The least (largest stage, sum of squared stages), lexicographically, over every split."""
    n = len(costs)
    best = None
    for cut in itertools.combinations(range(1, n), partitions - 1):
        sums = _stage_sums(costs, list(cut))
        key = (max(sums), sum(x * x for x in sums))
        if best is None or key[0] < best[0] - 1e-9 or (abs(key[0] - best[0]) <= 1e-9 and key[1] < best[1]):
            best = key
    return best


def test_optimal_splits_equal_brute_force_on_random_costs():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 10)
        partitions = rng.randint(1, n)
        costs = [rng.choice([0.0, rng.random(), float(rng.randint(0, 5))]) for _ in range(n)]
        splits = optimal_splits(costs, partitions)
        assert len(splits) == partitions - 1 and splits == sorted(set(splits))
        assert all(0 < s < n for s in splits)
        assert _bottleneck(costs, splits) == pytest.approx(_brute_force(costs, partitions))


@pytest.mark.parametrize("n,k", [(8, 2), (8, 3), (9, 4), (10, 4), (17, 5), (64, 7), (100, 8), (1000, 64), (1000, 16)])
def test_identical_layers_balance_evenly(n, k):
    balance = balance_cost([1.0] * n, k)
    assert sum(balance) == n and len(balance) == k
    assert max(balance) - min(balance) <= 1
    other = balance_cost([0.37] * n, k)  # any equal cost (sums then tie up to rounding)
    assert sum(other) == n and max(other) - min(other) <= 1


def test_identical_layers_examples():
    assert optimal_splits([1] * 8, 2) == [4]
    assert balance_cost([1] * 10, 4) in ([3, 3, 2, 2], [2, 3, 3, 2], [3, 2, 3, 2], [2, 2, 3, 3], [2, 3, 2, 3],
                                         [3, 2, 2, 3])
    assert balance_cost([0.0] * 6, 3) == [2, 2, 2]  # nothing to balance: even by layers


def test_ties_of_the_slowest_stage_even_out_the_others():
    # The 10 must sit alone (largest stage 10); the other stages share the ones: 3 | 3 rather than 1 | 5.
    assert balance_cost([10, 1, 1, 1, 1, 1, 1], 3) == [1, 3, 3]
    assert balance_cost([1, 1, 1, 1, 1, 1, 10], 3) == [3, 3, 1]
    # Random costs: the largest stage is the exact optimum's, the others no wider apart than needed.
    rng = np.random.default_rng(5)
    costs = rng.random(1000)
    splits = optimal_splits(costs, 64)
    assert largest_stage(costs, splits) == pytest.approx(largest_stage(costs, _leftmost_min_max(costs, 64)))
    assert min(splits_to_balance(splits, 1000)) >= 8


def _leftmost_min_max(costs, partitions):
    """A min–max optimal split by an independent route: greedy from the right against the bisected optimum."""
    limit = _min_max_by_bisection(costs, partitions)
    splits, total = [], 0.0
    for index in range(len(costs) - 1, -1, -1):
        if total + costs[index] > limit or index < partitions - 1 - len(splits):
            splits.append(index + 1)
            total = 0.0
        total += costs[index]
        if len(splits) == partitions - 1:
            break
    return sorted(splits)


def _min_max_by_bisection(costs, partitions):
    lo, hi = max(costs), sum(costs)
    for _ in range(200):
        mid = (lo + hi) / 2
        stages, total = 1, 0.0
        for c in costs:
            if total + c > mid:
                stages, total = stages + 1, 0.0
            total += c
        lo, hi = (mid, hi) if stages > partitions else (lo, mid)
    return hi


def test_even_splits_keep_the_min_max_optimum_and_minimise_the_squares_on_random_costs():
    rng = random.Random(11)
    for _ in range(400):
        n = rng.randint(1, 10)
        partitions = rng.randint(1, n)
        costs = [rng.choice([0.0, rng.random(), float(rng.randint(0, 5)), 100 * rng.random()]) for _ in range(n)]
        splits = optimal_splits(costs, partitions)
        sums = _stage_sums(costs, splits)
        largest, squares = _brute_force_even(costs, partitions)
        assert max(sums) == pytest.approx(largest)
        assert sum(x * x for x in sums) == pytest.approx(squares)


@pytest.mark.parametrize("shape", ["uniform", "skewed", "one giant"])
def test_many_candidates_per_stage_give_the_same_optimum_as_the_dense_search(shape, monkeypatch):
    from pipexplore.balance import optimal

    rng = np.random.default_rng(3)
    costs = {"uniform": rng.random(300), "skewed": rng.random(300) ** 8,
             "one giant": np.r_[rng.random(150) * 0.1, 500.0, rng.random(149) * 0.1]}[shape]
    dense = optimal_splits(costs, 12)
    monkeypatch.setattr(optimal, "_DENSE_LIMIT", 0)  # every stage through sampled rows (monotone minima)
    sampled = optimal_splits(costs, 12)
    for splits in (dense, sampled):
        assert largest_stage(costs, splits) == pytest.approx(largest_stage(costs, _leftmost_min_max(list(costs), 12)))
    assert sum(x * x for x in _stage_sums(list(costs), sampled)) == pytest.approx(
        sum(x * x for x in _stage_sums(list(costs), dense)))


def test_blockpartition_solve_returns_the_blocks():
    assert blockpartition.solve([1, 2, 3, 4, 5, 6], partitions=2) == [[1, 2, 3, 4], [5, 6]]
    assert blockpartition.solve([3, 3, 3, 3], partitions=2) == [[3, 3], [3, 3]]
    with pytest.raises(ValueError, match=r"sequence is shorter than intended partitions \(1 < 2\)"):
        blockpartition.solve([42], partitions=2)
    with pytest.raises(ValueError, match="partitions must be a positive integer, got 0"):
        blockpartition.solve([42], partitions=0)


def test_balance_by_time_profiles_a_copy():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), Sleep(0.002)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert len(balance_by_time(2, model, torch.randn(8, 4), device="cpu", timeout=0.2)) == 2
    assert not model.training
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    model.train()(torch.randn(8, 4)).sum().backward()
    with pytest.raises(ValueError, match=r"some parameter already has gradient \('0.weight'\): .*zero_grad"):
        balance_by_time(2, model, torch.randn(8, 4), device="cpu")


def test_balance_cost_examples():
    assert balance_cost([1, 1, 1, 1], 2) == [2, 2]
    assert balance_cost([4, 1, 1, 1, 1], 2) == [1, 4]
    assert balance_cost([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [5, 2, 2]  # 15 | 13 | 17 → best max 17
    assert balance_cost([5, 5], 2) == [1, 1]


@pytest.mark.parametrize("costs,partitions,message", [
    ([], 1, "cannot balance an empty module"),
    ([1, 2], 3, r"more partitions \(3\) than layers \(2\)"),
    ([1, 2], 0, "partitions must be at least 1, got 0"),
    ([1, -2], 1, "costs must be finite and non-negative"),
])
def test_balance_errors(costs, partitions, message):
    with pytest.raises(ValueError, match=message):
        optimal_splits(costs, partitions)


@pytest.mark.timing
def test_balance_by_time_follows_layer_times():
    model = nn.Sequential(Sleep(0.03), Sleep(0.003), Sleep(0.003), Sleep(0.003), Sleep(0.01))
    # [1, 4] costs 30 | 19 ms; the next best, [2, 3], 33 | 16 ms.
    assert balance_by_time(2, model, torch.ones(2, 1), device="cpu", timeout=0.3) == [1, 4]
    with pytest.raises(ValueError, match=r"more partitions \(6\) than layers \(5\)"):
        balance_by_time(6, model, torch.ones(2, 1), device="cpu")
    with pytest.raises(ValueError, match="empty module"):
        balance_by_time(1, nn.Sequential(), torch.ones(2, 1), device="cpu")


def test_balance_by_size_counts_parameters_and_activations():
    model = nn.Sequential(nn.Linear(100, 100), nn.ReLU(), nn.ReLU(), nn.ReLU(), nn.Linear(100, 100))
    # Each Linear: 40,400 parameter bytes × 2 + 1,600 activation bytes; each ReLU: 1,600 bytes.
    # The two Linear layers end up in different partitions; [2, 3] and [3, 2] tie, the earlier cut wins.
    assert balance_by_size(2, model, torch.randn(4, 100), device="cpu") == [2, 3]  # 84,000 | 85,600 bytes
    # With parameters weighted 0, only activations count: 5 equal layers, 2 | 3 and 3 | 2 tie.
    assert balance_by_size(2, model, torch.randn(4, 100), param_scale=0.0, device="cpu") == [2, 3]
    with pytest.raises(ValueError, match="chunks must be at least 1"):
        balance_by_size(2, model, torch.randn(4, 100), chunks=0, device="cpu")


def test_splits_and_balance_round_trip():
    assert splits_to_balance([2], 5) == [2, 3]
    assert balance_to_splits([2, 3]) == [2]
    assert balance_to_splits([1, 1, 1]) == [1, 2]
    assert splits_to_balance([], 4) == [4]
    for balance in ([3], [1, 2, 3], [4, 1, 1, 2]):
        assert splits_to_balance(balance_to_splits(balance), sum(balance)) == balance


@pytest.mark.parametrize("splits,message", [
    ([12], r"split point 12 is past the last layer \(11\)"),
    ([0], "split point 0 must be at least 1"),
    ([5, 3], "split points must be sorted: 3 comes after 5"),
    ([3, 3], "split point 3 is repeated"),
    ([2.5], "split point 2.5 is not a layer index"),
])
def test_split_errors_say_what_is_wrong(splits, message):
    with pytest.raises(SplitError, match=message):
        check_splits(splits, 12)
    with pytest.raises(SplitError):
        balance_to_splits([2, 0, 1])


def test_profile_table():
    model = unet_model(width=6)
    table = profile(model, torch.randn(32, 6), repeats=3)
    assert list(table.columns)[:len(LAYER_COLUMNS)] == LAYER_COLUMNS
    assert table["stash_keys"][1].startswith("skip@") and table["stash_keys"][1] != table["stash_keys"][3]
    assert table["name"].tolist() == [str(k) for k in range(9)]
    assert table["type"].tolist()[:2] == ["Linear", "StashLinear"]
    assert (table["param_bytes"] == (6 * 6 + 6) * 4).all()
    # Plain layers output 32×6 floats; stash layers add the stashed tensor.
    assert table.loc[0, "output_bytes"] == 32 * 6 * 4
    assert table.loc[1, "output_bytes"] == 2 * 32 * 6 * 4
    assert table["stash"].tolist() == ["", "skip", "", "skip", "", "", "", "", ""]
    assert table["pop"].tolist() == ["", "", "", "", "", "skip", "", "skip", ""]
    assert (table["forward"] > 0).all() and (table["backward"] > 0).all()


@pytest.mark.timing
def test_profile_times_follow_the_layers():
    model = nn.Sequential(Sleep(0.001), Sleep(0.02))
    table = profile(model, torch.ones(2, 1), repeats=3)
    # (calibration scales every layer alike to the whole model's time: a sleep's lateness may move
    # each a little either way; their ratio, ~15 slept, stays)
    assert table.loc[1, "forward"] >= 0.95 * 0.02 and table.loc[0, "forward"] < 0.02
    assert table.loc[1, "forward"] > 5 * table.loc[0, "forward"]


def test_profile_errors():
    with pytest.raises(TypeError, match="profile needs an nn.Sequential, got Linear"):
        profile(nn.Linear(2, 2), torch.ones(1, 2))
    with pytest.raises(ValueError, match="cannot profile an empty module"):
        profile(nn.Sequential(), torch.ones(1, 2))
