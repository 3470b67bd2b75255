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


def test_false_positives_stay_near_one_percent_at_capacity() -> None:
    keys = RecentKeys(100.0, capacity=5000, slices=2)
    for i in range(5000):
        keys.add(b"in%d" % i, now=0.0)
    wrong = sum(keys.may_contain(b"out%d" % i, now=1.0) for i in range(20000))
    assert wrong / 20000 < 0.03


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
