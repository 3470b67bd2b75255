"""The engine's side of the sidecar: a thin client over a Unix socket.

Every call is one short round trip: the daemon accepts or refuses a request
and answers at once; transfers finish later and are collected with
:meth:`SidecarClient.poll`. Nothing here waits on a transfer.

Two faces with the same methods over one core (:mod:`.client_core`):
:class:`SidecarClient` (blocking, one call at a time, one per thread, here)
and :class:`~.aio_client.AsyncSidecarClient` (coroutines, several calls
outstanding, replies matched by id). A face only moves bytes and waits.

The blocking client sends and receives on its ``SOCK_SEQPACKET`` connection
(:mod:`.client_socket`) directly, one system call each way and no I/O
thread. No daemon yet (no socket, nobody listening) is waited for, up to the
call's timeout; a connection the daemon closed (it restarted) is replaced by
a new one on the next call.

This module is the clients' public import path: it re-exports the async
client, the errors (:mod:`.errors`) and the call arguments and results.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Final, TypeVar

from . import client_socket
from .aio_client import AsyncSidecarClient
from .block_ids import BlockIdsLike, block_id_lists
from .client_core import (
    MAX_REPLY_BYTES,
    REGISTER_S_PER_GB,
    VERIFY_MINOR,
    WAIT_LONGER,
    Call,
    ClientCore,
    HoldSpec,
    ReadSpec,
    Registration,
    advance,
    can_verify,
    process_instance,
)
from .errors import (
    BadMessage,
    BadRequest,
    Duplicate,
    Forbidden,
    Incompatible,
    InternalError,
    SidecarError,
    SidecarTimeout,
    Unavailable,
    UnknownEngine,
    VersionMismatch,
    error_from_reply,
    expect,
)
from .layout import Layout
from .posted_requests import PostedRequests, refusal_code, refusal_reason
from .protocol import (
    Batch,
    Completion,
    DrainMode,
    Error,
    Held,
    Hold,
    KeepItem,
    MemoryKind,
    Ok,
    Poll,
    Pong,
    Read,
    RemoteEngine,
    Reply,
    Request,
    StatusReport,
    decode_reply_unchecked,
)
from .regions import Region
from .seqpacket import MAX_PACKET, packets, peer_closed

__all__ = [
    "MAX_REPLY_BYTES",
    "REGISTER_S_PER_GB",
    "VERIFY_MINOR",
    "AsyncSidecarClient",
    "BadMessage",
    "BadRequest",
    "BlockIdsLike",
    "ClientCore",
    "Duplicate",
    "Forbidden",
    "HoldSpec",
    "Incompatible",
    "InternalError",
    "ReadSpec",
    "Registration",
    "SidecarClient",
    "SidecarError",
    "SidecarTimeout",
    "Unavailable",
    "UnknownEngine",
    "VersionMismatch",
    "block_id_lists",
    "error_from_reply",
    "process_instance",
    "refusal_code",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
_NOSIGNAL: Final = socket.MSG_NOSIGNAL
_TRUNC: Final = socket.MSG_TRUNC


class SidecarClient:
    """Blocking client; one call in flight at a time, not thread-safe: use one per
    thread.

    Each call is one blocking send and one blocking receive on the client's
    own socket, bounded by ``SO_SNDTIMEO``/``SO_RCVTIMEO`` (set only when the
    timeout changes), in the calling thread: no I/O thread, no poller.
    After a timeout the socket is replaced, so a reply that arrives late
    cannot be taken for the next call's.
    """

    def __init__(self, socket_path: str, timeout_s: float = 10.0) -> None:
        self._core = ClientCore(socket_path, timeout_s)
        self._sock: socket.socket | None = None
        self._timeo = -1.0  # SO_RCVTIMEO/SO_SNDTIMEO as last set on _sock
        self._forks = 0  # client_socket.forks() when _sock was opened
        self._posted_in = 0  # client_socket.forks() when the last read_nowait was sent

    @property
    def timeout_s(self) -> float:
        return self._core.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._core.timeout_s = value

    def register(self, engine_id: str, tp_rank: int, layout: Layout, *,
                 regions: Sequence[Region] | None = None, allocate: bool = False,
                 keep_on_exit: bool = False, memory: MemoryKind = "memfd") -> Registration:
        """``memory`` (allocate mode): what the sidecar allocates, ``shm``/``memfd``
        host memory or ``cuda_malloc``/``cuda_vmm`` on its GPU."""
        return self._run(self._core.register(engine_id, tp_rank, layout, regions, allocate,
                                             keep_on_exit, memory))

    def deregister(self, engine_id: str, mode: DrainMode = "drop") -> None:
        """Forget the engine. ``mode="drain"``: its open holds are still served
        (memory kept) until they end, then freed; ``"drop"``: ended and freed now
        (see :class:`~kvsidecar.ipc.protocol.Deregister`)."""
        req, kind = self._core.deregister(engine_id, mode)
        expect(self._exchange(req), kind)
        self._book().forget_engine(engine_id)

    def reserve(self, engine_id: str, nbytes: int, memory: MemoryKind = "memfd") -> Region:
        """Have the sidecar allocate one region of ``nbytes`` for ``engine_id`` and
        map it here; register ``RegionView``s into it later (attach mode). For
        engines that learn their layout from their own allocation (vLLM: see
        :mod:`kvsidecar.integrations.vllm.pool`). ``deregister(engine_id)`` drops it."""
        return self._run(self._core.reserve(engine_id, nbytes, memory))

    def read(self, engine_id: str, request_id: str, local_block_ids: BlockIdsLike,
             remote: RemoteEngine, remote_block_ids: BlockIdsLike, *,
             remote_request_id: str | None = None, skip_tokens: int | None = None,
             num_tokens: int | None = None, verify: bool = False,
             remote_tokens: Sequence[str] = ()) -> None:
        """Ask the sidecar to pull ``remote_block_ids`` of ``remote`` into local blocks.

        ``remote_tokens``: the token each remote rank's ``hold`` issued
        (``Held.token``; vLLM: ``kv_transfer_params["remote_tokens"]``), one per
        remote rank in rank order. Required: a hold is a capability, and a read
        without its tokens (or with a token for other blocks, another request
        or engine, or expired) moves no byte and fails naming what is wrong.

        Errors, one rule: what the local sidecar can judge from the request
        itself (malformed, unknown engine, local ids out of range or named
        twice, group counts, tp sizes that do not divide, a request id already
        reading, a per-engine limit) raises here, and nothing was started;
        everything that needs the peer (handshake, model fingerprint, remote
        ids, the transfer) arrives later as a ``failed``
        completion from :meth:`poll`. An adapter that wants a single route
        turns the exception into a failed read itself (``kvsidecar.integrations.vllm``
        does).

        Units (one convention for read, hold and the vLLM adapter, defined in
        :mod:`kvsidecar.ipc.layout`, "Units and offsets"): block ids name pages
        (vLLM's logical blocks), never kernel blocks; ``skip_tokens`` and
        ``num_tokens`` count tokens.

        ``skip_tokens``: leading tokens D already holds (a prefix hit); a whole
        number of the local group's logical blocks (``sub_blocks *
        block_tokens``), the granularity of a prefix-cache hit. Leave it out
        only when both sides have the same ``sub_blocks`` (then it is inferred
        from the block counts); with differing ``sub_blocks`` and no
        ``num_tokens`` the read is refused rather than guessed.
        ``num_tokens``: the prompt length. It only trims kernel blocks past the
        last token; leaving it out reads whole blocks (more bytes, never fewer),
        so the default is the safe side.
        ``verify``: prove the bytes (as ``--verify-bytes`` does for every read):
        P's sidecar digests exactly what this read's plan takes from it, this
        sidecar what landed, and a difference makes the read ``failed`` (its
        blocks invalid), never ``received``. Host memory only (refused here
        for GPU memory). A sidecar of protocol minor < 7 would ignore it, so a
        verified read asks the sidecar's minor first (one ping) and raises
        :class:`Unavailable` there, sending nothing.
        """
        if verify:
            can_verify(self.ping().minor)
        req, kind = self._core.read(engine_id, request_id, local_block_ids, remote,
                                    remote_block_ids, remote_request_id, skip_tokens, num_tokens,
                                    verify, remote_tokens)
        expect(self._exchange(req), kind)

    def read_nowait(self, engine_id: str, request_id: str, local_block_ids: BlockIdsLike,
                    remote: RemoteEngine, remote_block_ids: BlockIdsLike, *,
                    remote_request_id: str | None = None, skip_tokens: int | None = None,
                    num_tokens: int | None = None, verify: bool = False,
                    remote_tokens: Sequence[str] = ()) -> None:
        """:meth:`read` without waiting for the sidecar's answer: the message is
        sent and the call returns (the engine's cost is one send). Reads sent
        so queue on the connection, and the sidecar starts those a wake-up
        finds together as one group (as ``read_many``'s).

        What :meth:`read` would raise arrives instead as a ``failed`` completion
        of ``request_id`` from the next :meth:`poll` of ``engine_id`` (reason:
        the refusal's code and message; nothing started, no block written). Any
        later call takes the answers (:meth:`poll` first, so a waiting poll
        never holds up a refusal). No read is carried out twice when a
        connection is lost (:mod:`~kvsidecar.ipc.posted_requests`, :meth:`close`).
        Bounded: with 64 requests unanswered this call first takes answers;
        with 4,096 refusals of ``engine_id`` unpolled it raises
        :class:`Unavailable`. A read of several packets waits for its answer
        and raises its refusal, as :meth:`read`. Otherwise it raises, nothing
        sent, only what the client can tell: :class:`SidecarTimeout` (the
        sidecar reads nothing), no sidecar, or ``verify`` against a sidecar
        that would ignore it."""
        if verify:
            can_verify(self.ping().minor)
        self._book().check_room(engine_id)
        req = self._core.read_request(engine_id, request_id, local_block_ids, remote,
                                      remote_block_ids, remote_request_id, skip_tokens,
                                      num_tokens, verify, remote_tokens)
        if not self._post(req):  # a long message (several packets) waits, as read() does
            expect(self._exchange(req), Ok)

    def _post(self, req: Read | Hold | Batch | Poll) -> bool:
        """Send ``req`` without waiting; the book takes the answer when it comes.
        False, nothing sent, for a message of several packets (the caller waits)."""
        posted = self._core.posted
        data = self._core.encode(req)
        if len(data) > MAX_PACKET:
            return False
        timeout_s = self._core.timeout_s
        deadline = time.monotonic() + timeout_s
        if posted.full:
            self._answers(posted.max_unanswered - 1, req, deadline)
        resends = 0
        while True:
            sock = self._ready(req, timeout_s, deadline, resends)
            posted.add(req, data, time.monotonic())
            try:
                sock.send(data, _NOSIGNAL)
            except BlockingIOError:  # SO_SNDTIMEO: the daemon reads nothing; not sent
                posted.discard(req.id)
                self._after_timeout()
                raise self._core.timeout_error(req, timeout_s) from None
            except OSError as e:  # this message never reached the daemon
                posted.discard(req.id)
                self._raise_refusal(self._lost(sock, e))
                if time.monotonic() >= deadline:
                    raise self._core.timeout_error(req, timeout_s) from None
                resends += 1
                continue
            return True

    def _post_many(self, engine_id: str, reqs: Sequence[Read | Hold]) -> None:
        """:meth:`_post` of one batch of ``reqs``; one too long for a packet waits
        for its answer, its refusals still reported by the next poll."""
        if not reqs:
            return
        core = self._core
        batch = core.batch_request(reqs)
        if self._post(batch):
            return
        posted = self._book()
        try:
            outcomes = self._run(core.batch_answers(batch))
        except SidecarTimeout:
            raise  # no answer: what became of it is unknown, as for read_many
        except SidecarError as e:  # refused whole (or answered short), as the book does
            outcomes = [e] * len(reqs)
        for req, outcome in zip(reqs, outcomes):
            if isinstance(outcome, SidecarError):
                posted.refuse(engine_id, req.request_id, refusal_reason(outcome))

    def hold(self, engine_id: str, request_id: str, block_ids: BlockIdsLike, *,
             readers: int = 1, timeout_s: float | None = None) -> Held:
        """Keep blocks for readers; the reply's lease and ``token`` travel to them with
        the request (a reader presents the token: nothing moves without it)."""
        req, kind = self._core.hold(engine_id, request_id, block_ids, readers, timeout_s)
        return expect(self._exchange(req), kind)

    def hold_nowait(self, engine_id: str, request_id: str, block_ids: BlockIdsLike, *,
                    readers: int = 1, timeout_s: float | None = None) -> None:
        """:meth:`hold` without waiting, as :meth:`read_nowait` is :meth:`read`'s
        (one book, rules and bounds). The engine issues the token itself
        (:func:`~kvsidecar.ipc.hold_token.issue` with its registration's
        ``hold_key``). A refusal is a ``failed`` completion of ``request_id``
        from the next :meth:`poll`: nothing pinned, and the sidecar refuses the
        token's readers from then on; an accepted hold completes as any hold.
        A field the sidecar would refuse on sight (``readers`` < 1,
        ``timeout_s`` out of range, an id too long) raises :class:`BadMessage`,
        nothing sent."""
        self._book().check_room(engine_id)
        req = self._core.hold_request(engine_id, request_id, block_ids, readers, timeout_s)
        if not self._post(req):  # a long message (several packets) waits, as hold() does
            expect(self._exchange(req), Held)

    def release(self, engine_id: str, request_id: str) -> None:
        req, kind = self._core.release(engine_id, request_id)
        expect(self._exchange(req), kind)

    def read_many(self, engine_id: str, specs: Sequence[ReadSpec]
                  ) -> list[SidecarError | None]:
        """Start several reads in one message (protocol minor 5): what a
        scheduler step starts at once costs one round trip. Returns, per read
        and in order, None (accepted: its completion comes through poll) or
        the error it was refused with; the others are unaffected. With a verified
        read among them, as :meth:`read`: Unavailable from a sidecar that would
        ignore ``verify``, and nothing sent."""
        if any(s.verify for s in specs):
            can_verify(self.ping().minor)
        return self._run(self._core.read_many(engine_id, specs))

    def hold_many(self, engine_id: str, specs: Sequence[HoldSpec]
                  ) -> list[Held | SidecarError]:
        """Place several holds in one message (protocol minor 5); per hold, its
        :class:`~kvsidecar.ipc.protocol.Held` or the error it was refused with."""
        return self._run(self._core.hold_many(engine_id, specs))

    def read_many_nowait(self, engine_id: str, specs: Sequence[ReadSpec]) -> None:
        """:meth:`read_many` (protocol minor 5) without waiting, on
        :meth:`read_nowait`'s book: each refused read is a ``failed`` completion
        of its own id from the next :meth:`poll` (the refusal bound may be
        passed by a batch's items). A batch of several packets waits for its
        answer, its refusals still reported so."""
        if any(s.verify for s in specs):
            can_verify(self.ping().minor)
        self._book().check_room(engine_id)
        self._post_many(engine_id, self._core.read_items(engine_id, specs))

    def hold_many_nowait(self, engine_id: str, specs: Sequence[HoldSpec]) -> None:
        """:meth:`hold_many` without waiting, as :meth:`read_many_nowait` is
        :meth:`read_many`'s; the engine issues the tokens (see
        :meth:`hold_nowait`). A hold the sidecar would refuse on sight raises
        :class:`BadMessage` at once, nothing of the batch sent."""
        self._book().check_room(engine_id)
        self._post_many(engine_id, self._core.hold_items(engine_id, specs))

    def release_many(self, engine_id: str, request_ids: Sequence[str]
                     ) -> list[SidecarError | None]:
        """Release several reads or holds in one message (protocol minor 5)."""
        return self._run(self._core.release_many(engine_id, request_ids))

    def poll(self, engine_id: str, wait_s: float = 0.0) -> list[Completion]:
        """Completions since the last poll; one that was lost to a timeout comes again.

        ``wait_s``: with nothing to return, block up to that long until a
        completion arrives (an engine waiting for its reads then costs no CPU
        and learns of each at once, instead of spinning on empty polls).
        Reads and holds of ``engine_id`` sent by :meth:`read_nowait` or
        :meth:`hold_nowait` and refused come first, as ``failed`` completions
        (each once; with any, no waiting)."""
        core = self._core
        posted = self._book()
        if len(posted):  # sent without waiting: their answers first
            self._answers(0, None, time.monotonic() + core.timeout_s)
        if posted.parked(engine_id):  # poll_nowait's: what it brought first, and only
            self._take_queued()
        pushed = core.pushed(engine_id, time.monotonic())
        if pushed:  # (taken: nothing may raise before they are returned)
            return posted.take_refused(engine_id) + pushed
        if posted.has_refused(engine_id):
            wait_s = 0.0  # refusals to report: no waiting
        req, kind = core.poll(engine_id, wait_s)
        items = core.polled(engine_id, expect(self._exchange(req), kind))
        if posted.has_refused(engine_id):  # answers taken during the exchange too
            return posted.take_refused(engine_id) + items
        return items

    def poll_nowait(self, engine_id: str) -> list[Completion]:
        """:meth:`poll` without waiting for the sidecar: a poll stays parked there
        (one per engine, ``Poll.wait_s``) and is answered as soon as it has a
        completion; this call takes that answer if it is already queued on the
        connection, parks the next poll and returns, so an empty one costs no
        round trip. A completion comes with the first call after the sidecar
        sent it (the first call only parks). Refusals of requests sent without
        waiting come first, as from :meth:`poll`; a refused poll raises, as does
        one unanswered for ``PARK_S`` + ``timeout_s`` (:class:`SidecarTimeout`)."""
        posted = self._book()
        self._take_queued()
        items = self._core.pushed(engine_id, time.monotonic())
        if not posted.parked(engine_id):
            try:
                self._post(self._core.park(engine_id))
            except (SidecarError, OSError):
                if items or posted.has_refused(engine_id):
                    return posted.take_refused(engine_id) + items  # the next call parks
                raise
        if posted.has_refused(engine_id):
            return posted.take_refused(engine_id) + items
        return items

    def _take_queued(self) -> None:
        """Take the answers already queued on the connection, without waiting."""
        sock = self._sock
        if sock is None or self._forks != client_socket.forks():
            return
        got, reset, ended = client_socket.take_queued(self._core, sock, None)
        if reset or ended:
            got = self._lost(sock, reset=reset) or got
        self._raise_refusal(got)

    def keep(self, engine_id: str, items: Sequence[KeepItem]) -> None:
        """Keep P's holds of requests this engine admitted and reads later
        (protocol minor 10; see :class:`~kvsidecar.ipc.protocol.Keep`)."""
        req, kind = self._core.keep(engine_id, items)
        expect(self._exchange(req), kind)

    def ping(self, engines: Sequence[str] = ()) -> Pong:
        """Version and this uid's registered engines; ``engines`` (protocol minor
        6) also renews their liveness lease (see :mod:`kvsidecar.ipc.keepalive`)."""
        req, kind = self._core.ping(engines)
        return expect(self._exchange(req), kind)

    def status(self) -> StatusReport:
        """The sidecar's state for operators (``kvsidecar status``; protocol minor 6)."""
        req, kind = self._core.status()
        return expect(self._exchange(req), kind)

    def close(self) -> None:
        """Close the connection. Answers still due to reads and holds sent
        without waiting are taken first (up to ``timeout_s``), so their refusals
        are reported by a later :meth:`poll` of this client. Of the requests still
        unanswered then (the sidecar answered nothing for ``timeout_s``), those
        it never read (it closed their connection) are reported ``failed`` the
        same way; the others are left to it, never sent again: it may carry
        them out (their completions come from it) or, finding this end closed,
        drop them unread, so no completion is promised for them."""
        posted = self._book()
        if len(posted):
            if self._sock is not None and self._forks == client_socket.forks():
                with contextlib.suppress(SidecarError):
                    self._answers(0, None, time.monotonic() + self._core.timeout_s,
                                  send=False)
            posted.fail_behind("the sidecar closed its connection before reading this "
                               "request (it stopped or restarted), and the client closed "
                               "before sending it again")
            if len(posted):
                log.warning("closing with %d reads or holds sent without waiting still "
                            "unanswered (the sidecar may still carry them out)", len(posted))
                posted.drop_unanswered()
        self._drop_socket()

    def _drop_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self._core.posted.unpark()  # never answered now

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _run(self, call: Call[T]) -> T:
        outcome: Reply | SidecarError | None = None
        while True:
            try:
                req = advance(call, outcome)
            except StopIteration as stop:
                result: T = stop.value
                return result
            try:
                outcome = self._exchange(req)
            except SidecarError as e:
                outcome = e
            except BaseException:
                call.close()
                raise


    def _connect(self, req: Request | None, timeout_s: float,
                 deadline: float) -> socket.socket:
        """A connection to the daemon, waiting (until ``deadline``) for one to
        listen; the requests sent without waiting that a connection the daemon
        closed left unanswered go out on it first (:meth:`_flush_behind`)."""
        pause, most = client_socket.CONNECT_PAUSE_S
        posted = self._book()
        while True:
            try:
                sock = client_socket.connect(self._core.path)
            except client_socket.NOT_YET:
                if time.monotonic() + pause >= deadline:
                    raise self._timeout(req, timeout_s) from None
                time.sleep(pause)
                pause = min(2 * pause, most)
                continue
            self._core.reset_framing()
            sock.setblocking(True)
            self._sock, self._timeo, self._forks = sock, -1.0, client_socket.forks()
            if not posted.behind or self._flush_behind(sock, req, timeout_s):
                return sock
            if time.monotonic() + pause >= deadline:  # closed again before it took them
                raise self._timeout(req, timeout_s)
            time.sleep(pause)  # a daemon that keeps closing on us is not hammered
            pause = min(2 * pause, most)

    def _timeout(self, req: Request | None, timeout_s: float) -> SidecarTimeout:
        if req is None:
            return SidecarTimeout(f"no answer to reads or holds sent without waiting within "
                                  f"{timeout_s} s from {self._core.endpoint}")
        return self._core.timeout_error(req, timeout_s)

    def _book(self) -> PostedRequests:
        """The book of requests sent without waiting; a forked child's starts empty
        (the reads, their answers and refusals are its parent's)."""
        posted = self._core.posted
        forks = client_socket.forks()
        if self._posted_in != forks:
            posted.forget()
            self._posted_in = forks
        return posted

    def _ready(self, req: Request | None, timeout_s: float, deadline: float,
               resends: int = 0) -> socket.socket:
        """A connection of this process with every unanswered request sent on it,
        its timeouts set to ``timeout_s`` (``resends``: connections lost so far
        in this call, so a daemon that keeps closing is not hammered)."""
        sock = self._sock
        if sock is None or self._forks != client_socket.forks():
            sock = self._reconnect(req, timeout_s, deadline, resends)
        elif self._core.posted.behind and not self._flush_behind(sock, req, timeout_s):
            sock = self._reconnect(req, timeout_s, deadline, resends + 1)
        if timeout_s != self._timeo:
            client_socket.set_timeouts(sock, timeout_s)
            self._timeo = timeout_s
        return sock

    def _flush_behind(self, sock: socket.socket, req: Request | None, timeout_s: float) -> bool:
        """Send on ``sock`` the unanswered requests not sent on it yet (the last
        connection closed without reading them), in order. False: this one is
        lost too (its answers taken, the rest still behind); a refusal of the
        connection itself is raised."""
        posted = self._core.posted
        if timeout_s != self._timeo:
            client_socket.set_timeouts(sock, timeout_s)
            self._timeo = timeout_s
        for msg_id, data in posted.unsent():
            # Marked before the send: an exception raised right after it (a
            # signal handler's) must not leave it behind, to be sent twice.
            posted.sent_again(msg_id)
            try:
                sock.send(data, _NOSIGNAL)
            except BlockingIOError:  # SO_SNDTIMEO: the daemon reads nothing; not sent
                posted.not_sent_again(msg_id)
                raise self._timeout(req, timeout_s) from None
            except OSError as e:
                posted.not_sent_again(msg_id)
                self._raise_refusal(self._lost(sock, e))
                return False
        return True

    @staticmethod
    def _raise_refusal(got: tuple[int, Reply | SidecarError] | None) -> None:
        """Raise what a closing daemon said without an id (e.g. ``forbidden`` or
        a connection limit, said at the door), if it said anything."""
        if got is None:
            return
        outcome = got[1]
        if isinstance(outcome, SidecarError):
            raise outcome
        if isinstance(outcome, Error):
            raise error_from_reply(outcome)

    def _lost(self, sock: socket.socket, err: OSError | None = None, reset: bool = False,
              req_id: int | None = None) -> tuple[int, Reply | SidecarError] | None:
        """``sock`` failed (``err``, or a reset or end seen while receiving):
        take what is queued on it (answers to the book) and drop it. Returns the
        reply to ``req_id`` found there, or an error the daemon said without an
        id (with one call in flight, that call's).

        Which unanswered requests go again follows from how it ended: a reset
        means the daemon closed it with messages of ours unread, the requests
        it did not answer, so they go again on the next connection; an end
        without one means it read everything (it stopped after reading them,
        or another error broke the socket): those are dropped, never sent
        twice, and their completions, if any, come from the daemon. (A send
        reports a pending reset itself, and then the queue no longer shows it.)"""
        if err is not None and err.errno == errno.ECONNRESET:
            reset = True
        got, saw_reset, _ = client_socket.take_queued(self._core, sock, req_id)
        self._drop_socket()
        posted = self._core.posted
        if not (reset or saw_reset) and posted.due:
            log.warning("the sidecar's connection ended after it read %d reads or holds sent "
                        "without waiting, without answering them (%s): not sent again; their "
                        "completions, if any, come from the sidecar", posted.due,
                        err or "it closed")
            posted.drop_due()
        posted.new_connection()
        return got

    def _after_timeout(self) -> None:
        """No reply in time: a fresh socket next time, so a late reply dies with
        this one; kept while requests sent without waiting await answers on it
        (replies carry ids: a late one is dropped as stale)."""
        if not self._core.posted.due:
            self._drop_socket()

    def _answers(self, until: int, req: Request | None, deadline: float, *,
                 send: bool = True) -> None:
        """Receive until at most ``until`` requests sent without waiting await their
        answers (each answer goes to the book; a stale reply is dropped), by
        ``deadline``. ``send``: first (re)connect and send what a lost
        connection left unanswered; else only take what the current
        connection owes."""
        core = self._core
        posted = core.posted
        resends = 0
        timed: socket.socket | None = None  # the socket whose timeouts this call set
        while len(posted) > until:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._timeout(req, core.timeout_s)
            sock = self._sock
            if send and (sock is None or self._forks != client_socket.forks()
                         or posted.behind):
                sock = self._ready(req, core.timeout_s, deadline, resends)
                if len(posted) <= until:
                    return  # a forked child's book, emptied on connecting
            elif sock is None or not posted.due:
                return
            if timed is not sock:
                client_socket.set_timeouts(sock, remaining)
                self._timeo = remaining
                timed = sock
            try:
                n = sock.recv_into(core.buf, 0, _TRUNC)
            except BlockingIOError:  # SO_RCVTIMEO
                raise self._timeout(req, core.timeout_s) from None
            except ConnectionResetError:
                self._raise_refusal(self._lost(sock, reset=True))
                resends += 1
                continue
            if n == 0 and peer_closed(sock):
                self._raise_refusal(self._lost(sock))
                resends += 1
                continue
            got = core.received(n)
            if got is None or posted.answered(*got):
                continue
            if got[0] == -1:  # said to this connection (e.g. at the door): this call's
                self._raise_refusal(got)
            log.debug("dropping a stale reply with id %d", got[0])

    @staticmethod
    def _send_data(sock: socket.socket, data: bytes) -> None:
        if len(data) <= MAX_PACKET:
            sock.send(data, _NOSIGNAL)
        else:
            for packet in packets(data):
                sock.send(packet, _NOSIGNAL)

    def _exchange(self, req: Request) -> Reply:
        """Send ``req`` and return its reply (or raise what the transport means).

        Each round connects if there is no connection (or only a forked
        parent's), sets the socket's timeouts if they changed, sends the
        request and receives its reply (:meth:`_receive`); the common case is
        one round of one send and one receive. A round ends without a reply
        when the daemon closed the connection with the request unread: it is
        sent again on a new connection, until the call's deadline."""
        core = self._core
        if len(core.posted):
            self._book()  # a forked child's starts empty
        data = self._core.encode(req)
        timeout_s = core.timeout_for(req) if type(req) in WAIT_LONGER else core.timeout_s
        deadline = time.monotonic() + timeout_s
        if len(data) > MAX_PACKET and len(core.posted):
            # A long message cut by a send timeout would leave the connection
            # mid-message while requests sent without waiting still await answers
            # on it (or go again on it): every answer is taken first.
            self._answers(0, req, deadline)
        resends = 0
        while True:
            sock = self._ready(req, timeout_s, deadline, resends)
            reply: Reply | None
            try:
                self._send_data(sock, data)
            except BlockingIOError:  # SO_SNDTIMEO: the daemon reads nothing
                self._after_timeout()
                raise core.timeout_error(req, timeout_s) from None
            except OSError as e:
                # The daemon closed this connection (it restarted, or refused this
                # process): what it said first is still queued; else the request never
                # reached it, so it goes again on a new connection.
                got = self._lost(sock, e, req_id=req.id)
                reply = None if got is None else self._settle(req, *got)
            else:
                reply = self._receive(sock, req, timeout_s, deadline)
            if reply is not None:
                return reply
            if time.monotonic() >= deadline:
                raise core.timeout_error(req, timeout_s) from None
            resends += 1

    def _reconnect(self, req: Request | None, timeout_s: float, deadline: float,
                   resends: int) -> socket.socket:
        """A new connection: the first, or after the daemon closed one (``resends``
        times for this call), or a forked child's own."""
        if self._sock is not None:
            self._drop_socket()  # a forked child: the connection is its parent's (closed here only)
        if resends:  # a daemon that keeps closing on us is not hammered
            pause, most = client_socket.CONNECT_PAUSE_S
            time.sleep(min(most, pause * resends))
        return self._connect(req, timeout_s, deadline)

    def _receive(self, sock: socket.socket, req: Request, timeout_s: float,
                 deadline: float) -> Reply | None:
        """The reply to ``req``; None when it must be sent again (the daemon closed
        the connection with it unread). A packet that is a whole reply to
        ``req`` is decoded and returned at once; anything else (a long reply's
        chunk, a stale or undecodable reply) goes through the core's framing and
        checks (:meth:`ClientCore.received`)."""
        core = self._core
        while True:
            try:
                n = sock.recv_into(core.buf, 0, _TRUNC)
            except BlockingIOError:  # SO_RCVTIMEO
                self._after_timeout()
                raise core.timeout_error(req, timeout_s) from None
            except ConnectionResetError:
                # Closed with data of ours unread (one call in flight: this request),
                # maybe after a refusal it queued for us.
                got = self._lost(sock, reset=True, req_id=req.id)
                if got is None:
                    return None
            else:
                if 0 < n <= MAX_PACKET and not core.assembler.announced:
                    try:
                        whole = decode_reply_unchecked(core.view[:n])
                    except Exception:  # undecodable: core.received says what is wrong
                        pass
                    else:
                        if whole.id == req.id:
                            return whole
                        if core.posted.answered(whole.id, whole):
                            continue  # a read sent without waiting: answered
                if n == 0 and peer_closed(sock):
                    self._lost(sock)
                    raise core.closed_error(type(req).__name__)
                got = core.received(n)
                if got is None:
                    continue  # a chunk of a long reply
                if core.posted.answered(*got):
                    continue
            settled = self._settle(req, *got)
            if settled is not None:
                return settled
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._after_timeout()
                raise core.timeout_error(req, timeout_s)
            client_socket.set_timeouts(sock, remaining)
            self._timeo = remaining

    def _settle(self, req: Request, id: int, outcome: Reply | SidecarError) -> Reply | None:
        """``outcome`` if it answers ``req`` (raised if an error), else None (stale)."""
        # With one call in flight, an error without an id (the daemon could not
        # read ours, or refused the connection) is still this call's.
        if id == req.id or (id == -1 and isinstance(outcome, (Error, SidecarError))):
            if isinstance(outcome, SidecarError):
                raise outcome
            return outcome
        log.debug("dropping a stale reply with id %d", id)
        return None
