"""Hold tokens: what a hold issues, and what a read must present to move bytes.

A P engine rank's sidecar makes a *hold key* when the rank registers (64
random bytes, new on every registration): the first half, the *issuing* key,
stays with that sidecar and its engine; the second half, the *checking* key,
also goes to fleet peers in the handshake info (CURVE-encrypted, to admitted
members only). A token names one hold::

    1.<expires>.<blocks digest>.<issuing tag>.<checking tag>

``expires`` is a Unix time in whole seconds; the blocks digest is a 16-byte
BLAKE2b of the held block ids (msgpack of ``list[list[int]]``); each tag is a
16-byte keyed BLAKE2b over the engine id, the request id, ``expires`` and the
digest. Either the sidecar (``hold`` returns one) or the engine itself (the
vLLM connector's scheduler, which answers before its workers place the hold)
issues it with :func:`issue`. The sidecar's own tokens carry an issuing tag
under a key derived from the issuing half (``sidecar=True``), so P's sidecar
tells them apart (:func:`check_issued_by`): such a token was issued *after*
its hold was placed, so a claim for it that finds no hold comes after the hold
ended, never before it was placed.

Who checks what:

* D's sidecar, before it posts a single descriptor (:func:`check_for_reader`):
  the checking tag under the P rank's checking key from the handshake, the
  digest against the blocks the read names, and the expiry. Nothing else is
  needed, so posting during the claim stays as fast as before.
* P's sidecar, on every claim and abandon (:func:`check_issued`): the issuing
  tag (no peer can make one: only the engine and its sidecar have the key)
  and the expiry; the hold then checks the digest against the blocks it pins.

Pure functions, no I/O: the engine library, both sidecars and the tests share them.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

import msgspec

__all__ = [
    "ENGINE_TOKEN_LIFE_S",
    "KEY_BYTES",
    "MAX_TOKEN_CHARS",
    "Issued",
    "Token",
    "TokenError",
    "blocks_digest",
    "check_for_reader",
    "check_issued",
    "check_issued_by",
    "checking_key",
    "issue",
    "issue_all",
    "new_key",
    "parse",
]

VERSION = "1"
ENGINE_TOKEN_LIFE_S = 600.0
"""How long an engine's own tokens live (the vLLM connector's scheduler issues
them so), or twice its holds' timeout when that is longer: how long P must
remember that a hold ended to refuse a stale token's claim
(:class:`~kvsidecar.daemon.holds.HoldBook`)."""
KEY_BYTES = 64
"""A hold key: the issuing half, then the checking half (32 bytes each)."""
_HALF = KEY_BYTES // 2
_TAG = 16
#: "1." + 10-12 digits + three hex fields and their dots; room to spare
MAX_TOKEN_CHARS = 160
_encode = msgspec.msgpack.Encoder().encode


class TokenError(ValueError):
    """A token that does not let this read (or claim) through; says why."""


@dataclass(frozen=True)
class Issued:
    """A token P's sidecar checked: the blocks digest it names, and whether the
    sidecar issued it (at its hold, so after the hold was placed) or the engine
    did (possibly before)."""

    digest: bytes
    by_sidecar: bool


@dataclass(frozen=True)
class Token:
    expires: int
    digest: bytes
    issuing_tag: bytes
    checking_tag: bytes


def new_key() -> bytes:
    """A fresh hold key (issuing half + checking half)."""
    return secrets.token_bytes(KEY_BYTES)


def checking_key(key: bytes) -> bytes:
    """The half of a hold key that peers get in the handshake."""
    return key[_HALF:]


def blocks_digest(block_ids: list[list[int]]) -> bytes:
    """16 bytes naming exactly these block ids, group by group."""
    return hashlib.blake2b(_encode(block_ids), digest_size=_TAG).digest()


def _message(engine_id: str, request_id: str, expires: int, digest: bytes) -> bytes:
    return _encode(("kvsidecar-hold", engine_id, request_id, expires, digest))


def _tag(key: bytes, message: bytes) -> bytes:
    return hashlib.blake2b(message, key=key, digest_size=_TAG).digest()


def _sidecar_key(issuing: bytes) -> bytes:
    """The key of the issuing tags the sidecar makes itself (derived from the
    issuing half, so nothing new is shared or stored)."""
    return hashlib.blake2b(b"kvsidecar-hold-sidecar-issued", key=issuing,
                           digest_size=_HALF).digest()


def issue(key: bytes, engine_id: str, request_id: str, block_ids: list[list[int]],
          expires: int) -> str:
    """The token for the hold of ``request_id``'s ``block_ids`` on this rank."""
    return issue_all([key], engine_id, request_id, block_ids, expires)[0]


def issue_all(keys: list[bytes], engine_id: str, request_id: str,
              block_ids: list[list[int]], expires: int) -> list[str]:
    """One token per rank's key (the blocks digested once), in the keys' order."""
    return issue_digested(keys, engine_id, request_id, blocks_digest(block_ids), expires)


def issue_digested(keys: list[bytes], engine_id: str, request_id: str, digest: bytes,
                   expires: int, *, sidecar: bool = False) -> list[str]:
    """:func:`issue_all` for blocks already digested (:func:`blocks_digest`);
    ``sidecar``: issued by the sidecar for a hold it placed already."""
    msg = _message(engine_id, request_id, expires, digest)
    out = []
    for key in keys:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a hold key is {KEY_BYTES} bytes, got {len(key)}")
        issuing = _sidecar_key(key[:_HALF]) if sidecar else key[:_HALF]
        out.append(".".join((VERSION, str(expires), digest.hex(),
                             _tag(issuing, msg).hex(), _tag(key[_HALF:], msg).hex())))
    return out


def parse(token: str) -> Token:
    """The fields of a token; :class:`TokenError` for anything malformed."""
    parts = token.split(".") if len(token) <= MAX_TOKEN_CHARS else []
    if len(parts) != 5 or parts[0] != VERSION or not parts[1].isdigit():
        raise TokenError("malformed hold token (expected 1.<expires>.<digest>.<tag>.<tag> "
                         "as the hold issued it)")
    try:
        digest, p, d = (bytes.fromhex(x) for x in parts[2:])
    except ValueError:
        raise TokenError("malformed hold token (fields are not hex)") from None
    if not len(digest) == len(p) == len(d) == _TAG:
        raise TokenError("malformed hold token (wrong field lengths)")
    return Token(int(parts[1]), digest, p, d)


def _live(t: Token, now: float) -> None:
    if now >= t.expires:
        raise TokenError(f"the hold token expired {now - t.expires:.0f} s ago")


def check_for_reader(check_key: bytes, engine_id: str, request_id: str,
                     block_ids: list[list[int]], token: str, now: float) -> None:
    """D's check before posting: the token was issued for this engine, request
    and exactly these blocks by the rank whose checking key this is, and has
    not expired. Raises :class:`TokenError` naming what failed."""
    t = parse(token)
    msg = _message(engine_id, request_id, t.expires, t.digest)
    if len(check_key) != _HALF or not hmac.compare_digest(_tag(check_key, msg),
                                                           t.checking_tag):
        raise TokenError(f"the hold token was not issued for request {request_id[:200]!r} of "
                         f"engine {engine_id[:200]!r} by the rank it names")
    if not hmac.compare_digest(blocks_digest(block_ids), t.digest):
        raise TokenError("the read names other blocks than the hold token pins")
    _live(t, now)


def check_issued(key: bytes, engine_id: str, request_id: str, token: str,
                 now: float) -> bytes:
    """P's check of a claim or abandon: issued under this rank's issuing key for
    this engine and request, not expired. Returns the blocks digest it names
    (the hold compares it with the blocks it pins)."""
    return check_issued_by(key, engine_id, request_id, token, now).digest


def check_issued_by(key: bytes, engine_id: str, request_id: str, token: str,
                    now: float) -> Issued:
    """:func:`check_issued`, also saying who issued the token: the engine (under
    the issuing half) or the sidecar at its hold (under the key derived from it)."""
    t = parse(token)
    msg = _message(engine_id, request_id, t.expires, t.digest)
    issuing = key[:_HALF]
    if hmac.compare_digest(_tag(issuing, msg), t.issuing_tag):
        by_sidecar = False
    elif hmac.compare_digest(_tag(_sidecar_key(issuing), msg), t.issuing_tag):
        by_sidecar = True
    else:
        raise TokenError(f"the hold token was not issued for request {request_id[:200]!r} of "
                         f"engine {engine_id[:200]!r} (forged, or from an earlier "
                         "registration)")
    _live(t, now)
    return Issued(t.digest, by_sidecar)
