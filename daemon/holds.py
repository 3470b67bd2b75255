"""P side: blocks held for readers, with leases the readers know.

A hold for ``readers`` engines ends once that many distinct reading engines
have each reported from every rank the sharding rule makes them report to
this rank (``D_tp / P_tp`` when D is wider, else 1), or when its deadline
passes. A rank reports by its NIXL completion notification (it read) or by
an *abandon* over the peer channel (its read failed or was aborted: nothing
of it is in flight any more). A reading engine with any abandoning rank
counts as finished but failed. The hold ends ``sent`` when every reader read,
``aborted`` (reason names the failures) when every reader finished and some
gave up, ``expired`` at its deadline. Every outcome lists the reading engines
that reported (:class:`ReaderOutcome`): which were served, which gave up,
which had reported only some ranks.

Leases (no clock sync): a reader claims the hold (before it posts, or while
its transfers run but before it notifies) and renews
while its read is pending; each claim or renewal moves the deadline to at
least ``receipt + lease_s`` on this clock. The reader noted its own send time
``t0`` and treats the lease as valid until ``t0 + lease_s`` on its clock,
which is never later than this deadline. So P frees blocks only after every
lease a reader may still rely on has run out. Renewals have an end whatever
a reader does: no lease reaches past ``max(timeout_s, max_life_s)`` after
the hold was placed (``--hold-max-life``); near it leases are granted short,
then refused, and the reader's read fails.

Capabilities (see :mod:`~kvsidecar.ipc.hold_token`): a hold remembers the
digest of the blocks it pins; a claim names the digest its (already checked)
token carries, and one for other blocks is refused. Members: each claim binds
its reading rank to the fleet member (the CURVE key) that sent it; a claim,
renewal or abandon for that rank from another member is refused, and the
service accepts that rank's notifications only from the agent this member
declared. Early entries are bounded per member as well as in all.

A hold for ``readers`` engines that more engines claimed (a request read
twice, a reader that stalled and another that took over) does not end when
``readers`` of them finished while another claimant's lease still runs: it
refuses new claims and ends, with the outcome its readers made, when every
claimant finished or those leases ran out (``finishing``).

Asynchronous scheduling: notifications, claims and abandons may arrive
before the engine calls ``hold``; they wait ``grace_s`` seconds in a bounded
buffer and apply the moment the hold is placed. A claim for a request whose
hold already ended (sent, expired, released) is refused: its blocks may be
reused. The last ``max_ended`` ends are remembered with why; beyond that, a
claim with no hold is told from an early one thus:

- a token the sidecar issued (at the hold, :func:`~kvsidecar.ipc.hold_token.check_issued_by`)
  came after its hold was placed: no hold means it ended, and the claim is refused;
- a token the engine issued may precede its hold: the claim is refused if
  its request may have ended within the tokens' longest life
  (:class:`~kvsidecar.daemon.recent_keys.RecentKeys`, fixed memory, errs
  towards refusing: a false positive fails an early read, never pins nothing).

Everything input can grow is bounded (early entries, reports per entry,
remembered ends), with counters for what was dropped.

Pure bookkeeping driven by the caller's clock, so it is tested without
sockets or timers: the daemon feeds it events and calls
:meth:`HoldBook.expire` periodically.
"""

from __future__ import annotations

import functools
import logging
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from kvsidecar.daemon.notifications import ReadDone
from kvsidecar.daemon.planner import expected_notifications
from kvsidecar.daemon.recent_keys import RecentKeys
from kvsidecar.ipc.hold_token import ENGINE_TOKEN_LIFE_S

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (engine_id, request_id)
ReaderRank = tuple[str, int]  # (reading engine, its rank)

MAX_REPORTS_PER_ENTRY = 1024
"""Reader ranks one early entry remembers (a D engine has at most a few hundred)."""


@dataclass(frozen=True)
class Report:
    """One reading rank is done with this rank's blocks: read (``failure`` empty)
    or gave up (``failure`` says why)."""

    reader_engine: str
    reader_rank: int
    reader_tp: int
    failure: str = ""

    @classmethod
    def of(cls, note: ReadDone) -> Report:
        return cls(note.reader_engine, note.reader_rank, note.reader_tp)


@dataclass
class _Hold:
    engine_id: str
    request_id: str
    p_tp: int
    readers: int
    deadline: float
    # reading engine -> its ranks that have reported
    seen: dict[str, set[int]] = field(default_factory=dict)
    done_engines: set[str] = field(default_factory=set)
    failures: dict[str, str] = field(default_factory=dict)  # reading engine -> first failure
    lease_until: float = 0.0  # the latest lease granted to any reader
    cap: float = math.inf  # no lease reaches past this (placed + max(timeout, max life))
    released: str = ""  # the engine released it while a lease still ran: ends at lease_until
    cut: str = ""  # why it ends early (cut_all): it expires once its readers' leases ran out
    #: its readers finished while another claimant's lease still ran: the outcome
    #: it ends with, at lease_until or once every claimant finished
    finishing: tuple[Literal["sent", "aborted"], str] | None = None
    placed: float = 0.0  # when the engine placed it (this clock)
    #: the engine's block ids (one list per group), as the request named them
    block_ids: list[list[int]] | None = None
    digest: bytes = b""  # the held blocks' digest (hold_token.blocks_digest); b"": unchecked
    #: the fleet member (CURVE public key) each reading rank claimed from
    members: dict[ReaderRank, bytes] = field(default_factory=dict)


def _due(h: _Hold) -> float:
    """When :meth:`HoldBook.expire` ends ``h`` (see :meth:`HoldBook.due`)."""
    return min(h.deadline, h.lease_until) if h.released or h.finishing else h.deadline


@dataclass
class _Early:
    arrived: float
    reports: list[Report] = field(default_factory=list)
    lease_until: float = 0.0
    member: bytes = b""  # the member whose claim made this entry
    digest: bytes = b""  # the blocks its claims' tokens name
    members: dict[ReaderRank, bytes] = field(default_factory=dict)
    #: a claim was granted on it (its renewals skip the check for an end)
    claimed: bool = False


@dataclass(frozen=True)
class ReaderOutcome:
    """One reading engine's part in a hold, as its outcome reports it."""

    engine_id: str
    ranks: tuple[int, ...]
    finished: bool
    failure: str = ""


@dataclass(frozen=True)
class HoldOutcome:
    engine_id: str
    request_id: str
    kind: Literal["sent", "expired", "aborted"]
    reason: str = ""
    #: every reading engine that reported, in the order of its first report
    readers: tuple[ReaderOutcome, ...] = ()


@dataclass(frozen=True)
class Lease:
    """The answer to a claim: granted for ``lease_s`` seconds from its receipt, or refused."""

    granted: bool
    lease_s: float = 0.0
    reason: str = ""


def _key_bytes(key: Key) -> bytes:
    return f"{len(key[0])}:{key[0]}{key[1]}".encode("utf-8", "surrogatepass")


@functools.lru_cache(maxsize=64)
def _expected(p_tp: int, reader_tp: int) -> int:
    """:func:`expected_notifications`, 1 for sizes it refuses (a reader's word
    on its tp size; a few pairs per fleet, so a small cache answers nearly
    every report without validating the sizes again)."""
    try:
        return expected_notifications(p_tp, reader_tp)
    except ValueError:
        return 1


class HoldBook:
    """All holds of one engine rank, keyed by (engine id, request id)."""

    def __init__(self, *, default_timeout_s: float, grace_s: float,
                 on_done: Callable[[HoldOutcome], None], lease_s: float = 10.0,
                 max_early: int = 4096, max_ended: int = 65536,
                 max_life_s: float = math.inf, max_early_per_member: int | None = None
                 ) -> None:
        self.default_timeout_s = default_timeout_s
        self.max_life_s = max_life_s
        self.grace_s = grace_s
        self.lease_s = lease_s
        self.max_early = max_early
        #: early entries one fleet member may open (default: max_early)
        self.max_early_per_member = (max_early_per_member if max_early_per_member is not None
                                     else max_early)
        self._early_of: dict[bytes, int] = {}
        self.max_ended = max_ended
        self._on_done = on_done
        self._holds: dict[Key, _Hold] = {}
        self._early: dict[Key, _Early] = {}
        self._ended: OrderedDict[Key, str] = OrderedDict()  # why each recent hold ended
        #: every end within the longest life of an engine-issued token (see
        #: _token_life), plus a lease: what a claim before its hold is checked against
        self.ended_recently = RecentKeys(self._token_life(default_timeout_s) + lease_s)
        self.unclaimed = 0
        self.duplicates = 0
        #: claims refused with no hold that may have ended (forgotten why, see the module)
        self.forgotten_refused = 0
        self.early_dropped = 0
        self.max_overrun = 0.0
        """Longest time past its deadline that a hold was found alive (housekeeping lag)."""

    def __len__(self) -> int:
        return len(self._holds)

    def _token_life(self, timeout_s: float) -> float:
        """How long an engine's own token for a hold of ``timeout_s`` may live
        (:data:`~kvsidecar.ipc.hold_token.ENGINE_TOKEN_LIFE_S`, or twice the
        timeout), or the sidecar's, ``--hold-max-life``, if longer."""
        return max(ENGINE_TOKEN_LIFE_S, 2 * timeout_s, self.max_life_s)

    def __contains__(self, key: Key) -> bool:
        return key in self._holds

    @property
    def early(self) -> int:
        return len(self._early)

    def oldest_age(self, now: float) -> float:
        """Seconds since the oldest open hold was placed (0.0 when none is open)."""
        return max((now - h.placed for h in self._holds.values()), default=0.0)

    def blocks(self, engine_id: str, request_id: str) -> list[list[int]] | None:
        """The block ids a live hold pins (None: no such hold, released, or placed
        without them): what a reader may have digested (``--verify-bytes``)."""
        h = self._holds.get((engine_id, request_id))
        return None if h is None or h.released else h.block_ids

    def ended_held(self, engine_id: str, request_id: str) -> bool:
        """Whether a hold of ``request_id`` was placed and has ended (``sent``,
        ``expired``, ``aborted``; not a refusal, not an engine that went away),
        as far as the last ``max_ended`` ends tell. A hold of it placed again
        while that end awaits the engine's poll is the first one sent again
        (the handler answers ``duplicate``), never a new hold."""
        return self._ended.get((engine_id, request_id)) in ("sent", "expired", "aborted")

    def waiting(self, engine_id: str, request_id: str) -> bool:
        """Claims or reports for this request wait for its hold (placed later)."""
        return (engine_id, request_id) in self._early

    def deadline(self, engine_id: str, request_id: str) -> float | None:
        h = self._holds.get((engine_id, request_id))
        return None if h is None else h.deadline

    def due(self, engine_id: str, request_id: str) -> float | None:
        """When :meth:`expire` ends this hold if nothing else does first: its
        deadline, or once released under a lease, that lease's end (None: no
        such hold)."""
        h = self._holds.get((engine_id, request_id))
        return None if h is None else _due(h)

    # ------------------------------------------------------------ the engine's side

    def add(self, engine_id: str, request_id: str, p_tp: int, readers: int,
            timeout_s: float | None, now: float, digest: bytes = b"", *,
            block_ids: list[list[int]] | None = None) -> None:
        """Place a hold; ``digest`` names its blocks (claims must name the same);
        ``block_ids`` are kept for digests of what it pins (``--verify-bytes``).
        A hold of a request whose earlier hold ended is a new hold: the caller
        places one only once the engine has acknowledged that end (see
        :meth:`ended_held`), else a copy sent again would pin blocks the engine
        frees when it polls the first end."""
        key = (engine_id, request_id)
        if key in self._holds:
            raise KeyError(f"request {request_id!r} is already held for engine {engine_id!r}")
        timeout = timeout_s if timeout_s is not None else self.default_timeout_s
        horizon = self._token_life(timeout) + self.lease_s
        if horizon > self.ended_recently.horizon_s:
            self.ended_recently.widen(horizon)
        h = _Hold(engine_id, request_id, p_tp, readers, now + timeout,
                  cap=now + max(timeout, self.max_life_s), placed=now, block_ids=block_ids,
                  digest=digest)
        self._ended.pop(key, None)  # the engine holds this id again: a new hold
        self._holds[key] = h
        early = self._pop_early(key)
        if early and early.digest and digest and early.digest != digest:
            log.warning("dropping early claims for request %r of engine %r: their tokens name "
                        "other blocks than the hold pins", request_id, engine_id)
            early = None
        if early:
            h.members.update(early.members)
            h.deadline = max(h.deadline, early.lease_until)
            h.lease_until = early.lease_until
            for r in early.reports:
                self._count(h, r)
            self._maybe_done(key, h, now)

    def release(self, engine_id: str, request_id: str, now: float) -> bool:
        """The engine drops the hold. While a reader's lease still runs, the blocks
        may be in a transfer: the hold then refuses new claims and ends
        (``aborted``) when the lease ends or every reader reported, not now."""
        key = (engine_id, request_id)
        h = self._holds.get(key)
        if h is None or h.released:
            return False
        if h.finishing:  # read by its readers already: ends as they made it
            return True
        if h.lease_until > now:
            h.released = "released by the engine"
            return True
        del self._holds[key]
        self._end(h, now, "aborted", "released by the engine")
        return True

    def claimed_early(self, engine_id: str, request_id: str, now: float) -> bool:
        """Whether a reader's lease on ``request_id``, granted before its hold,
        still runs (it may be copying the blocks now)."""
        early = self._early.get((engine_id, request_id))
        return early is not None and early.lease_until > now

    def refused(self, engine_id: str, request_id: str, why: str, now: float) -> None:
        """The engine's hold of ``request_id`` was refused (``why``): nothing is
        pinned, and the engine, told so, may reuse the blocks. Claims from now
        on are refused as for an ended hold (the engine may have issued the
        token itself before it held); the entry of claims that came before the
        hold is dropped with it (so are their renewals; its notifications are
        counted unclaimed). A lease granted before the refusal runs on at the
        reader until it expires, which is why a hold readers claimed early is
        refused only for its blocks, never for a limit (see
        :meth:`claimed_early`). A hold of it placed later is a new hold. A
        refusal for a hold placed already (a copy sent again) changes nothing."""
        key = (engine_id, request_id)
        if key in self._holds:
            return
        early = self._pop_early(key)
        if early is not None:
            self.unclaimed += len(early.reports)
            if early.lease_until > now:
                log.warning("the hold of request %r of engine %r was refused (%s) while a "
                            "reader's early lease on it runs for %.1f s more",
                            request_id, engine_id, why, early.lease_until - now)
        self._remember_end(key, f"the hold was refused: {why}", now)

    def withdraw(self, engine_id: str, request_id: str) -> None:
        """Take back a hold just placed whose placing failed (the engine is told
        so): gone without a completion, as if never placed."""
        self._holds.pop((engine_id, request_id), None)

    def cut_all(self, why: str, now: float) -> int:
        """End every open hold as soon as no reader may rely on it any more (the
        sidecar stops: ``--drain-timeout`` passed): no new claim or renewal is
        granted (its cap is ``now``), and :meth:`expire` ends it ``expired``,
        ``why`` in its reason, once the leases already granted ran out (at once
        where none runs). Each hold so ends once, with a completion its engine
        can poll, never dropped in silence. Returns how many it cut."""
        for h in self._holds.values():
            h.cap = min(h.cap, now)
            h.deadline = max(now, h.lease_until)
            h.cut = h.cut or why
        return len(self._holds)

    def drop_engine(self, engine_id: str) -> int:
        """Forget every hold of an engine that went away (no completions: nobody polls)."""
        keys = [k for k in self._holds if k[0] == engine_id]
        for k in keys:
            del self._holds[k]
            self._remember_end(k, "the engine went away", None)
        for k in [k for k in self._early if k[0] == engine_id]:
            self._pop_early(k)
        return len(keys)

    # ------------------------------------------------------------ the readers' side

    def claim(self, engine_id: str, request_id: str, now: float, *, digest: bytes = b"",
              member: bytes = b"", reader: ReaderRank | None = None,
              may_precede: bool = True) -> Lease:
        """A reader claims (or renews) its lease before (while) it reads.

        Granted while the hold lives (or before it is placed: early); refused
        once the hold has ended, since its blocks may then be reused, or once
        its readers read it. ``digest`` (from the claim's checked token) must
        name the hold's blocks; ``reader`` is bound to ``member`` by its first
        claim, and refused to anyone else. ``may_precede``: the token may have
        been issued before its hold was placed (the engine issued it); one the
        sidecar issued never is, so without a hold its claim is refused.
        """
        key = (engine_id, request_id)
        h = self._holds.get(key)
        if h is not None:
            if digest and h.digest and digest != h.digest:
                return Lease(False, reason=f"the hold token names other blocks than the hold "
                                           f"of {request_id!r} pins")
            if h.released:
                return Lease(False, reason=f"the hold of {request_id!r} was {h.released}")
            if h.finishing:
                return Lease(False, reason=f"the hold of {request_id!r} was read by its "
                                           f"{h.readers} reading engine(s) already")
            lease = min(self.lease_s, h.cap - now)
            if lease <= 0 and h.cut:
                return Lease(False, reason=f"the hold of {request_id!r} ends: {h.cut}")
            if lease <= 0:
                return Lease(False, reason=f"the hold of {request_id!r} reached its longest "
                                           f"life ({self.max_life_s:g} s, --hold-max-life)")
            # Bound only once granted: a refused claimant is no reader the hold waits for.
            refused = self._bind(h.members, reader, member)
            if refused:
                return Lease(False, reason=refused)
            h.deadline = max(h.deadline, now + lease)
            h.lease_until = max(h.lease_until, now + lease)
            return Lease(True, lease)
        ended = self._ended.get(key)
        if ended is not None:
            return Lease(False, reason=f"the hold of {request_id!r} has ended ({ended})")
        if not may_precede:
            self.forgotten_refused += 1
            return Lease(False, reason=f"the hold of {request_id!r} has ended (its token was "
                                       "issued at the hold, and no hold is open)")
        waiting = self._early.get(key)
        if (waiting is None or not waiting.claimed) and self.ended_recently.may_contain(
                _key_bytes(key), now):
            self.forgotten_refused += 1
            return Lease(False, reason=(
                f"the hold of {request_id!r} is not placed and may have ended (this rank "
                f"remembers why only for its last {self.max_ended} ends"
                + (", and more ended within the tokens' life than it can tell apart"
                   if self.ended_recently.saturated(now) else "") + ")"))
        early = self._early_entry(key, now, member)
        if early is None:
            return Lease(False, reason=f"too many requests wait for their hold on engine "
                                       f"{engine_id!r} ({self.max_early} in all, "
                                       f"{self.max_early_per_member} per fleet member)")
        if digest and early.digest and digest != early.digest:
            return Lease(False, reason="the hold token names other blocks than earlier claims "
                                       f"of {request_id!r}")
        refused = self._bind(early.members, reader, member)
        if refused:
            return Lease(False, reason=refused)
        early.digest = early.digest or digest
        early.lease_until = max(early.lease_until, now + self.lease_s)
        early.claimed = True
        return Lease(True, self.lease_s)

    def member_of(self, engine_id: str, request_id: str, reader: ReaderRank) -> bytes | None:
        """The fleet member ``reader`` claimed this hold from (None: no claim yet)."""
        members = self._members((engine_id, request_id))
        return None if members is None else members.get(reader)

    def may_report(self, engine_id: str, request_id: str, reader: ReaderRank,
                   member: bytes) -> str:
        """Why ``member`` may not report for ``reader`` ('' when it may): a rank
        that claimed from one member is that member's to abandon; an abandon
        for a rank that never claimed binds it to ``member`` as a claim would."""
        members = self._members((engine_id, request_id))
        if members is None:
            return ""
        return self._bind(members, reader, member)

    def _members(self, key: Key) -> dict[ReaderRank, bytes] | None:
        """Reading rank -> fleet member of the hold, else of its early entry
        (None: neither exists)."""
        h = self._holds.get(key)
        if h is not None:
            return h.members
        early = self._early.get(key)
        return None if early is None else early.members

    @staticmethod
    def _bind(members: dict[ReaderRank, bytes], reader: ReaderRank | None,
              member: bytes) -> str:
        if reader is None:
            return ""
        bound = members.get(reader)
        if bound is None:
            if len(members) >= MAX_REPORTS_PER_ENTRY:
                return "too many reading ranks claimed this hold"
            members[reader] = member
            return ""
        if bound != member:
            return (f"reader {reader[0][:200]!r} rank {reader[1]} claimed this hold from "
                    "another fleet member")
        return ""

    def notify(self, note: ReadDone, now: float, member: bytes = b"") -> None:
        """A reading rank's completion notification (it read this rank's blocks)."""
        self.report(note.target_engine, note.request_id, Report.of(note), now, member)

    def report(self, engine_id: str, request_id: str, r: Report, now: float,
               member: bytes = b"") -> None:
        """A reading rank is done: read, or gave up (``r.failure``); an early
        one counts against ``member``'s early entries."""
        key = (engine_id, request_id)
        h = self._holds.get(key)
        if h is None:
            if key in self._ended:
                return  # late news of a hold that already ended: nothing to free
            early = self._early_entry(key, now, member)
            if early is None or len(early.reports) >= MAX_REPORTS_PER_ENTRY:
                self.early_dropped += 1
                log.warning("dropping an early report for request %r of engine %r: too many "
                            "waiting for their hold", request_id, engine_id)
                return
            early.reports.append(r)
            return
        self._count(h, r)
        self._maybe_done(key, h, now)

    # ------------------------------------------------------------ time

    def next_due(self) -> float:
        """The earliest time at which :meth:`expire` has something to end
        (``math.inf`` when nothing can): a hold's deadline, or for a hold the
        engine released under a lease, that lease's end; for claims waiting for
        their hold, when both their grace and their lease have run out. Claims
        only move these later. Something new may be due sooner: a hold placed
        or released, and an early entry (a grace after it arrives)."""
        due = min((_due(h) for h in self._holds.values()), default=math.inf)
        return min(due, min((max(e.arrived + self.grace_s, e.lease_until)
                             for e in self._early.values()), default=math.inf))

    def expire(self, now: float) -> None:
        for key, h in list(self._holds.items()):
            if h.finishing is not None and now >= h.lease_until:
                del self._holds[key]
                self._end(h, now, h.finishing[0], h.finishing[1])
            elif h.released and now >= h.lease_until:
                del self._holds[key]
                self._end(h, now, "aborted", f"{h.released}; its readers' leases have run out")
            elif now >= h.deadline:
                del self._holds[key]
                self.max_overrun = max(self.max_overrun, now - h.deadline)
                got = {e: len(r) for e, r in h.seen.items()}
                self._end(h, now, "expired",
                          f"{h.cut + ': ' if h.cut else ''}{len(h.done_engines)} of "
                          f"{h.readers} reading engines finished before the deadline "
                          f"(reports per engine: {got or 'none'})")
        for key, e in list(self._early.items()):
            if now >= e.arrived + self.grace_s and now >= e.lease_until:
                self._pop_early(key)
                self.unclaimed += len(e.reports)
                if e.reports:
                    log.warning("%d notification(s) for request %r of engine %r were never "
                                "claimed by a hold", len(e.reports), key[1], key[0])

    # ------------------------------------------------------------ internals

    def _early_entry(self, key: Key, now: float, member: bytes) -> _Early | None:
        early = self._early.get(key)
        if early is None:
            mine = self._early_of.get(member, 0)
            if len(self._early) >= self.max_early or mine >= self.max_early_per_member:
                return None
            early = self._early[key] = _Early(now, member=member)
            self._early_of[member] = mine + 1
        return early

    def _pop_early(self, key: Key) -> _Early | None:
        early = self._early.pop(key, None)
        if early is not None:
            left = self._early_of[early.member] - 1
            if left:
                self._early_of[early.member] = left
            else:
                del self._early_of[early.member]
        return early

    def _count(self, h: _Hold, r: Report) -> None:
        ranks = h.seen.setdefault(r.reader_engine, set())
        if r.reader_rank in ranks:
            self.duplicates += 1
            if not r.failure:  # an abandon after the notification is expected; not news
                log.warning("duplicate notification for %r from %r rank %d", h.request_id,
                            r.reader_engine, r.reader_rank)
            return
        ranks.add(r.reader_rank)
        if r.failure:
            h.failures.setdefault(r.reader_engine, f"rank {r.reader_rank}: {r.failure}")
        want = _expected(h.p_tp, r.reader_tp)
        if len(ranks) >= want:
            h.done_engines.add(r.reader_engine)

    def _maybe_done(self, key: Key, h: _Hold, now: float) -> None:
        """End ``h`` once ``readers`` engines finished, unless another engine that
        claimed it may still be reading under its lease: then it ends (with the
        outcome fixed now) when that lease runs out or that engine finishes."""
        if len(h.done_engines) < h.readers:
            return
        if h.finishing is None:
            h.finishing = self._outcome(h)
        if h.lease_until > now and any(e not in h.done_engines for e, _ in h.members):
            return  # another claimant's lease runs: it may be copying the blocks now
        del self._holds[key]
        kind, reason = h.finishing
        self._end(h, now, kind, reason)

    @staticmethod
    def _outcome(h: _Hold) -> tuple[Literal["sent", "aborted"], str]:
        """How a hold whose readers all finished ends."""
        if h.released:
            return "aborted", f"{h.released}; every reader finished"
        if h.failures:
            why = "; ".join(f"{e} {f}" for e, f in sorted(h.failures.items()))
            return "aborted", f"every reader finished, {len(h.failures)} gave up: {why}"
        return "sent", ""

    def _end(self, h: _Hold, now: float, kind: Literal["sent", "expired", "aborted"],
             reason: str = "") -> None:
        """Remember why ``h`` ended and report its one outcome (built once: a
        hold ends once per read on P, the hot end of every transfer)."""
        self._remember_end((h.engine_id, h.request_id), kind, now)
        readers = tuple(ReaderOutcome(e, tuple(sorted(ranks)), e in h.done_engines,
                                      h.failures.get(e, ""))
                        for e, ranks in h.seen.items())
        self._on_done(HoldOutcome(h.engine_id, h.request_id, kind, reason, readers))

    def _remember_end(self, key: Key, why: str, now: float | None) -> None:
        """Remember why ``key`` ended; from ``now`` on its tokens' claims are refused
        (None: an engine that went away, whose hold key, and so tokens, went too)."""
        if now is not None:
            overflows = self.ended_recently.overflows
            self.ended_recently.add(_key_bytes(key), now)
            if self.ended_recently.overflows != overflows:
                log.warning("more holds ended within %.0f s than this rank can tell apart: "
                            "until %.0f s from now, claims with an engine's own token for a "
                            "request with no hold are refused as possibly ended",
                            self.ended_recently.horizon_s,
                            self.ended_recently.saturated_until - now)
        self._ended[key] = why[:200]  # an error text may be long; 65,536 of them are kept
        self._ended.move_to_end(key)
        while len(self._ended) > self.max_ended:
            self._ended.popitem(last=False)
