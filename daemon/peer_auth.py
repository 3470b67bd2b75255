"""Who may talk to this sidecar's handshake port: ZMQ CURVE with a fleet keypair.

What a handshake reply carries (NIXL agent metadata, region bases, layout) is
enough to read and write an engine's KV memory over UCX, which has no access
control of its own. So the peer channel is CURVE (CurveZMQ: Curve25519 key
agreement, every message encrypted and authenticated) on by default:

* every sidecar of a fleet serves and dials with the same keypair
  (``<dir>/sidecar.key_secret``, e.g. a Kubernetes Secret), so a client knows
  the server key of any peer address without a directory service;
* the server admits only clients whose public key is the fleet's own or one of
  ``<dir>/authorized/*.key`` (ZAP, answered here, so every refusal is counted
  and logged with the peer's address);
* a client with no key or the wrong key completes no ZMTP handshake: it never
  gets a single reply byte (no engine list, no metadata, no bases).

CURVE rather than an HMAC over a server nonce: the reply itself is the secret
(the metadata is a capability for the engine's memory), so it must be
encrypted on the wire, not only authenticated, and pyzmq ships CURVE, ZAP and
certificate files already. ``--insecure-peers`` turns it off for development,
with a warning at start-up and in the READY line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio
import zmq.auth

from kvsidecar.daemon.logs import worth_logging

__all__ = ["KEY_NAME", "PeerKeys", "ZapHandler", "generate_keys", "load_keys"]

log = logging.getLogger(__name__)

KEY_NAME = "sidecar"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"


@dataclass(frozen=True)
class PeerKeys:
    """A sidecar's CURVE identity and the client keys its server admits."""

    public: bytes
    secret: bytes
    authorized: frozenset[bytes]

    def serve_with(self, sock: zmq.Socket[bytes] | zmq.asyncio.Socket) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True
        sock.zap_domain = b"kvsidecar"

    def dial_with(self, sock: zmq.Socket[bytes] | zmq.asyncio.Socket) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.public  # the fleet serves with this very keypair


def generate_keys(directory: str | os.PathLike[str]) -> Path:
    """Write a fresh fleet keypair to ``directory`` (created 0700); refuses to
    overwrite one. Returns the secret key file (mode 0600)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    secret = d / f"{KEY_NAME}.key_secret"
    if secret.exists():
        raise FileExistsError(f"{secret} exists; not replacing a fleet key")
    old = os.umask(0o077)
    try:
        zmq.auth.create_certificates(d, KEY_NAME)
    finally:
        os.umask(old)
    os.chmod(secret, 0o600)
    (d / "authorized").mkdir(exist_ok=True, mode=0o700)
    return secret


def load_keys(directory: str | os.PathLike[str]) -> PeerKeys:
    """Read ``<dir>/sidecar.key_secret`` and ``<dir>/authorized/*.key``.

    Raises ValueError with what is missing or unsafe (a secret others can read).
    """
    d = Path(directory)
    secret_file = d / f"{KEY_NAME}.key_secret"
    if not secret_file.is_file():
        raise ValueError(f"no {secret_file}: create one with `kvsidecar keys {d}` and give "
                         "every sidecar of the fleet the same directory")
    mode = secret_file.stat().st_mode & 0o777
    if mode & 0o077 and not _read_only_mount(secret_file):
        raise ValueError(f"{secret_file} is readable by others (mode {mode:04o}); chmod 600 it")
    public, secret = zmq.auth.load_certificate(secret_file)
    if not secret:
        raise ValueError(f"{secret_file} holds no secret key")
    authorized = {public}
    auth_dir = d / "authorized"
    if auth_dir.is_dir():
        for f in sorted(auth_dir.glob("*.key")):
            pub, _ = zmq.auth.load_certificate(f)
            authorized.add(pub)
    return PeerKeys(public, secret, frozenset(authorized))


def _read_only_mount(path: Path) -> bool:
    """Kubernetes mounts Secrets read-only with defaultMode (often 0644) through
    symlinks into ..data; a read-only mount is the operator's decision."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


class ZapHandler:
    """Answers ZAP requests for one context: CURVE clients with an authorized key
    pass, everyone else is refused, counted and logged with their address."""

    def __init__(self, ctx: zmq.asyncio.Context, authorized: frozenset[bytes], *,
                 on_refuse: Callable[[str], None] | None = None) -> None:
        self._ctx = ctx
        self._authorized = {zmq.utils.z85.encode(k) if len(k) == 32 else k for k in authorized}
        self._on_refuse = on_refuse
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.accepted = 0
        self.refused = 0

    def start(self) -> None:
        sock = self._ctx.socket(zmq.REP)
        sock.linger = 0
        sock.bind(ZAP_ENDPOINT)
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(self._serve(sock))

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close(linger=0)

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            await sock.send_multipart(self._answer(frames))

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        # version, request id, domain, address, identity, mechanism, credentials...
        if len(frames) < 6:
            return [b"1.0", frames[1] if len(frames) > 1 else b"", b"500", b"bad request",
                    b"", b""]
        request_id, address, mechanism = frames[1], frames[3], frames[5]
        key = zmq.utils.z85.encode(frames[6]) if mechanism == b"CURVE" and len(frames) > 6 \
            else b""
        if mechanism == b"CURVE" and key in self._authorized:
            self.accepted += 1
            return [b"1.0", request_id, b"200", b"OK", b"", b""]
        self.refused += 1
        who = address.decode("ascii", "replace")[:64]
        if worth_logging(self.refused):
            log.warning("peer channel: refused %s (%s key %s; %d refused so far)", who,
                        mechanism.decode("ascii", "replace")[:16],
                        key.decode()[:8] + "..." if key else "none", self.refused)
        if self._on_refuse is not None:
            self._on_refuse("unknown_key")
        return [b"1.0", request_id, b"400", b"unknown key", b"", b""]
