"""Hold tokens (ipc/hold_token.py): what each side accepts and refuses."""

from __future__ import annotations

import pytest

from kvsidecar.ipc import hold_token as ht

BLOCKS = [[3, 4, 5], [9]]


def test_a_token_passes_both_checks_for_exactly_its_hold() -> None:
    key = ht.new_key()
    t = ht.issue(key, "P", "r1", BLOCKS, expires=2000)
    assert len(t) <= ht.MAX_TOKEN_CHARS
    assert ht.check_issued(key, "P", "r1", t, now=1999) == ht.blocks_digest(BLOCKS)
    ht.check_for_reader(ht.checking_key(key), "P", "r1", BLOCKS, t, now=1999)


@pytest.mark.parametrize(("engine", "rid", "blocks", "why"), [
    ("P2", "r1", BLOCKS, "was not issued for request 'r1' of engine 'P2'"),
    ("P", "r2", BLOCKS, "was not issued for request 'r2'"),
    ("P", "r1", [[3, 4, 5, 6], [9]], "other blocks than the hold token pins"),
    ("P", "r1", [[3, 4], [5, 9]], "other blocks than the hold token pins"),
])
def test_the_reader_check_refuses_anything_else(engine: str, rid: str,
                                                blocks: list[list[int]], why: str) -> None:
    key = ht.new_key()
    t = ht.issue(key, "P", "r1", BLOCKS, expires=2000)
    with pytest.raises(ht.TokenError, match=why):
        ht.check_for_reader(ht.checking_key(key), engine, rid, blocks, t, now=1)


def test_expired_forged_malformed_and_other_keys_are_refused() -> None:
    key, other = ht.new_key(), ht.new_key()
    t = ht.issue(key, "P", "r1", BLOCKS, expires=2000)
    with pytest.raises(ht.TokenError, match="expired"):
        ht.check_issued(key, "P", "r1", t, now=2000)
    with pytest.raises(ht.TokenError, match="expired"):
        ht.check_for_reader(ht.checking_key(key), "P", "r1", BLOCKS, t, now=2001)
    with pytest.raises(ht.TokenError, match="not issued"):
        ht.check_issued(other, "P", "r1", t, now=1)
    with pytest.raises(ht.TokenError, match="not issued"):
        ht.check_for_reader(ht.checking_key(other), "P", "r1", BLOCKS, t, now=1)
    # A peer knows the checking half only: a token it makes fails P's check.
    peer_made = ht.issue(b"\0" * 32 + ht.checking_key(key), "P", "r1", BLOCKS, 2000)
    ht.check_for_reader(ht.checking_key(key), "P", "r1", BLOCKS, peer_made, now=1)
    with pytest.raises(ht.TokenError, match="not issued"):
        ht.check_issued(key, "P", "r1", peer_made, now=1)
    later = t.replace(".2000.", ".9999.")  # a longer life, tags unchanged
    with pytest.raises(ht.TokenError, match="not issued"):
        ht.check_issued(key, "P", "r1", later, now=1)
    for bad in ("", "x", "2.1.aa.bb.cc", "1.x.aa.bb.cc", "1.5." + "zz" * 16 + ".aa.bb",
                "1.5." + ".".join(["ab" * 8] * 3), "1" * 500):
        with pytest.raises(ht.TokenError, match="malformed"):
            ht.check_issued(key, "P", "r1", bad, now=1)


def test_spent_tokens_tell_a_replay_and_forget_at_expiry_or_for_room() -> None:
    from kvsidecar.daemon.spent_tokens import SpentTokens

    key = ht.new_key()
    a, b, c = (ht.issue(key, "P", r, BLOCKS, expires=100) for r in ("a", "b", "c"))
    spent = SpentTokens(max_entries=2)
    assert spent.first_use([a], now=0)
    assert not spent.first_use([a], now=1)  # presented again: a replay
    assert spent.first_use([b, "malformed"], now=1)
    assert spent.first_use([c], now=1) and spent.forgotten == 1 and len(spent) == 2
    assert spent.first_use([a], now=2)  # forgotten for room: checked as new
    assert spent.first_use([b], now=100)  # expired: forgotten


def test_p_tells_the_tokens_its_sidecar_issued_from_the_engines() -> None:
    """The sidecar's own tokens (issued at the hold) carry an issuing tag under a
    key derived from the issuing half: P tells them apart, D checks both alike,
    and a peer can make neither."""
    key = ht.new_key()
    digest = ht.blocks_digest(BLOCKS)
    by_engine = ht.issue(key, "P", "r1", BLOCKS, 2000)
    (by_sidecar,) = ht.issue_digested([key], "P", "r1", digest, 2000, sidecar=True)
    assert by_sidecar != by_engine
    assert ht.check_issued_by(key, "P", "r1", by_engine, now=1) == ht.Issued(digest, False)
    assert ht.check_issued_by(key, "P", "r1", by_sidecar, now=1) == ht.Issued(digest, True)
    for t in (by_engine, by_sidecar):
        ht.check_for_reader(ht.checking_key(key), "P", "r1", BLOCKS, t, now=1)
    peer_key = b"\0" * 32 + ht.checking_key(key)
    (peer_made,) = ht.issue_digested([peer_key], "P", "r1", digest, 2000, sidecar=True)
    with pytest.raises(ht.TokenError, match="not issued"):
        ht.check_issued_by(key, "P", "r1", peer_made, now=1)

