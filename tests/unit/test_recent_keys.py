"""RecentKeys: keys added within a horizon, in fixed memory (a rotating Bloom filter)."""

from __future__ import annotations

import pytest

from kvsidecar.daemon.recent_keys import RecentKeys


def test_every_key_added_within_the_horizon_is_found_and_forgotten_after() -> None:
    keys = RecentKeys(100.0, capacity=1000, slices=4)
    for i in range(3000):  # a key every 0.05 s: 150 s, past the horizon
        keys.add(b"k%d" % i, now=i * 0.05)
    now = 3000 * 0.05
    assert all(keys.may_contain(b"k%d" % i, now) for i in range(1000, 3000))  # within 100 s
    assert not keys.saturated(now) and keys.overflows == 0
    assert not keys.may_contain(b"k0", now + 200)  # everything aged out


def test_false_positives_stay_under_one_percent_with_every_slice_full() -> None:
    keys = RecentKeys(300.0, capacity=5000, slices=4)
    for i in range(20000):  # four full slices, all within the horizon
        keys.add(b"in%d" % i, now=i * 0.005)
    assert keys.overflows == 0 and not keys.saturated(100.0)
    wrong = sum(keys.may_contain(b"out%d" % i, now=100.0) for i in range(50000))
    assert wrong / 50000 < 0.01


def test_a_wider_horizon_keeps_keys_longer() -> None:
    keys = RecentKeys(10.0, capacity=100, slices=3)
    keys.add(b"k", now=0.0)
    keys.widen(100.0)
    keys.widen(50.0)  # never narrower
    assert keys.horizon_s == 100.0
    keys.add(b"later", now=60.0)
    assert keys.may_contain(b"k", now=60.0)


def test_a_slice_dropped_while_its_keys_are_recent_saturates_the_set() -> None:
    """More keys than the slices can tell apart within the horizon: every key
    counts as possibly added until the dropped ones would have aged out."""
    keys = RecentKeys(100.0, capacity=10, slices=2)
    for i in range(25):  # fills three slices in one second
        keys.add(b"k%d" % i, now=i * 0.04)
    assert keys.overflows == 1 and keys.saturated(1.0)
    assert keys.may_contain(b"never added", now=1.0)
    assert not keys.saturated(100.4) and not keys.may_contain(b"never added", now=200.0)


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError):
        RecentKeys(0.0)
    with pytest.raises(ValueError):
        RecentKeys(1.0, slices=1)
