"""Who may talk to this sidecar's handshake port: ZMQ CURVE, one keypair per member.

What a handshake reply carries (NIXL agent metadata, region bases, layout) is
enough to read and write an engine's KV memory over UCX, which has no access
control of its own. So the peer channel is CURVE (CurveZMQ: Curve25519 key
agreement, every message encrypted and authenticated) on by default:

* each sidecar serves and dials with its own keypair (``<dir>/sidecar.key_secret``,
  made by ``kvsidecar keys``); the fleet is the set of public keys in
  ``<dir>/authorized/*.key`` (plus the sidecar's own). The server admits only
  those (ZAP, answered here, so every refusal is counted and logged with the
  peer's address) and tags each connection with the client's key (ZAP
  User-Id), which claims, abandons and reader declarations are bound to;
* a sidecar advertises its handshake address with its public key appended
  (``host:port/<64 hex>``, see :mod:`~kvsidecar.daemon.peers.addresses`): a
  reader dials that key, and only if it is an admitted member's; an address
  without a key is dialled with ``<dir>/fleet.key`` (the old shared key during a
  migration) or else the sidecar's own key (one shared fleet key);
* ``authorized/`` is read again whenever it changes, so a member's key is
  rotated one member at a time: admit the new key everywhere, restart that
  member with it, then remove the old one;
* one keypair shared by every sidecar (the original set-up) still works, but
  then members cannot be told apart: any member may act as any other's
  claims. The daemon warns at start-up;
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
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.asyncio
import zmq.auth

from kvsidecar.metrics.log_rate import worth_logging

__all__ = ["FLEET_KEY", "KEY_NAME", "PeerKeys", "ZapHandler", "generate_keys", "load_keys"]

log = logging.getLogger(__name__)

KEY_NAME = "sidecar"
FLEET_KEY = "fleet.key"
"""Optional: the server key of peers whose address names none (a shared key being retired)."""
ZAP_ENDPOINT = "inproc://zeromq.zap.01"


@dataclass(frozen=True)
class PeerKeys:
    """A sidecar's CURVE identity and the member keys it admits (and dials).

    ``directory`` set: :meth:`admitted` reads ``authorized/`` again when it
    changed (rotation without restarts). ``fleet``: the server key of peer
    addresses that name none (b"": this sidecar's own, one shared fleet key).
    """

    public: bytes  # Z85 (40 bytes), as pyzmq's certificate files give them; so are all keys here
    secret: bytes
    authorized: frozenset[bytes]
    fleet: bytes = b""
    directory: Path | None = None
    _seen: list[tuple[float, frozenset[bytes]]] = field(default_factory=list, compare=False,
                                                        repr=False)

    @property
    def address_tag(self) -> str:
        """What this sidecar appends to the handshake address it advertises."""
        return "/" + zmq.utils.z85.decode(self.public).hex()

    @property
    def shared(self) -> bool:
        """Every admitted key is this sidecar's own: one fleet key, no member identity."""
        return self.admitted() <= {self.public}

    def admitted(self) -> frozenset[bytes]:
        """The member keys admitted now: ``authorized`` as of the directory's last
        change (a stat per call; ZAP asks once per connection)."""
        auth = self.directory / "authorized" if self.directory is not None else None
        if auth is None:
            return self.authorized
        try:
            mtime = auth.stat().st_mtime
        except OSError:
            mtime = -1.0
        if self._seen and self._seen[0][0] == mtime:
            return self._seen[0][1]
        keys = frozenset({self.public, *_read_authorized(auth)})
        self._seen[:] = [(mtime, keys)]
        return keys

    def serve_with(self, sock: zmq.Socket[bytes] | zmq.asyncio.Socket) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True
        sock.zap_domain = b"kvsidecar"

    def dial_with(self, sock: zmq.Socket[bytes] | zmq.asyncio.Socket,
                  server: bytes | None = None) -> None:
        """Dial a peer whose address named ``server`` (Z85; None: it named none)."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = server or self.fleet or self.public


def generate_keys(directory: str | os.PathLike[str]) -> Path:
    """Write a fresh keypair to ``directory`` (created 0700; ``sidecar.key_secret``
    0600 and the public ``sidecar.key``), and an empty ``authorized/``; refuses
    to overwrite one. Returns the secret key file. One per member (member keys),
    or one copied to every member (a shared fleet key)."""
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
    fleet = b""
    if (d / FLEET_KEY).is_file():
        fleet, _ = zmq.auth.load_certificate(d / FLEET_KEY)
    keys = PeerKeys(public, secret, frozenset({public, *_read_authorized(d / "authorized")}),
                    fleet, d)
    keys.admitted()
    return keys


def _read_authorized(auth_dir: Path) -> set[bytes]:
    out: set[bytes] = set()
    if auth_dir.is_dir():
        for f in sorted(auth_dir.glob("*.key")):
            try:
                pub, _ = zmq.auth.load_certificate(f)
            except (OSError, ValueError) as e:
                log.warning("peer keys: skipping %s: %s", f, e)
                continue
            out.add(pub)
    return out


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

    def __init__(self, ctx: zmq.asyncio.Context,
                 authorized: frozenset[bytes] | Callable[[], frozenset[bytes]], *,
                 on_refuse: Callable[[str], None] | None = None) -> None:
        self._ctx = ctx
        if callable(authorized):
            self._authorized = authorized
        else:
            fixed = frozenset(zmq.utils.z85.encode(k) if len(k) == 32 else k for k in authorized)
            self._authorized = lambda: fixed
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
        raw = frames[6] if mechanism == b"CURVE" and len(frames) > 6 else b""
        key = zmq.utils.z85.encode(raw) if len(raw) == 32 else b""
        if key and key in self._authorized():
            self.accepted += 1
            # User-Id: the member's key, on every message of this connection
            # (zmq.Frame.get("User-Id")), which claims and notifications bind to.
            return [b"1.0", request_id, b"200", b"OK", key, b""]
        self.refused += 1
        who = address.decode("ascii", "replace")[:64]
        if worth_logging(self.refused):
            log.warning("peer channel: refused %s (%s key %s; %d refused so far)", who,
                        mechanism.decode("ascii", "replace")[:16],
                        key.decode()[:8] + "..." if key else "none", self.refused)
        if self._on_refuse is not None:
            self._on_refuse("unknown_key")
        return [b"1.0", request_id, b"400", b"unknown key", b"", b""]
