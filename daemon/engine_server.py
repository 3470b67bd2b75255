"""The sidecar's door for local engines: an ``AF_UNIX`` ``SOCK_SEQPACKET`` socket.

::

    engine A ─┐  connect: SO_PEERCRED checked once    ┌─▶ handler.handle(req) -> Reply
    engine B ─┼─▶ listening socket ── a connection ───┤   (a task once it waits)
    engine C ─┘   (path, 0600, lock)   per engine     └─◀ Error(...) for bad input

Why not ZMQ: a ZMQ round trip cost the engine about 105 µs of CPU in its
I/O thread alone, the floor of every call; a SEQPACKET round trip costs
about 13 µs (measured, see :mod:`kvsidecar.ipc.seqpacket`, which also holds
the framing). The messages are the same msgpack bytes as before.

Everything runs on the event loop: the listening socket and every
connection are non-blocking and driven by ``loop.add_reader`` callbacks (no
thread, no task per connection), and replies the kernel cannot take at once
wait in a short per-connection queue flushed by ``loop.add_writer``.

The server owns framing, decoding, error replies and the sockets; the handler
owns what requests mean. Each request's handler starts as it arrives, in
arrival order, right in the reader callback: handlers that never await
(reads, holds, polls with something to return) are answered there, without
a task or a turn of the loop; one that awaits (registering gigabytes of
memory, deregistering while reads drain, a waiting poll) goes on in its own
task from where it stopped (:func:`~kvsidecar.daemon.eager.carry_on`) and delays only its own
caller (a waiting poll ends with its connection). Replies carry the
request's id, so a connection may pipeline requests (the async client's
concurrent calls). The messages one wake-up reads from a connection (up to
64 queued) are handled inside one entry of ``burst`` (the sidecar's read
table gathers their reads there and starts them together at its end).

No input can stop the loop: undecodable messages, unknown ops, wrong types,
refused requests and handler bugs all become
:class:`~kvsidecar.ipc.protocol.Error` replies to the sender.

Limits, each counted (``on_refuse(reason)``, the ``kvsidecar_refused_total``
metric) and answered with one clear error:

* who: a connecting process outside the :class:`AccessPolicy` gets one
  ``forbidden`` reply and is closed, before any byte of it is read (see
  :mod:`~kvsidecar.daemon.engine_access` for the socket's directory, mode
  and lock);
* size: a message over ``max_message_bytes`` gets one ``bad_message`` reply
  (reason ``too_large``); one announced at over twice that also closes its
  connection, so nobody makes the daemon buffer it (see
  :mod:`~kvsidecar.daemon.message_limit`);
* connections beyond ``max_connections``: the one idle longest (nothing in
  flight, nothing received for ``idle_grace_s``) that serves no live engine
  is closed without a word to make room (reason ``idle_evicted``; the
  clients reconnect on their next call); when there is none, the new one
  gets one ``unavailable`` reply and is closed (reason ``connection_limit``);
* connections of one uid beyond ``max_connections_per_uid``, where the
  policy admits more than the daemon's own uid
  (:mod:`~kvsidecar.daemon.uid_limit`, the fd socket's too): that uid's own
  connection idle longest makes room as above, else the new one gets one
  ``unavailable`` reply naming the uid and is closed (reason
  ``uid_connection_limit``), checked before the total so one uid can neither
  hold every slot nor evict the others' idle connections for more of its own;
* a connection that serves no live engine and is idle for ``idle_timeout_s``
  is closed (reason ``idle_timeout``): idle connections cannot hold the slots.
  A connection serves an engine from the ``Registered``/``Reserved`` reply
  for it that went over it (a retry's too) for as long as ``engine_live``
  says the engine id is still registered or reserved: its deregistration, or
  the sidecar dropping it, ends the exemption (before, it lasted as long as
  the connection, and connections that each sent one Reserve retry held every
  slot after the engine was gone);
* long messages (those sent in chunks after a header) being received at
  once may together announce at most ``max_assembling_bytes`` (default
  :data:`ASSEMBLING_FACTOR` times the hard cap); a header past that gets one
  ``unavailable`` reply and its connection is closed (reason
  ``assembly_limit``), so stalled senders cannot make the daemon hold more
  than that, whatever their number;
* a long message must arrive whole within ``long_message_timeout_s`` of its
  header, else one ``bad_message`` reply and the connection is closed
  (reason ``slow_message``): a sender that stops half-way (a slowloris)
  gives its share of that budget back;
* requests in flight on one connection beyond ``max_in_flight`` get an
  ``unavailable`` reply each (reason ``in_flight_limit``); replies a
  connection does not read stop the server reading from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

import msgspec

from kvsidecar.metrics.log_rate import worth_logging

from ..ipc.protocol import (
    BAD_MESSAGE,
    FORBIDDEN,
    INTERNAL,
    REPLY_TYPES,
    UNAVAILABLE,
    Error,
    Poll,
    ProtocolError,
    Register,
    Registered,
    Reply,
    Request,
    RequestError,
    Reserve,
    Reserved,
    decode_request,
    encode_reply,
)
from ..ipc.seqpacket import (
    RECV_BYTES,
    Buffer,
    new_socket,
)
from .eager import carried_on
from .engine_access import (
    ACCEPT_PAUSE_S,
    AccessPolicy,
    PeerCred,
    claim_socket,
    current_peer,
    open_to,
    peer_cred,
    prepare_socket_dir,
    restricted_umask,
    unlock_socket,
)
from .engine_connection import Connection
from .message_limit import SizeLimit
from .uid_limit import DEFAULT_MAX_CONNECTIONS_PER_UID, UidLimit

__all__ = ["EngineServer", "RequestError", "RequestHandler"]

log = logging.getLogger(__name__)

_UNIX_PATH_MAX = 107  # sun_path is 108 bytes on Linux, including the NUL
#: Error messages are cut here: they may quote ids and other input, and a
#: reply must never grow with what a client sent.
MAX_ERROR_CHARS = 1024
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20
DEFAULT_MAX_CONNECTIONS = 256
#: Requests one connection may have in flight (a waiting poll holds one for
#: its wait); far above what one engine's scheduler step issues.
DEFAULT_MAX_IN_FLIGHT = 1024
#: Long messages being received may together announce this many times the
#: hard cap (16 MiB limit: 4 x 32 MiB = 128 MiB).
ASSEMBLING_FACTOR = 4
#: Seconds from a long message's header to its last chunk (a 32 MiB message
#: takes milliseconds on a Unix socket).
DEFAULT_LONG_MESSAGE_TIMEOUT_S = 30.0
#: A connection that never registered and sends nothing this long is closed.
DEFAULT_IDLE_TIMEOUT_S = 60.0
#: At the connection limit, one idle at least this long may be closed for a new one.
DEFAULT_IDLE_GRACE_S = 1.0
_LISTEN_BACKLOG = 128
#: Replies that make a connection an engine's own (exempt from the idle rules
#: while that engine is live), to requests naming the engine id.
_REGISTERING = (Registered, Reserved)
#: a connection's engine ids are pruned of the gone ones when it names this many
#: (a connection busy enough never to be idle would otherwise only grow them)
_PRUNE_ENGINES_AT = 64
#: connections the engine socket accepts (or refuses) per wake-up of its listener
ACCEPT_BURST = 16


class RequestHandler(Protocol):
    """What the engine server calls for each decoded request.

    Return a reply (its ``id`` is filled in by the server); raise
    :class:`RequestError` to refuse. Any other exception is reported to the
    engine as an ``internal`` error and logged.
    """

    async def handle(self, req: Request) -> Reply: ...


class EngineServer:
    """Serves one sidecar's engines on the Unix socket ``socket_path``.

    Counters (plain ints, read by the metrics): ``messages`` received,
    ``errors`` (error replies of any kind), ``bad_messages`` (undecodable
    input), ``internal_errors`` (handler bugs), ``forbidden`` (connections
    from processes the access policy refuses), ``refused_connections``
    (over ``max_connections``), ``refused_uid_connections`` (over
    ``max_connections_per_uid``), ``refused_in_flight``, ``refused_assembling``
    (over ``max_assembling_bytes``) and ``slow_messages`` (long messages not
    whole in time); ``connections`` is how many are open and
    ``assembling_bytes`` what the long messages under way announced.
    """

    def __init__(self, socket_path: str, handler: RequestHandler, *,
                 access: AccessPolicy | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 max_connections_per_uid: int = DEFAULT_MAX_CONNECTIONS_PER_UID,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                 max_assembling_bytes: int | None = None,
                 long_message_timeout_s: float = DEFAULT_LONG_MESSAGE_TIMEOUT_S,
                 idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                 idle_grace_s: float = DEFAULT_IDLE_GRACE_S,
                 on_refuse: Callable[[str], None] | None = None,
                 burst: Callable[[], AbstractContextManager[None]] | None = None,
                 engine_live: Callable[[str], bool] | None = None) -> None:
        if max_connections < 1 or max_in_flight < 1:
            raise ValueError("max_connections and max_in_flight must be >= 1")
        self.socket_path = os.path.abspath(socket_path)
        self.handler = handler
        #: entered around the messages one wake-up reads from a connection (the
        #: sidecar's: the reads they ask for start together, see ReadTable.together)
        self.burst = burst if burst is not None else contextlib.nullcontext
        #: whether an engine id is still registered or reserved (the sidecar's
        #: tables); a connection serving none that is is subject to the idle rules.
        #: Without one, an engine's connection is exempt for as long as it is open.
        self.engine_live = engine_live if engine_live is not None else _always
        self.access = access if access is not None else AccessPolicy.own_uid()
        self.max_message_bytes = max_message_bytes
        self.size_limit = SizeLimit("engine", max_message_bytes, on_refuse)
        self.max_connections = max_connections
        #: the most connections one uid may hold (``uid_limit.cap``; None:
        #: max_connections alone), shared with the fd socket's (see uid_limit)
        self.uid_limit = UidLimit(
            self.access, max_connections_per_uid, max_connections, what="engine socket",
            target="this sidecar", advice="close idle clients")
        self.max_in_flight = max_in_flight
        self.max_assembling_bytes = (max_assembling_bytes if max_assembling_bytes is not None
                                     else ASSEMBLING_FACTOR * self.size_limit.hard_cap)
        self.long_message_timeout_s = long_message_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.idle_grace_s = idle_grace_s
        #: connections closed idle: at the limit for a new one / past idle_timeout_s
        self.idle_evicted = 0
        self.idle_closed = 0
        self._sweeper: asyncio.TimerHandle | None = None
        #: bytes announced by the long messages being received now, all connections
        self.assembling_bytes = 0
        self.messages = 0
        self.errors = 0
        self.bad_messages = 0
        self.internal_errors = 0
        self.forbidden = 0
        self.refused_connections = 0
        self.refused_in_flight = 0
        self.refused_assembling = 0
        self.slow_messages = 0
        #: times a connection stopped being read because its engine left
        #: ``MAX_UNSENT`` reply packets unread (bounded and lossless, but an
        #: engine that does it is stuck or misbehaving: counted, for metrics)
        self.paused_unread = 0
        self._on_refuse = on_refuse
        self._lock_fd: int | None = None
        self._inode: tuple[int, int] | None = None
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conns: dict[int, Connection] = {}
        self._answering: set[asyncio.Task[None]] = set()
        #: the receive buffer every connection reads into (one thread, one at a time)
        self._buf = bytearray(RECV_BYTES)
        self._view = memoryview(self._buf)

    @property
    def endpoint(self) -> str:
        """The socket's path (where engines connect), for logs."""
        return self.socket_path

    @property
    def connections(self) -> int:
        return len(self._conns)

    async def start(self) -> None:
        if self._listener is not None:
            raise RuntimeError("engine server already started")
        if len(os.fsencode(self.socket_path)) > _UNIX_PATH_MAX:
            raise ValueError(
                f"socket path is longer than {_UNIX_PATH_MAX} bytes (a unix socket limit): "
                f"{self.socket_path}"
            )
        prepare_socket_dir(os.path.dirname(self.socket_path), shared=self.access.shared,
                           group=self.access.group, uids=self.access.other_uids)
        self._lock_fd = claim_socket(self.socket_path)  # SocketInUse: nothing was touched
        sock = new_socket()
        try:
            with restricted_umask():
                sock.bind(self.socket_path)
            os.chmod(self.socket_path, 0o660 if self.access.shared else 0o600)
            if self.access.group is not None:
                os.chown(self.socket_path, -1, self.access.group)
            open_to(self.socket_path, self.access.other_uids, 0o6)
            st = os.stat(self.socket_path)
            self._inode = (st.st_dev, st.st_ino)
            sock.listen(_LISTEN_BACKLOG)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            self._unlink_own_socket()
            self._release_lock()
            raise
        self._listener = sock
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._accept)
        self._sweeper = self._loop.call_later(self._sweep_period(), self._sweep)
        log.info("engine server listening on %s", self.socket_path)

    async def stop(self) -> None:
        """Stop accepting and reading; let requests in flight answer (5 s), then close."""
        listener, self._listener = self._listener, None
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if listener is not None and self._loop is not None:
            self._loop.remove_reader(listener.fileno())
            listener.close()
        for conn in list(self._conns.values()):
            conn.pause()
        if self._answering:
            _, pending = await asyncio.wait(list(self._answering), timeout=5)
            for t in pending:
                t.cancel()
        for conn in list(self._conns.values()):
            conn.close()
        if listener is not None:
            self._unlink_own_socket()
        self._release_lock()

    def _unlink_own_socket(self) -> None:
        """Remove the socket file only if it is still the one this server bound."""
        try:
            st = os.stat(self.socket_path)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == self._inode:
            os.unlink(self.socket_path)

    def _release_lock(self) -> None:
        """Release the socket's lock, removing ``<socket>.lock`` (see unlock_socket)."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            unlock_socket(self.socket_path, fd)

    # ---- connections

    def _accept(self) -> None:
        """Accept (or refuse) what waits in the backlog, at most
        :data:`ACCEPT_BURST` connections per wake-up: the listener stays readable
        while more wait, so the rest come on the loop's next turn, after everyone
        else's callbacks (a process spinning on connect() could otherwise keep
        the loop here as long as it kept the backlog filled)."""
        listener, loop = self._listener, self._loop
        assert listener is not None and loop is not None
        for _ in range(ACCEPT_BURST):
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as e:  # EMFILE, ENFILE, ENOBUFS: back off instead of spinning
                if worth_logging(self.refused_connections + 1):
                    log.warning("engine socket: cannot accept a connection: %s", e)
                loop.remove_reader(listener.fileno())
                loop.call_later(ACCEPT_PAUSE_S, self._resume_accepting, listener)
                return
            sock.setblocking(False)
            cred = peer_cred(sock)
            if not self.access.allows(cred):
                _say_and_close(sock, self._refusal(cred))
                continue
            assert cred is not None  # allows() admits no peer without credentials
            if not self._room_for_uid(cred, loop.time()):
                _say_and_close(sock, self._uid_refusal(cred))
                continue
            if len(self._conns) >= self.max_connections and not self._evict_idlest(loop.time()):
                self.refused_connections += 1
                self._refuse("connection_limit")
                if worth_logging(self.refused_connections):
                    log.warning("engine socket: refused a connection, %d open is the limit "
                                "(%d refused so far)", self.max_connections,
                                self.refused_connections)
                _say_and_close(sock, Error(UNAVAILABLE, (
                    f"this sidecar already serves {self.max_connections} engine connections, "
                    "its limit (--max-engine-connections); close idle clients")))
                continue
            conn = Connection(self, sock, cred, loop)
            self._conns[conn.fd] = conn
            conn.resume()

    def _room_for_uid(self, cred: PeerCred, now: float) -> bool:
        """Whether ``cred``'s uid may open one more connection (see UidLimit.room):
        at its cap, its own connection idle longest makes room."""
        return self.uid_limit.room(cred.uid, map(_uid_of, self._conns.values()),
                                   lambda uid: self._evict_idlest(now, uid=uid))

    def _uid_refusal(self, cred: PeerCred) -> Error:
        """The reply to a connection over its uid's cap (counted, logged)."""
        self.errors += 1
        self._refuse("uid_connection_limit")
        return Error(UNAVAILABLE, self.uid_limit.refusal(cred))

    @property
    def refused_uid_connections(self) -> int:
        """Connections refused over ``max_connections_per_uid``."""
        return self.uid_limit.refused

    def _idle(self, conn: Connection, now: float, after_s: float) -> bool:
        return (conn.in_flight == 0 and not conn.assembling
                and now - conn.last_seen >= after_s and not self._serves_engine(conn))

    def _serves_engine(self, conn: Connection) -> bool:
        """Whether an engine registered or reserved over ``conn`` is still live;
        the engine ids no longer live are forgotten (so the set stays bounded
        by the live engines and reservations)."""
        if conn.engines:
            conn.engines = {e for e in conn.engines if self.engine_live(e)}
        return bool(conn.engines)

    def _evict_idlest(self, now: float, uid: int | None = None) -> bool:
        """Close the connection idle longest (at least ``idle_grace_s``) that serves
        no live engine, of ``uid`` if given, to make room for a new one; False
        when there is none."""
        idle = [c for c in self._conns.values()
                if (uid is None or _uid_of(c) == uid) and self._idle(c, now, self.idle_grace_s)]
        if not idle:
            return False
        victim = min(idle, key=lambda c: c.last_seen)
        victim.close()
        self.idle_evicted += 1
        self._refuse("idle_evicted")
        if worth_logging(self.idle_evicted):
            full = (f"{self.max_connections} connections open (the limit)" if uid is None
                    else self.uid_limit.full(uid))
            log.warning("engine socket: %s: closed one idle for %.1f s that serves no live "
                        "engine (%d so far)", full, now - victim.last_seen, self.idle_evicted)
        return True

    def _sweep_period(self) -> float:
        return max(0.05, min(5.0, self.idle_timeout_s / 4))

    def _sweep(self) -> None:
        """Close connections serving no live engine idle for ``idle_timeout_s``; runs
        on a timer."""
        loop = self._loop
        if loop is None or self._listener is None:
            return
        now = loop.time()
        for conn in [c for c in self._conns.values()
                     if self._idle(c, now, self.idle_timeout_s)]:
            conn.close()
            self.idle_closed += 1
            self._refuse("idle_timeout")
        self._sweeper = loop.call_later(self._sweep_period(), self._sweep)

    def _resume_accepting(self, listener: socket.socket) -> None:
        if self._listener is listener and self._loop is not None:
            self._loop.add_reader(listener.fileno(), self._accept)

    def _closed(self, conn: Connection) -> None:
        if self._conns.get(conn.fd) is conn:
            del self._conns[conn.fd]

    def _refuse(self, reason: str) -> None:
        if self._on_refuse is not None:
            self._on_refuse(reason)

    def _refusal(self, cred: PeerCred | None) -> Error:
        """One ``forbidden`` reply, nothing read, nothing about the engines said."""
        self.forbidden += 1
        self.errors += 1
        self._refuse("forbidden")
        who = (f"uid {cred.uid} gid {cred.gid} pid {cred.pid}" if cred is not None
               else "a peer without credentials")
        if worth_logging(self.forbidden):
            log.warning("engine socket: refused %s (allowed: %s; %d refused so far)", who,
                        self.access.describe(), self.forbidden)
        return Error(FORBIDDEN, f"{who} may not use this sidecar (its operator "
                                "can allow a uid or gid: --allow-uid, --allow-gid)")

    # ---- messages

    def _message(self, conn: Connection, data: Buffer) -> None:
        """One whole message from ``conn`` (``data`` may be a view into the receive
        buffer: everything that reads it runs before this returns)."""
        self.messages += 1
        conn.last_seen = conn.loop_time()
        if len(data) > self.size_limit.limit:
            self.bad_messages += 1
            too_large = self.size_limit.refuse(len(data))
            conn.reply(self._error(Error(BAD_MESSAGE, f"{too_large} (--max-message-bytes)",
                                         id=_salvage_id(data))))
            return
        try:
            req = decode_request(data)
        except ProtocolError as e:
            self.bad_messages += 1
            conn.reply(self._error(Error(e.code, e.message, id=e.id)))
            return
        if conn.in_flight >= self.max_in_flight:
            self.refused_in_flight += 1
            self._refuse("in_flight_limit")
            if worth_logging(self.refused_in_flight):
                log.warning("engine socket: refused a request, %d in flight on one connection "
                            "is the limit (%d refused so far)", self.max_in_flight,
                            self.refused_in_flight)
            conn.reply(self._error(Error(UNAVAILABLE, (
                f"{self.max_in_flight} requests are in flight on this connection, the limit; "
                "wait for replies before sending more"), id=req.id)))
            return
        conn.in_flight += 1
        # The handler's first step runs here and now, in arrival order: most
        # requests (reads, holds, polls with something to return) never wait, and
        # are answered without a task or a turn of the loop (measured with a
        # trivial handler: daemon CPU per request 18-26 -> 10-18 µs). One that
        # waits goes on in a task from where it stopped.
        answer = self._answer(conn, req)
        try:
            waiting = answer.send(None)
        except StopIteration:
            return
        task = carried_on(answer, waiting)
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)
        if type(req) is Poll:  # nobody to answer once its connection goes
            conn.waiting.add(task)
            task.add_done_callback(conn.waiting.discard)

    async def _answer(self, conn: Connection, req: Request) -> None:
        # The handler sees its sender. Set in the connection's own context (its
        # reader callback's, which a task that carries this on copies): every
        # request of a connection comes from the same peer.
        current_peer.set(conn.cred)
        try:
            reply = await self._reply_to(req)
        finally:
            conn.in_flight -= 1
        if isinstance(reply, Error):
            reply = self._error(reply)
        elif type(reply) in _REGISTERING and isinstance(req, (Register, Reserve)):
            if len(conn.engines) >= _PRUNE_ENGINES_AT:  # a busy connection churning ids
                self._serves_engine(conn)
            conn.engines.add(req.engine_id)
        conn.reply(reply)

    def _error(self, reply: Error) -> Error:
        self.errors += 1
        if len(reply.message) > MAX_ERROR_CHARS:
            cut = len(reply.message) - MAX_ERROR_CHARS
            reply.message = f"{reply.message[:MAX_ERROR_CHARS]}... ({cut} characters cut)"
        return reply

    def _encode(self, reply: Reply) -> bytes:
        try:
            return encode_reply(reply)
        except Exception as e:  # a handler's reply holding what msgpack cannot carry
            log.exception("cannot encode %s reply", type(reply).__name__)
            self.internal_errors += 1
            self.errors += 1
            return encode_reply(Error(INTERNAL, f"unencodable reply: {e}", id=reply.id))

    async def _reply_to(self, req: Request) -> Reply:
        try:
            reply = await self.handler.handle(req)
        except RequestError as e:
            reply = Error(e.code, e.message)
        except Exception as e:
            log.exception("handler failed on %s (engine request id %d)", type(req).__name__,
                          req.id)
            self.internal_errors += 1
            reply = Error(INTERNAL, f"{type(e).__name__}: {e}")
        if not isinstance(reply, REPLY_TYPES):
            log.error("handler returned %r for %s, not a reply", reply, type(req).__name__)
            self.internal_errors += 1
            reply = Error(INTERNAL, f"handler returned {type(reply).__name__}, not a reply")
        reply.id = req.id
        return reply


def _say_and_close(sock: socket.socket, reply: Error) -> None:
    """One error reply to a connection refused at the door, then the end (a fresh
    socket's buffer always takes one short message)."""
    with contextlib.suppress(OSError):
        sock.send(encode_reply(reply), socket.MSG_NOSIGNAL)
    sock.close()


class _Id(msgspec.Struct):
    id: int = -1


_id_decoder = msgspec.msgpack.Decoder(_Id)


def _salvage_id(data: Buffer) -> int:
    """The request id of a message refused unread, if it has one (msgspec skips
    the rest without building it), so the engine can match the error."""
    try:
        return _id_decoder.decode(data).id
    except Exception:  # any bytes at all: no id
        return -1


def _always(_engine_id: str) -> bool:
    return True


def _uid_of(conn: Connection) -> int:
    """The uid a connection counts against (-1: none known; never admitted)."""
    return conn.cred.uid if conn.cred is not None else -1
