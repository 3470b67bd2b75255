"""The wire protocol between an engine and its local sidecar (msgpack over
``AF_UNIX`` ``SOCK_SEQPACKET``, framed by :mod:`kvsidecar.ipc.seqpacket`).

One message is one msgpack map (one packet, or a long one in chunks after a
header). Requests and replies are each a tagged union keyed by ``op``, so one
typed decoder per direction turns
bytes into the right Struct in a single pass, and unknown or mistyped input
fails there, with a message that names the field, before any handler runs.

::

    engine (client)                           sidecar (engine server)
      Read(id=7, ...)          ────────────▶  handler
      Hold(id=8, ...)          ────────────▶  handler
                               ◀────────────  Ok(id=7)
                               ◀────────────  Ok(id=8)
      Poll(id=9, engine_id)    ────────────▶
                               ◀────────────  Completions(id=9, items=[...])

``id`` is chosen by the client and echoed in the reply, so an asyncio client
can keep several calls outstanding. ``v`` is the protocol's major version and
is always on the wire (never omitted as a default) so a daemon of another
version can still read it and answer with an error naming both versions.

Maps rather than ``array_like`` arrays: a read request costs a few
microseconds either way next to a socket round trip, and map errors name fields
(``$.local_block_ids[0][3]``) instead of positions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Final, Literal, TypeAlias

import msgspec
from msgspec import Meta

from .layout import Layout

PROTOCOL_VERSION: Final = 1
PROTOCOL_MINOR: Final = 11
"""Additions within major version 1 that a client may rely on, announced in
:class:`Pong` (a daemon older than the field answers 0):

* 0: the original protocol.
* 1: a hold's completion lists its ``readers`` (:class:`ReaderReport`); a
  ``received`` completion carries ``descriptors``.
* 2: region kinds (``memfd``, ``cuda_ipc``, ``cuda_vmm``), ``Register.memory``,
  ``Registered.fd_socket``, and :class:`Reserve` with ``reserved`` region
  views (a fixed-size allocation the engine's allocator carves its KV from).
* 3: a ``received`` completion lists its ``transfers`` (:class:`TransferReport`),
  one per remote rank read from, with the sidecar's own timings.
* 4: :class:`Poll` ``wait_s``: the daemon holds an empty poll until a
  completion arrives or ``wait_s`` passes (a daemon of an older minor ignores
  the field and answers at once, so a client loses nothing but the wait).
* 5: :class:`Batch`: several reads, holds and releases in one message,
  answered by :class:`Replies` (one reply per item, in order).
* 6: :class:`Status`, answered by :class:`StatusReport` (``kvsidecar status``;
  an older daemon answers ``bad_message`` "unknown op 'status'").
* 7: ``Read.verify``: verify the read's bytes (``--verify-bytes`` for one
  read); a daemon of an older minor ignores the field and does not verify, so
  the client asks the minor first and refuses a verified read there.
* 8: :class:`Deregister` ``mode`` (``drain`` or ``drop``); an engine that exits
  or dies with holds open has them served until they end (a daemon of an older
  minor ignores the field and drops).
* 9: :class:`Ping` ``engines``: a ping naming engine ranks renews their
  liveness lease (an idle engine's keepalive, independent of its steps), and
  :class:`Pong` ``engine_lease_s`` says how long that lease is.
* 10: :class:`Keep`: a decode engine keeps the holds of the requests it has
  admitted alive at their prefill sidecars while they wait to be read.
* 11: hold tokens (:mod:`~kvsidecar.ipc.hold_token`): ``Held.token``,
  ``Registered.hold_key``, ``Read.remote_tokens`` (one per remote rank; a
  read without them is refused).

Additions are new reply fields with defaults, which a client of an older
minor ignores (replies do not forbid unknown fields), or new request fields
whose default means the old behaviour (requests do not forbid unknown fields
either); anything an older daemon could misread is a new major version,
refused with a ``version`` error naming both.
"""

# Error codes (``Error.code``). Plain strings on the wire so that a newer
# daemon's new code still decodes in an older client (as the base error).
BAD_MESSAGE: Final = "bad_message"
VERSION: Final = "version"
UNKNOWN_ENGINE: Final = "unknown_engine"
BAD_REQUEST: Final = "bad_request"
DUPLICATE: Final = "duplicate"
INCOMPATIBLE: Final = "incompatible"
UNAVAILABLE: Final = "unavailable"
INTERNAL: Final = "internal"
FORBIDDEN: Final = "forbidden"  # the sender's uid/gid may not use this sidecar
#: What an ``unavailable`` names when the engine id's previous registration is
#: still being released (its reads may still write into its memory): a client
#: registering that id again may wait and retry on this, not on other refusals.
RELEASING: Final = "is releasing"
ERROR_CODES: Final = (
    BAD_MESSAGE, VERSION, UNKNOWN_ENGINE, BAD_REQUEST, DUPLICATE, INCOMPATIBLE, UNAVAILABLE,
    INTERNAL, FORBIDDEN,
)

NonNegative = Annotated[int, Meta(ge=0)]
PID_MAX: Final = 1 << 22  # Linux's PID_MAX_LIMIT
MAX_HOLD_S: Final = 3600.0
MAX_POLL_WAIT_S: Final = 60.0
"""Longest a poll may wait for a completion; a longer wait is a longer client timeout."""
"""Longest hold anyone may ask for (vLLM pins blocks 480 s); also rules out inf and NaN."""
#: Ids are bounded so that nothing an engine sends (and nothing quoted back in
#: an error) grows without limit; vLLM's ids are tens of characters.
MAX_ID_CHARS: Final = 256
EngineId = Annotated[str, Meta(min_length=1, max_length=MAX_ID_CHARS)]
RequestId = Annotated[str, Meta(max_length=4 * MAX_ID_CHARS)]
#: A ``host:port`` (IPv6 in brackets) with room for long DNS names.
Address = Annotated[str, Meta(min_length=1, max_length=300)]
BlockIds = list[list[int]]
HoldToken = Annotated[str, Meta(max_length=160)]
"""One list of block ids per KV-cache group, in the layout's group order.

Plain ints, no ``ge=0`` constraint: decoding is dominated by creating Python
ints (~20 ns each) and a constraint adds ~40% on top, while the handler has to
check ids against ``num_blocks`` anyway, which catches negatives too.
"""


class ProtocolError(ValueError):
    """Bytes that are not a valid message of this protocol version.

    ``code`` is :data:`BAD_MESSAGE` or :data:`VERSION`; ``id`` is the request id
    when it could still be read (so the error reply reaches the right caller),
    else -1.
    """

    def __init__(self, code: str, message: str, id: int = -1) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.id = id


class RequestError(Exception):
    """Raised by the daemon's request handler for input it refuses.

    The engine server turns it into an :class:`Error` reply with ``code``; the
    client turns that into the matching typed exception.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


# --------------------------------------------------------------------------
# Region references: how memory is named across processes
# --------------------------------------------------------------------------


class _RegionRefBase(msgspec.Struct, tag_field="kind", frozen=True, forbid_unknown_fields=True):
    """Tagged by ``kind`` so that new kinds of memory add a Struct, not a field."""


class ShmRef(_RegionRefBase, tag="shm", frozen=True, forbid_unknown_fields=True):
    """A POSIX shared-memory object (host memory); ``name`` has no leading slash.

    The region is ``nbytes`` bytes starting ``offset`` bytes into the object.
    """

    name: Annotated[str, Meta(min_length=1, max_length=200)]
    nbytes: Annotated[int, Meta(ge=1)]
    offset: NonNegative = 0


#: A file-descriptor set is fetched once, by the token the ``Registered``
#: reply carries, from the sidecar's fd socket (``Registered.fd_socket``).
FdToken = Annotated[str, Meta(min_length=16, max_length=64, pattern="^[0-9a-f]+$")]
#: ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` (nvidia-smi -L's form): devices
#: are named by UUID because indices differ between processes
#: (``CUDA_VISIBLE_DEVICES``).
DeviceUuid = Annotated[str, Meta(pattern="^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-"
                                         "[0-9a-f]{4}-[0-9a-f]{12}$")]
CUDA_IPC_HANDLE_BYTES: Final = 64


class MemfdRef(_RegionRefBase, tag="memfd", frozen=True, forbid_unknown_fields=True):
    """Host memory in an anonymous ``memfd`` the sidecar created: no name in
    ``/dev/shm`` (nothing to leak or guess); the file descriptor itself is
    the capability. It is fd number ``index`` of the set fetched with
    ``token`` from the sidecar's fd socket (SCM_RIGHTS)."""

    token: FdToken
    index: NonNegative
    nbytes: Annotated[int, Meta(ge=1)]


class CudaIpcRef(_RegionRefBase, tag="cuda_ipc", frozen=True, forbid_unknown_fields=True):
    """GPU memory shared with a legacy CUDA IPC handle (``cuIpcGetMemHandle``
    of a ``cuMemAlloc`` base): the region is ``nbytes`` at ``offset`` into
    that allocation, on the GPU named ``device_uuid``. Sent by the sidecar
    (allocate mode) or by an engine whose tensor it is (attach mode)."""

    handle: Annotated[bytes, Meta(min_length=CUDA_IPC_HANDLE_BYTES,
                                  max_length=CUDA_IPC_HANDLE_BYTES)]
    device_uuid: DeviceUuid
    nbytes: Annotated[int, Meta(ge=1)]
    offset: NonNegative = 0


class CudaVmmRef(_RegionRefBase, tag="cuda_vmm", frozen=True, forbid_unknown_fields=True):
    """GPU memory from ``cuMemCreate`` exported as a POSIX file descriptor,
    which travels like :class:`MemfdRef`'s (fd ``index`` of the set
    ``token`` names). ``alloc_bytes`` is the allocation's size (``nbytes``
    rounded up to the granularity): the importer maps all of it."""

    token: FdToken
    index: NonNegative
    device_uuid: DeviceUuid
    nbytes: Annotated[int, Meta(ge=1)]
    alloc_bytes: Annotated[int, Meta(ge=1)]


class ReservedRef(_RegionRefBase, tag="reserved", frozen=True, forbid_unknown_fields=True):
    """``nbytes`` at ``offset`` into the allocation the registering engine made
    with :class:`Reserve` (attach mode): the sidecar's own memory, so it
    registers its own pointer and nothing is imported or re-exported."""

    offset: NonNegative
    nbytes: Annotated[int, Meta(ge=1)]


RegionRef: TypeAlias = ShmRef | MemfdRef | CudaIpcRef | CudaVmmRef | ReservedRef
#: What ``Register.memory`` may ask a sidecar to allocate (allocate mode).
MemoryKind: TypeAlias = Literal["shm", "memfd", "cuda_malloc", "cuda_vmm"]
DrainMode: TypeAlias = Literal["drain", "drop"]
"""What :class:`Deregister` does with the engine's open holds."""
MEMORY_KINDS: Final = ("shm", "memfd", "cuda_malloc", "cuda_vmm")


# --------------------------------------------------------------------------
# Requests (engine -> daemon)
# --------------------------------------------------------------------------


class _RequestBase(msgspec.Struct, tag_field="op", kw_only=True, frozen=True):
    """Fields every request carries; keyword-only so subclasses keep their own order."""

    id: int
    v: int = PROTOCOL_VERSION


class Register(_RequestBase, tag="register", frozen=True):
    """Announce one engine rank and its KV memory.

    ``mode="attach"``: the engine allocated the regions and passes references.
    ``mode="allocate"``: the daemon allocates them, of kind ``memory``
    (``shm``/``memfd`` host memory, ``cuda_malloc``/``cuda_vmm`` on the
    sidecar's GPU), and returns references in :class:`Registered`.
    ``keep_on_exit`` keeps the registration when the engine's process is
    gone, for engines that restart and reattach.

    Liveness: the engine is alive while it sends requests (a poll is enough)
    at least every ``--engine-lease`` seconds. ``pid`` is an extra, faster
    signal, used only when ``pid_ns`` (``readlink /proc/self/ns/pid``) names
    the sidecar's own PID namespace. ``instance`` names the engine process
    (random per process): the same instance registering the same id, rank and
    layout again gets the same registration (a retry after a timeout); another
    instance may take a kept registration over once the old one is dead.
    """

    engine_id: EngineId
    tp_rank: NonNegative
    layout: Layout
    mode: Literal["attach", "allocate"]
    regions: list[RegionRef] = []
    keep_on_exit: bool = False
    pid: Annotated[int, Meta(ge=0, le=PID_MAX)] = 0
    pid_ns: Annotated[str, Meta(max_length=64)] = ""
    instance: Annotated[str, Meta(max_length=64)] = ""
    memory: MemoryKind = "memfd"


#: Largest reservation one request may ask for (a GPU's memory is well below).
MAX_RESERVE_BYTES: Final = 1 << 42


class Reserve(_RequestBase, tag="reserve", frozen=True):
    """Allocate one region of ``nbytes`` of kind ``memory`` for ``engine_id``
    before it knows its layout (vLLM allocates its KV cache as one buffer and
    learns the layout from it). Answered with :class:`Reserved`; the engine
    then registers (attach mode) :class:`ReservedRef` views into it. One
    reservation per engine id; it goes with the registration, or with a
    ``Deregister`` of the engine id if it never registers."""

    engine_id: EngineId
    nbytes: Annotated[int, Meta(ge=1, le=MAX_RESERVE_BYTES)]
    memory: MemoryKind = "memfd"


class Deregister(_RequestBase, tag="deregister", frozen=True):
    """Forget an engine rank: aborts its reads, refuses new work for it.

    ``mode`` ``drop`` (the default: the old behaviour) ends its holds and frees
    its memory now. ``drain`` keeps its memory registered and serving the open
    holds until each ends (``sent``, ``aborted``, ``expired``, bounded by the
    hold's deadline and ``--hold-max-life``), then frees it; the reply comes at
    once and the engine may exit. Memory the engine allocated itself on the GPU
    (``cuda_ipc`` attach) cannot outlive it: its holds end at once either way.
    With ``drain`` the engine hears nothing more of those holds, so it must not
    write attached memory (``shm``) they pin again, nor register it again, while
    they may be read: it exits, or deregisters with ``drop``.
    """

    engine_id: EngineId
    mode: DrainMode = "drop"


class RemoteEngine(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where the prefill engine's ranks can be reached: one ``host:port`` per rank."""

    engine_id: EngineId
    tp_size: Annotated[int, Meta(ge=1, le=4096)]
    handshake: Annotated[list[Address], Meta(max_length=4096)]


class Read(_RequestBase, tag="read", frozen=True):
    """Pull a request's KV blocks from a remote engine into local blocks.

    ``remote_request_id`` defaults to ``request_id``; ``skip_tokens`` leading
    tokens are already present locally (prefix cache hit) and are not read.
    ``num_tokens`` (the prompt length, optional) lets the planner skip kernel
    blocks that hold no token of the request: with large logical blocks (a
    hybrid model's page can hold thousands of tokens) that is most of the
    last page.
    The result arrives later through :class:`Poll` as a ``received`` or
    ``failed`` completion. Block ids name pages, never kernel blocks; tokens
    count tokens (the one convention: :mod:`kvsidecar.ipc.layout`, "Units and
    offsets").
    """

    engine_id: EngineId
    request_id: RequestId
    local_block_ids: BlockIds
    remote: RemoteEngine
    remote_block_ids: BlockIds
    remote_request_id: RequestId | None = None
    skip_tokens: NonNegative | None = None
    num_tokens: NonNegative | None = None
    #: verify the bytes (minor 7): P's sidecar digests what this read's plan takes
    #: from it, this sidecar what landed; a difference fails the read
    verify: bool = False
    #: one hold token per remote rank (what each P rank's hold issued; see
    #: :mod:`~kvsidecar.ipc.hold_token`): required, a read without them is refused
    remote_tokens: Annotated[list[HoldToken], Meta(max_length=4096)] = []


class Hold(_RequestBase, tag="hold", frozen=True):
    """Keep a finished prefill's blocks readable until ``readers`` peers read them.

    The engine must not reuse the blocks until a ``sent`` or ``expired``
    completion for ``request_id`` comes back; ``timeout_s`` (None: the daemon's
    default) bounds how long an unread hold lives. ``block_ids`` name pages,
    as in :class:`Read`.
    """

    engine_id: EngineId
    request_id: RequestId
    block_ids: BlockIds
    readers: Annotated[int, Meta(ge=1)] = 1
    timeout_s: Annotated[float, Meta(gt=0, le=MAX_HOLD_S)] | None = None


class Release(_RequestBase, tag="release", frozen=True):
    """Abort a read or drop a hold early (``aborted`` completion follows)."""

    engine_id: EngineId
    request_id: RequestId


class Poll(_RequestBase, tag="poll", frozen=True):
    """Collect completions.

    With ``ack`` (the ``last`` of the previous :class:`Completions` of the
    same ``epoch``) the daemon drops what was acknowledged and returns the
    rest, so a reply lost to a client timeout is delivered again by the next
    poll. Without it, whatever is returned is dropped at once.
    """

    engine_id: EngineId
    ack: NonNegative | None = None
    epoch: Annotated[str, Meta(max_length=64)] = ""
    #: with nothing to return, wait up to this long for a completion (minor 4):
    #: an engine that waits for its reads blocks in ``recv`` instead of spinning
    wait_s: Annotated[float, Meta(ge=0, le=MAX_POLL_WAIT_S)] = 0.0


#: Most engine ranks one :class:`Ping` may keep alive (a sidecar serves at most
#: 64 by default; one process keeps its own rank, or a few).
MAX_PING_ENGINES: Final = 256


class Ping(_RequestBase, tag="ping", frozen=True):
    """Liveness and version check; answered with :class:`Pong`.

    ``engines`` (minor 9): the engine ranks the sender keeps alive. Each one
    registered here by the sender's uid has its liveness lease renewed, as any
    request naming it does; the others are ignored (the reply's ``engines``
    then lacks them: registered no more, e.g. the sidecar restarted). A
    daemon of an older minor ignores the field.
    """

    engines: Annotated[list[EngineId], Meta(max_length=MAX_PING_ENGINES)] = []


MAX_BATCH: Final = 256
MAX_KEEP_CLAIMS_PER_KEEP: Final = 4096
"""Lease claims one :class:`Keep` may ask for: its items times the P ranks the
sidecar's rank keeps of each (P rank ``p`` by D rank ``p % D_tp``); more is
refused ``bad_request``, so a client sends fewer items per Keep."""
"""Most requests one :class:`Batch` may carry."""


class Batch(_RequestBase, tag="batch", frozen=True):
    """Several reads, holds and releases in one message (minor 5).

    What an engine's scheduler step produces at once (vLLM starts the reads
    of every request it schedules, and places holds for every prefill it
    finishes, in one step): one round trip, one decode and one wake-up of the
    sidecar instead of one per request. Each item keeps its own ``id`` and is
    answered on its own, in order (:class:`Replies`): one refused item does not
    refuse the others, and accepted items end in completions as usual.
    """

    requests: Annotated[list[Read | Hold | Release], Meta(min_length=1, max_length=MAX_BATCH)]


class Status(_RequestBase, tag="status", frozen=True):
    """An operator's snapshot of the sidecar (minor 6), answered with
    :class:`StatusReport`; it changes nothing. Any user the engine socket
    admits may ask (the socket's access policy is the only gate)."""


class KeepItem(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One admitted request: the prefill engine holding its blocks, its id there,
    and the hold token of each P rank (a keep claims as a read would, with them)."""

    remote: RemoteEngine
    remote_request_id: RequestId
    remote_tokens: Annotated[list[HoldToken], Meta(max_length=4096)] = []


class Keep(_RequestBase, tag="keep", frozen=True):
    """Keep the holds of requests this engine admitted but has not started reading
    (minor 10): for each item, the sidecar claims a lease on the hold at the P
    ranks this rank answers for (P rank ``p`` by D rank ``p % D_tp``), as a read
    would, without reading. Sent every few seconds while the requests wait, it
    keeps P's blocks for as long as a live reader wants them; when it stops (the
    decode engine is gone), P frees them one ``--hold-lease`` later. Answered
    ``Ok`` at once; the claims go out in the background (a refused or
    unanswered one is logged: the read then finds out for itself)."""

    engine_id: EngineId
    items: Annotated[list[KeepItem], Meta(max_length=MAX_BATCH)]


Request: TypeAlias = (Register | Deregister | Read | Hold | Release | Poll | Ping | Reserve
                      | Batch | Status | Keep)
REQUEST_TYPES: Final = (Register, Deregister, Read, Hold, Release, Poll, Ping, Reserve, Batch,
                        Status, Keep)


# --------------------------------------------------------------------------
# Replies (daemon -> engine)
# --------------------------------------------------------------------------


class _ReplyBase(msgspec.Struct, tag_field="op", kw_only=True):
    """Mutable, with a default id, so a handler writes ``Ok()`` and the server
    stamps the request's id on it without copying."""

    id: int = -1


class Ok(_ReplyBase, tag="ok"):
    """The request was accepted."""


class Registered(_ReplyBase, tag="registered"):
    """Where peers reach this engine rank, and (allocate mode) its regions."""

    engine_id: str
    handshake_address: str
    agent_name: str
    regions: list[RegionRef] = []
    #: Where the file descriptors of ``memfd``/``cuda_vmm`` regions are fetched
    #: (a Unix socket next to the engine socket); empty when none are needed.
    fd_socket: str = ""
    #: this rank's hold key (:mod:`~kvsidecar.ipc.hold_token`, 64 bytes, new on every
    #: registration): an engine that issues its own hold tokens (the vLLM
    #: connector's scheduler) issues them with it. Keep it as secret as the KV.
    hold_key: bytes = b""


class Reserved(_ReplyBase, tag="reserved"):
    """The reservation: map ``region`` (fds from ``fd_socket`` where its kind needs them)."""

    region: RegionRef
    fd_socket: str = ""


class Held(_ReplyBase, tag="held"):
    """A hold was placed. Readers keep it alive with leases: each claim or renewal
    a reader's sidecar sends before and while it reads keeps the blocks for
    ``lease_s`` more seconds; without any, the hold lives ``timeout_s``.
    Pass both on with the request (vLLM: ``kv_transfer_params``) so the
    decode side knows how long it may wait before it must start reading."""

    lease_s: float
    timeout_s: float
    #: the hold's token: readers present it (``Read.remote_tokens``), nothing
    #: moves without it; it expires with the hold's longest life
    token: str = ""


class ReaderReport(msgspec.Struct, frozen=True, omit_defaults=True):
    """What one reading engine did with a hold (P knows it per engine and rank).

    ``ranks``: the reading engine's ranks that reported to this P rank, by
    their completion notification (read) or an abandon (gave up).
    ``finished``: every rank the sharding rule makes report to this P rank
    did (``D_tp / P_tp`` of them when D is wider, else 1). ``failure``: why
    one of its ranks gave up ('' when none did).
    """

    engine_id: str
    ranks: list[int]
    finished: bool = False
    failure: str = ""


class TransferReport(msgspec.Struct, frozen=True, omit_defaults=True):
    """One NIXL transfer of a read: what was read from one remote rank.

    ``post_s``: posting it (on host memory this includes the CMA copy);
    ``xfer_s``: from the post to the moment the sidecar saw it done (NIXL's
    telemetry where available). The units of vLLM's NIXL metrics, which count
    one transfer per remote rank a request reads from.
    """

    remote_rank: int
    nbytes: int
    descriptors: int
    post_s: float = 0.0
    xfer_s: float = 0.0


class Completion(msgspec.Struct, frozen=True, omit_defaults=True):
    """The outcome of one read or hold.

    ``invalid_block_ids`` (per group) are local blocks whose contents cannot be
    trusted after a failed or partial read, so the engine recomputes them.
    ``nbytes`` and ``descriptors`` (``received``): what the read moved, and in
    how many NIXL descriptors (after coalescing), over all remote ranks;
    ``transfers`` splits them per remote rank (minor 3; a rank only notified,
    nothing read from it, has none).
    ``readers`` (``sent``, ``expired``, ``aborted`` of a hold): every reading
    engine that reported before the hold ended, in the order they first reported.
    A hold for ``readers=n`` ends ``sent`` the moment ``n`` distinct engines
    are ``finished`` without a failure; an engine that had reported only some
    of its ranks by then is listed unfinished (its later reports are ignored:
    the blocks may be reused). Empty from a daemon older than protocol minor 1.
    Defaults are left off the wire: most completions are just an id and a kind.
    """

    request_id: str
    kind: Literal["received", "sent", "expired", "failed", "aborted"]
    reason: str = ""
    invalid_block_ids: list[list[int]] = []
    nbytes: int = 0
    descriptors: int = 0
    readers: list[ReaderReport] = []
    transfers: list[TransferReport] = []


class Completions(_ReplyBase, tag="completions"):
    """``last`` numbers the newest item (acknowledge it in the next poll);
    ``epoch`` names the registration the numbers belong to."""

    items: list[Completion] = []
    last: int = 0
    epoch: str = ""


class Pong(_ReplyBase, tag="pong"):
    """``minor``: the daemon's :data:`PROTOCOL_MINOR` (0 from a daemon older than it).
    ``engines``: the engine ranks registered here by the sender's uid.
    ``engine_lease_s`` (minor 9; 0 from an older daemon): how long an engine
    rank that sends nothing stays registered (``--engine-lease``)."""

    version: int
    engines: list[str] = []
    minor: int = 0
    engine_lease_s: float = 0.0


class Error(_ReplyBase, tag="error"):
    """A refused or failed request; ``code`` is one of :data:`ERROR_CODES`."""

    code: str
    message: str


class Replies(_ReplyBase, tag="replies"):
    """The answers to a :class:`Batch`, one per item and in its order; each
    carries its item's ``id``."""

    items: list[Ok | Held | Error] = []


class StatusCheck(msgspec.Struct, frozen=True):
    """One readiness check, as ``/readyz`` reports it."""

    name: str
    ok: bool
    detail: str = ""


class PeerStatus(msgspec.Struct, frozen=True):
    """One remote rank an engine rank is linked to (a NIXL remote agent loaded).

    ``version``: the peer sidecar's, from its handshake ('' from a sidecar
    older than the field); ``reads``: reads of this engine holding the link."""

    address: str
    engine_id: str
    tp_rank: int
    version: str = ""
    reads: int = 0


MAX_STATUS_PEERS: Final = 32
"""Peer links a :class:`StatusReport` lists per engine rank (the most recently used)."""


class EngineStatus(msgspec.Struct, frozen=True):
    """One registered engine rank. Ages are seconds since the oldest read in
    flight was accepted and the oldest open hold was placed (0 when none);
    ``queued``: completions the engine has not taken yet (not polled, or
    polled and not acknowledged by its next poll); ``peers_linked``: its
    links, of which ``peers`` lists the :data:`MAX_STATUS_PEERS` most recently used."""

    engine_id: str
    tp_rank: int
    tp_size: int
    pid: int = 0
    lanes: int = 1
    reads: int = 0
    oldest_read_s: float = 0.0
    holds: int = 0
    oldest_hold_s: float = 0.0
    queued: int = 0
    peers_linked: int = 0
    peers: list[PeerStatus] = []


class StatusReport(_ReplyBase, tag="status_report"):
    """The answer to :class:`Status`: who this sidecar is, whether it is ready
    and why not (``checks``, as ``/readyz``), the transport path its start-up
    self-check found (``checking`` while it runs, ``off`` when disabled),
    whether it is draining, and every engine rank with its reads, holds and peers."""

    version: str
    daemon_id: str
    uptime_s: float
    socket: str
    handshake_address: str
    ready: bool
    draining: bool
    transport: str
    transport_detail: str = ""
    checks: list[StatusCheck] = []
    engines: list[EngineStatus] = []
    #: ended engines whose open holds are still served, and the bytes kept for them
    engines_draining: int = 0
    drain_bytes: int = 0


Reply: TypeAlias = (Ok | Registered | Held | Completions | Pong | Error | Reserved | Replies
                    | StatusReport)
REPLY_TYPES: Final = (Ok, Registered, Held, Completions, Pong, Error, Reserved, Replies,
                      StatusReport)


# --------------------------------------------------------------------------
# Encoding and decoding
# --------------------------------------------------------------------------

_request_encoder = msgspec.msgpack.Encoder()
_reply_encoder = msgspec.msgpack.Encoder()
_request_decoder: msgspec.msgpack.Decoder[Request] = msgspec.msgpack.Decoder(Request)
_reply_decoder: msgspec.msgpack.Decoder[Reply] = msgspec.msgpack.Decoder(Reply)


class _Envelope(msgspec.Struct):
    """The fields worth rescuing from a message that failed to decode."""

    id: int = -1
    v: int = PROTOCOL_VERSION
    op: str = ""


_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)
_REQUEST_OPS: Final = tuple(t.__struct_config__.tag for t in REQUEST_TYPES)
_REPLY_OPS: Final = tuple(t.__struct_config__.tag for t in REPLY_TYPES)

Buffer: TypeAlias = bytes | bytearray | memoryview


#: The encoder's own method, not a wrapper: the engine's client calls it once
#: per request, and on a cold cache each Python frame costs a microsecond or two.
encode_request: Final[Callable[[Request], bytes]] = _request_encoder.encode
#: Decode one reply, raising msgspec's errors (:func:`decode_reply` explains
#: them): the client's hot path, which turns a failure into
#: :func:`decode_reply`'s error only when there is one.
decode_reply_unchecked: Final[Callable[[Buffer], Reply]] = _reply_decoder.decode


def encode_reply(reply: Reply) -> bytes:
    return _reply_encoder.encode(reply)


def decode_request(data: Buffer) -> Request:
    """Decode one request; raise :class:`ProtocolError` (only) for anything invalid."""
    try:
        req = _request_decoder.decode(data)
    except Exception as e:  # the contract: ProtocolError, nothing else
        raise _explain(data, e, "request", _REQUEST_OPS) from None
    if req.v != PROTOCOL_VERSION:
        raise _version_error(req.v, req.id)
    return req


def decode_reply(data: Buffer) -> Reply:
    """Decode one reply; raise :class:`ProtocolError` (only) for anything invalid."""
    try:
        return _reply_decoder.decode(data)
    except Exception as e:
        raise _explain(data, e, "reply", _REPLY_OPS) from None


def _version_error(got: int, id: int) -> ProtocolError:
    return ProtocolError(
        VERSION,
        f"protocol version mismatch: message has v={got}, this side speaks v={PROTOCOL_VERSION}",
        id,
    )


def _explain(data: Buffer, exc: Exception, what: str, ops: tuple[object, ...]) -> ProtocolError:
    """Turn a decode failure into an error that names the problem and, if it can
    still be read, the request id (and a version mismatch as such)."""
    try:
        env = _envelope_decoder.decode(data)
    except Exception:  # not even an object with a usable id
        env = None
    if env is None:
        if isinstance(exc, msgspec.ValidationError):
            return ProtocolError(BAD_MESSAGE, f"invalid {what}: {exc}")
        return ProtocolError(BAD_MESSAGE, f"undecodable {what}: {exc}")
    if env.v != PROTOCOL_VERSION:
        return _version_error(env.v, env.id)
    if env.op and env.op not in ops:
        known = ", ".join(str(o) for o in ops)
        return ProtocolError(BAD_MESSAGE, f"unknown op {env.op!r} (known: {known})", env.id)
    return ProtocolError(BAD_MESSAGE, f"invalid {what}: {exc}", env.id)
