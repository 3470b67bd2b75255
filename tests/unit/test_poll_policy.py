"""The NIXL worker's wait between polls (PollPolicy) and what it depends on
(PollPacer): pure, no threads, the clock injected."""

from __future__ import annotations

import pytest

from kvsidecar.daemon.transport.poll_policy import PollPacer, PollPolicy

P = PollPolicy(busy_s=0.0002, hot_s=0.001, hot_max_s=0.05, idle_s=0.005, idle_max_s=0.5)


def walk(policy: PollPolicy, rounds: int, **state: bool) -> list[float]:
    """The waits of ``rounds`` quiet rounds after an active one."""
    waits = [policy.next_wait(0.0, active=True, **state)]
    for _ in range(rounds - 1):
        waits.append(policy.next_wait(waits[-1], active=False, **state))
    return waits


def test_idle_wait_doubles_from_its_floor_to_its_cap_and_stays() -> None:
    waits = walk(P, 12, inflight=False, reads_expected=False, hot=False)
    assert waits[:8] == [0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.5]
    assert waits[8:] == [0.5] * 4


def test_held_blocks_escalate_from_the_hot_floor_to_the_hot_cap() -> None:
    waits = walk(P, 10, inflight=False, reads_expected=False, hot=True)
    assert waits[:7] == [0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.05]
    assert waits[7:] == [0.05] * 3


def test_activity_restarts_the_escalation_at_the_floor() -> None:
    deep = P.next_wait(0.5, active=False, inflight=False, reads_expected=False, hot=False)
    assert deep == 0.5
    assert P.next_wait(deep, active=True, inflight=False, reads_expected=False,
                       hot=False) == 0.005
    # Blocks held after a deep idle sleep: the hot cap bounds the very next wait.
    assert P.next_wait(deep, active=False, inflight=False, reads_expected=False,
                       hot=True) == 0.05


def test_an_imminent_completion_polls_at_the_soon_floor_whatever_else_holds() -> None:
    for inflight in (False, True):
        for hot in (False, True):
            assert walk(P, 4, inflight=inflight, reads_expected=True, hot=hot,
                        soon=True) == [P.soon_s] * 4
    # the window over: back to the rate its state asks for
    assert P.next_wait(P.soon_s, active=False, inflight=False, reads_expected=True,
                       hot=True) == 0.001


def test_reads_in_flight_or_expected_poll_at_a_fixed_tight_rate() -> None:
    for hot in (False, True):
        assert walk(P, 6, inflight=True, reads_expected=False, hot=hot) == [0.0002] * 6
        assert walk(P, 6, inflight=False, reads_expected=True, hot=hot) == [0.001] * 6
    # In flight wins over expected; after the last read the wait starts at the floor.
    assert P.next_wait(0.001, active=False, inflight=True, reads_expected=True,
                       hot=True) == 0.0002
    assert P.next_wait(0.0002, active=False, inflight=False, reads_expected=False,
                       hot=False) == 0.005


def test_bad_policies_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        PollPolicy(busy_s=0.0)
    with pytest.raises(ValueError, match="cap"):
        PollPolicy(idle_s=1.0, idle_max_s=0.5)
    with pytest.raises(ValueError, match="cap"):
        PollPolicy(hot_s=0.1, hot_max_s=0.05)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pacer() -> tuple[PollPacer, Clock]:
    clock = Clock()
    return PollPacer(PollPolicy(soon_window_s=0.005, soon_max_reads=2), clock), clock


def test_holds_wake_the_thread_once_and_their_end_closes_every_window() -> None:
    p, _ = pacer()
    assert p.set_hot(True) is True  # leave a long idle wait now
    assert p.set_hot(True) is False
    assert p.expect_reads(10.0) is True
    assert p.next_wait(0.05, active=False, inflight=0) == p.policy.soon_s
    assert p.set_hot(False) is False
    assert p.next_wait(0.05, active=False, inflight=0) == 0.1  # idle, escalating


def test_a_lease_wakes_once_per_window_and_a_notification_closes_it() -> None:
    p, clock = pacer()
    assert p.expect_reads(10.0) is True
    assert p.expect_reads(10.0) is False  # inside the open window: polls soon anyway
    grants = p.grants
    p.notified(grants)
    assert p.next_wait(0.0, active=False, inflight=0) == p.policy.hot_s  # the lease runs
    grants = p.grants
    p.expect_reads(10.0)  # a grant during the round keeps its window
    p.notified(grants)
    assert p.imminent(clock.now, 0)
    clock.now += 0.006  # the window passed
    assert not p.imminent(clock.now, 0)
    clock.now += 10.0  # the lease too
    assert p.next_wait(0.001, active=False, inflight=0) == 0.005  # idle: from its floor


def test_a_lease_among_many_wakes_without_a_soon_window() -> None:
    p, _ = pacer()
    assert p.expect_reads(10.0, soon=False) is True
    assert p.expect_reads(10.0, soon=False) is False  # expected already
    assert p.next_wait(0.05, active=False, inflight=0) == p.policy.hot_s


def test_a_read_of_ours_is_imminent_only_with_few_in_flight_and_within_the_window() -> None:
    p, clock = pacer()
    assert not p.imminent(clock.now, 1)
    p.posted()
    assert p.imminent(clock.now, 1) and p.imminent(clock.now, 2)
    assert not p.imminent(clock.now, 3) and not p.imminent(clock.now, 0)
    assert p.next_wait(0.0, active=False, inflight=3) == p.policy.busy_s
    clock.now += 0.006
    assert not p.imminent(clock.now, 1)
