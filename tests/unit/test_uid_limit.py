"""The per-uid connection cap both local sockets apply (daemon/uid_limit.py):
its share, the room it leaves, and what a refused peer is told."""

from __future__ import annotations

import logging
import os

import pytest

from kvsidecar.daemon.engine_access import AccessPolicy, PeerCred
from kvsidecar.daemon.uid_limit import UidLimit, uid_cap

ME = os.geteuid()
SHARED = AccessPolicy.of(uids=[ME + 1])


def _limit(per_uid: int = 2, total: int = 8, access: AccessPolicy = SHARED) -> UidLimit:
    return UidLimit(access, per_uid, total, what="fd socket",
                    target="this sidecar's fd socket", advice="try again")


def test_the_share_binds_only_where_other_uids_are_admitted() -> None:
    assert uid_cap(AccessPolicy.own_uid(), 4, 8) is None
    assert uid_cap(SHARED, 4, 8) == 4
    assert uid_cap(AccessPolicy.of(gids=[12345]), 4, 8) == 4
    assert uid_cap(SHARED, 64, 64) == 48  # the fd socket's 64: three quarters
    assert uid_cap(SHARED, 64, 1) == 1
    # a total shrunk to the per-uid cap or below (a low fd limit) still leaves
    # the other uids a quarter of it
    assert uid_cap(SHARED, 8, 8) == 6
    assert uid_cap(SHARED, 64, 16) == 12
    with pytest.raises(ValueError, match="per_uid must be >= 1"):
        uid_cap(SHARED, 0, 8)


def test_under_its_cap_a_uid_gets_room_without_closing_anything() -> None:
    closed: list[int] = []
    limit = _limit()
    assert limit.room(7, [7, 8, 8, 8], lambda uid: closed.append(uid) is None)
    assert closed == [] and limit.refused == 0


def test_at_its_cap_only_its_own_idle_connection_makes_room() -> None:
    asked: list[int] = []

    def make_room(uid: int) -> bool:
        asked.append(uid)
        return uid == 7  # uid 7 has an idle one, uid 8 none

    limit = _limit()
    assert limit.room(7, [7, 7, 8], make_room)
    assert not limit.room(8, [7, 8, 8], make_room)
    assert asked == [7, 8]  # each uid asked to close one of its own, nobody else's


def test_without_a_cap_nothing_is_counted() -> None:
    limit = _limit(access=AccessPolicy.own_uid())
    assert limit.cap is None
    assert limit.room(ME, [ME] * 100, lambda uid: False)


def test_a_refusal_names_the_uid_the_limit_and_the_option(
        caplog: pytest.LogCaptureFixture) -> None:
    limit = _limit()
    with caplog.at_level(logging.WARNING, logger="kvsidecar.daemon.uid_limit"):
        said = limit.refusal(PeerCred(uid=65534, gid=65534, pid=4321))
    assert said == ("uid 65534 already holds 2 connections to this sidecar's fd socket, the "
                    "limit per uid (--max-engine-connections-per-uid); try again")
    assert limit.refused == 1
    assert "fd socket: refused a connection of uid 65534 (pid 4321)" in caplog.text
    assert limit.full(65534) == "uid 65534 holds 2 connections (its limit)"


def test_a_refusal_where_the_total_binds_says_so() -> None:
    """The fd socket's 64 connections cap a uid at 48 whatever the option says
    (64 by default): the refusal names what binds, not only the option."""
    limit = UidLimit(SHARED, 64, 64, what="fd socket", target="this sidecar's fd socket",
                     advice="try again")
    assert limit.refusal(PeerCred(uid=65534, gid=65534, pid=4321)) == (
        "uid 65534 already holds 48 connections to this sidecar's fd socket, the limit per "
        "uid (three quarters of its 64; --max-engine-connections-per-uid is 64); try again")
