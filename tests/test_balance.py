"""Exact balancing, split points ⇄ balance, and layer profiles."""
from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from models import Sleep, unet_model
from pipexplore.balance import balance_by_size, balance_by_time, balance_cost, optimal_splits
from pipexplore.profile import LAYER_COLUMNS, profile
from pipexplore.splits import SplitError, balance_to_splits, check_splits, splits_to_balance


def _bottleneck(costs, splits):
    points = [0, *splits, len(costs)]
    return max(sum(costs[a:b]) for a, b in zip(points, points[1:]))


def _brute_force(costs, partitions):
    n = len(costs)
    return min(_bottleneck(costs, list(cut)) for cut in itertools.combinations(range(1, n), partitions - 1))


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


def test_profile_times_follow_the_layers():
    model = nn.Sequential(Sleep(0.001), Sleep(0.02))
    table = profile(model, torch.ones(2, 1), repeats=3)
    assert table.loc[1, "forward"] >= 0.02 and table.loc[0, "forward"] < 0.02


def test_profile_errors():
    with pytest.raises(TypeError, match="profile needs an nn.Sequential, got Linear"):
        profile(nn.Linear(2, 2), torch.ones(1, 2))
    with pytest.raises(ValueError, match="cannot profile an empty module"):
        profile(nn.Sequential(), torch.ones(1, 2))
