"""D side: from "rank p of remote engine E at host:port" to a NIXL agent we can read from.

One link per (local engine rank, remote address, remote engine, remote rank):
fetch the handshake (shared and cached by :class:`HandshakeClient`), check
the peer against what the engine was told and against our layout, then load
its agent metadata into the local engine's NIXL worker. Concurrent requests
to a new peer share one link task; a failed link is forgotten so the next
request retries instead of inheriting the failure.

Peers restart: a P engine re-registers (new NIXL agent) or its sidecar
restarts on the same address (new ``daemon_id``, new agent). A cached
handshake then describes an agent that no longer exists, and loading it
fails. Any failure to link therefore evicts the cached handshake and fetches
once more; if the peer now answers with another daemon id, agent name or
metadata, that fresh answer is linked. Links that are dropped unload their
remote agent once no read holds a link to it (a read may still notify its P
rank through lane 0 after its transfers ended), retried while NIXL still has
transfers over it in flight.

Lanes (``--post-lanes``): an engine rank may post on several NIXL agents, one
per worker thread. A link loads the remote agent into every lane and records
each lane's agent generation (:attr:`Peer.generations`); a read posted on lane
``k`` carries ``generations[k]``, so a lane reset since the link fails that
post before anything is posted (:class:`NixlAgentReset`). Any lane's reset
drops every link of the engine rank (the owner calls :meth:`PeerLinks.reset`,
as for lane 0): links are few and cheap to make again, and one rule for all
lanes keeps "a link is loaded in every current lane" true without per-lane
link state. Only lane 0's agent is declared to peers (the handshake's reader).

Bounded: at most ``max_links`` links per local engine rank (each is a remote
agent loaded into NIXL). A new link first evicts the least recently used
links that no read holds (counted); when every link is held by a read or
still being made (a read may be waiting for it), the new one is refused with
:class:`PeerLinkLimit` naming the flag.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvsidecar.daemon.peers.client import HandshakeClient
from kvsidecar.daemon.peers.messages import (
    OFF_LOOP_NUMBERS,
    HandshakeFailed,
    HandshakeInfo,
    Reader,
    accept_peer,
    check_peer,
    checks_cost,
)
from kvsidecar.daemon.transport.errors import NixlAgentReset
from kvsidecar.daemon.transport.worker import NixlWorker
from kvsidecar.ipc.layout import (
    Fingerprinted,
    Layout,
    as_fingerprinted,
)

Key = tuple[str, str, int]  # (address, remote engine id, remote rank)

log = logging.getLogger(__name__)

_UNLOAD_RETRY_S = 1.0
_UNLOAD_TRIES = 300  # reads end within --read-timeout; this outlasts any sane one
_LINK_TRIES = 3


def same_peer(a: HandshakeInfo, b: HandshakeInfo) -> bool:
    """Whether two handshake answers describe the same live agent (nothing restarted)."""
    return (a.daemon_id == b.daemon_id and a.agent_name == b.agent_name
            and a.agent_metadata == b.agent_metadata)


@dataclass(frozen=True, eq=False)
class Peer:
    """One linked remote rank; compared by identity (a re-link is a new Peer)."""

    key: Key
    info: HandshakeInfo
    agent: str
    bases: NDArray[np.int64]
    made_at: float
    #: the local agent generation this link was loaded into (see NixlWorker reset)
    generation: int = 0
    #: the generation of each lane's agent it was loaded into (lane 0's is ``generation``)
    generations: tuple[int, ...] = ()

    def generation_of(self, lane: int) -> int:
        """The generation of lane ``lane``'s agent this link was loaded into."""
        return self.generations[lane] if self.generations else self.generation


class PeerLinkLimit(RuntimeError):
    """Every link of this engine rank is held by a read: no room for a new remote rank."""


class PeerLinks:
    """The remote ranks one local engine rank has linked to."""

    def __init__(self, worker: NixlWorker, layout: Layout | Fingerprinted,
                 client: HandshakeClient, *,
                 on_link: Callable[[bool], None] | None = None,
                 on_unload_failed: Callable[[], None] | None = None,
                 reader: tuple[str, int] | None = None,
                 readable: tuple[str, ...] = ("DRAM",),
                 max_links: int = 1024,
                 on_evict: Callable[[], None] | None = None,
                 on_refused: Callable[[], None] | None = None,
                 lanes: Sequence[NixlWorker] = ()) -> None:
        if max_links < 1:
            raise ValueError("max_links must be >= 1")
        self._worker = worker
        #: every worker a link is loaded into (lane 0 first: ``worker``)
        self._lanes = list(lanes) or [worker]
        if self._lanes[0] is not worker:
            raise ValueError("lane 0 must be the engine rank's worker")
        self.max_links = max_links
        #: told once per idle link evicted at the bound / per link refused at it (metrics)
        self._on_evict = on_evict
        self._on_refused = on_refused
        #: reads holding each link (see get(user=...) and release())
        self._users: dict[Key, int] = {}
        #: reads holding a link to each remote agent: its agent is not unloaded
        #: under them (a read may still notify through it, see _unload)
        self._agent_users: dict[str, int] = {}
        #: when P last granted a lease claimed over each link (this clock); a Peer
        #: that is forgotten or replaced drops out with its last reference
        self._confirmed: weakref.WeakKeyDictionary[Peer, float] = weakref.WeakKeyDictionary()
        #: memory types this sidecar can read from (VRAM only with a GPU of its own)
        self._readable = readable
        #: (engine id, rank) of the local engine rank: declared with the worker's
        #: agent name in every handshake, so peers accept its notifications
        self._reader = reader
        #: told once per remote agent that could not be unloaded (metrics)
        self._on_unload_failed = on_unload_failed
        #: told True/False once per link attempt (handshake + add_remote), for metrics
        self._on_link = on_link
        #: the local engine rank's layout with its fingerprint facts, built once per
        #: registration: each handshake compares a peer against them (check_peer)
        self._layout = as_fingerprinted(layout)
        self._client = client
        self._links: OrderedDict[Key, asyncio.Task[Peer]] = OrderedDict()  # LRU first
        #: reads awaiting each link being made (the last to give up cancels it)
        self._waiting: dict[Key, int] = {}
        self._unloading: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._links)

    async def get(self, address: str, engine_id: str, tp_size: int, rank: int,
                  user: list[Peer] | None = None) -> Peer:
        """The link to ``rank`` of ``engine_id`` at ``address``, made if needed.

        With ``user`` (a read's list of held links) the link is held for that
        read, so it is not evicted under it, until :meth:`release`. When every
        caller waiting for a link being made is cancelled, the link is cancelled
        too (and its handshake with it).
        """
        key = (address, engine_id, rank)
        task = self._links.get(key)
        if task is not None:
            self._links.move_to_end(key)
        if task is None or (task.done() and (task.cancelled() or task.exception())):
            if task is None:
                self._make_room()
            task = asyncio.ensure_future(self._link(address, engine_id, tp_size, rank))
            self._links[key] = task
            if self._on_link is not None:
                on_link = self._on_link
                task.add_done_callback(
                    lambda t: on_link(not t.cancelled() and t.exception() is None))
        self._waiting[key] = self._waiting.get(key, 0) + 1
        try:
            peer = await asyncio.shield(task)
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError) and self._waiting.get(key, 0) <= 1:
                # The last read waiting for this link gave up (it failed on another
                # link, or was aborted): nobody needs it, and its handshake holds a
                # peer connection other engines may need.
                task.cancel()
                if self._links.get(key) is task:
                    del self._links[key]
            if self._links.get(key) is task and task.done():
                del self._links[key]
            raise
        finally:
            left = self._waiting.get(key, 1) - 1
            if left > 0:
                self._waiting[key] = left
            else:
                self._waiting.pop(key, None)
        if peer.info.tp_size != tp_size:
            # Cached from a request that described the engine differently (refused
            # at the tp_size check, before anything that grows with the layout).
            check_peer(peer.info, engine_id, tp_size, self._layout, address=address,
                       readable=self._readable)
        if user is not None:
            self.hold([peer], user)
        return peer

    def linked(self) -> list[tuple[Peer, int]]:
        """Every link made and good, least recently used first, with the number
        of reads holding it."""
        return [(t.result(), self._users.get(key, 0)) for key, t in self._links.items()
                if t.done() and not t.cancelled() and t.exception() is None]

    def cached(self, address: str, engine_id: str, tp_size: int, rank: int) -> Peer | None:
        """The link :meth:`get` would return at once (made, good, same tp), or None.

        Lets a read over known links skip a task per link and a loop iteration
        (then :meth:`hold` them); anything else goes through :meth:`get`.
        """
        task = self._links.get((address, engine_id, rank))
        if task is None or not task.done() or task.cancelled() or task.exception():
            return None
        peer = task.result()
        return peer if peer.info.tp_size == tp_size else None

    def hold(self, peers: list[Peer], user: list[Peer]) -> None:
        """Hold links found by :meth:`cached` for a read, as :meth:`get` does."""
        for peer in peers:
            if peer.key in self._links:
                self._links.move_to_end(peer.key)
            self._users[peer.key] = self._users.get(peer.key, 0) + 1
            self._agent_users[peer.agent] = self._agent_users.get(peer.agent, 0) + 1
            user.append(peer)

    def confirm(self, peers: list[Peer], now: float) -> None:
        """P granted a lease over these links at ``now``: their agents were current then."""
        for peer in peers:
            self._confirmed[peer] = now

    def confirmed_within(self, peers: list[Peer], window_s: float, now: float) -> bool:
        """Whether P granted a lease over every one of these links in the last
        ``window_s`` seconds (a read may then post before its own claim returns)."""
        return all(now - self._confirmed.get(peer, -math.inf) <= window_s for peer in peers)

    def release(self, peers: list[Peer]) -> None:
        """A read is done with these links (each once per get(user=...))."""
        for peer in peers:
            _drop_one(self._users, peer.key)
            _drop_one(self._agent_users, peer.agent)
        peers.clear()

    def _make_room(self) -> None:
        """Evict least recently used links no read holds until one more fits, or
        raise :class:`PeerLinkLimit` (counted) when every link is held."""
        while len(self._links) >= self.max_links:
            key = next((k for k, t in self._links.items()
                        if t.done() and not self._users.get(k)), None)
            if key is None:
                if self._on_refused is not None:
                    self._on_refused()
                raise PeerLinkLimit(
                    f"this engine rank already links to {len(self._links)} remote ranks, each "
                    f"in use by a read in flight or still being linked; the limit is "
                    f"{self.max_links} (--max-peer-links-per-engine)")
            task = self._links.pop(key)
            if self._on_evict is not None:
                self._on_evict()
            if not task.cancelled() and task.exception() is None:
                self._spawn_unload(task.result().agent, key)

    async def _link(self, address: str, engine_id: str, tp_size: int, rank: int) -> Peer:
        """Fetch and load, again if the local agent was reset meanwhile.

        The handshake declares the local agent by name (P accepts notifications
        only from the declared agent), and the remote agent is loaded into one
        generation of it: both must be the generation the link ends up in, or
        every read over it fails (or its notifications are refused). A reset
        between the two is rare (another read failed at that moment), so a few
        tries suffice; the last failure says so.
        """
        for _ in range(_LINK_TRIES):
            declared = self._generations()
            peer = await self._fetch_and_load(address, engine_id, tp_size, rank)
            if peer.generations == declared == self._generations():
                return peer
            log.info("link to %s engine %r rank %d: a local NIXL agent was reset while "
                     "linking (generations %s -> %s); linking again", address, engine_id,
                     rank, declared, peer.generations)
            self._client.forget(address, engine_id)  # re-declare the reader's new agent
        raise NixlAgentReset(f"link to {address} engine {engine_id!r} rank {rank}: the local "
                             f"NIXL agent was reset during each of {_LINK_TRIES} tries")

    def _generations(self) -> tuple[int, ...]:
        return tuple(w.generation for w in self._lanes)

    async def _fetch_and_load(self, address: str, engine_id: str, tp_size: int,
                              rank: int) -> Peer:
        reader = (None if self._reader is None
                  else Reader(self._reader[0], self._reader[1], self._worker.agent_name))
        info = await self._client.fetch(address, engine_id, rank, reader)
        try:
            return await self._load(address, engine_id, tp_size, rank, info)
        except Exception as first:
            # The answer may be cached from before the peer restarted or re-registered:
            # never keep it after a failure, and ask once more.
            self._client.forget(address, engine_id)
            fresh = await self._client.fetch(address, engine_id, rank, reader)
            if same_peer(fresh, info):
                raise
            log.info("link to %s engine %r rank %d failed (%s); the peer restarted or "
                     "re-registered (daemon %s -> %s, agent %r -> %r): linking the fresh one",
                     address, engine_id, rank, first, info.daemon_id, fresh.daemon_id,
                     info.agent_name, fresh.agent_name)
            try:
                return await self._load(address, engine_id, tp_size, rank, fresh)
            except Exception:
                self._client.forget(address, engine_id)
                raise

    async def _load(self, address: str, engine_id: str, tp_size: int, rank: int,
                    info: HandshakeInfo) -> Peer:
        check = functools.partial(accept_peer, info, engine_id, tp_size, self._layout,
                                  address=address, readable=self._readable)
        if checks_cost(info) > OFF_LOOP_NUMBERS:  # a big layout: its checks on a thread
            bases = await asyncio.get_running_loop().run_in_executor(None, check)
        else:
            bases = check()
        agent, generation = await self._worker.add_remote_at(info.agent_metadata)
        gens = [generation]
        try:
            for lane in self._lanes[1:]:
                name, gen = await lane.add_remote_at(info.agent_metadata)
                if name != agent:  # one metadata, one name: NIXL would have to change
                    raise HandshakeFailed(address, f"remote agent loaded as {agent!r} and "
                                                   f"{name!r} in two lanes")
                gens.append(gen)
        except Exception:
            # Unload it from the lanes it reached before this link tries again (a
            # retry's loads queue behind these removals); NIXL refuses while a read
            # of an older link to the same agent is in flight: it stays loaded then.
            for lane in self._lanes[:len(gens)]:
                with contextlib.suppress(Exception):
                    await lane.remove_remote_soon(agent)
            raise
        return Peer((address, engine_id, rank), info, agent, bases, time.monotonic(),
                    generation, tuple(gens))

    def reset(self) -> list[Key]:
        """Drop every link: a local agent (a lane) was destroyed and created again,
        so a remote agent is loaded in no lane any more, or not in every lane.
        Returns the keys dropped. With several lanes the dropped links' agents
        are unloaded from the lanes that still have them (as a forgotten link's
        are), unless a new link to the same rank uses the agent again."""
        keys = list(self._links)
        if len(self._lanes) > 1:
            for key, task in self._links.items():
                if task.done() and not task.cancelled() and task.exception() is None:
                    self._spawn_unload(task.result().agent, key)
        self._links.clear()
        return keys

    def forget(self, peer: Peer) -> None:
        """Drop this link (its peer restarted or failed) and unload its agent.

        Only if the cached link is still this very Peer: a concurrent read may
        already have replaced it with a fresh one, which must survive.
        """
        task = self._links.get(peer.key)
        if (task is not None and task.done() and not task.cancelled()
                and task.exception() is None and task.result() is peer):
            del self._links[peer.key]
        self._spawn_unload(peer.agent, peer.key)

    def _spawn_unload(self, agent: str, key: Key) -> None:
        unload = asyncio.ensure_future(self._unload(agent, key))
        self._unloading.add(unload)
        unload.add_done_callback(self._unloading.discard)

    def _relinked(self, agent: str, key: Key) -> bool:
        """Whether a newer link to the same rank uses (or may load) this agent again:
        loading identical metadata is a no-op, so unloading would break it."""
        task = self._links.get(key)
        if task is None:
            return False
        if not task.done():
            return True
        return not task.cancelled() and task.exception() is None and task.result().agent == agent

    async def _unload(self, agent: str, key: Key) -> None:
        """Remove the remote agent from every lane once no read uses it there (NIXL
        refuses while one does)."""
        last: Exception | None = None
        left = list(self._lanes)
        for _ in range(_UNLOAD_TRIES):
            left = [w for w in left if w.running]  # a stopped lane's remotes went with it
            if not left or self._relinked(agent, key):
                return
            if self._agent_users.get(agent):
                # A read over it is not done: it may still notify its P rank
                # through lane 0 (a read on lanes or posted during its claim
                # notifies after its transfers ended), and lane 0 is idle for
                # that agent meanwhile, so NIXL would let it go. Seen: a reset
                # of lane 2 unloaded lane 0's agents under a read whose lane-1
                # transfer was still running; its notifications then failed.
                await asyncio.sleep(_UNLOAD_RETRY_S)
                continue
            # Queued on every lane in this step, right after the check above: a
            # new link loading the same agent queues its loads after these.
            queued: list[tuple[NixlWorker, asyncio.Future[None]]] = []
            for w in left:
                try:
                    queued.append((w, w.remove_remote_soon(agent)))
                except Exception as e:  # stopped meanwhile: its remotes went with it
                    last = e
            left = []
            for w, removed in queued:
                try:
                    await removed
                except Exception as e:
                    last = e
                    left.append(w)
            if not left:
                return
            await asyncio.sleep(_UNLOAD_RETRY_S)
        log.warning("remote agent %r could not be unloaded: %s", agent, last)
        if self._on_unload_failed is not None:
            self._on_unload_failed()


def _drop_one(counts: dict[Any, int], key: Any) -> None:
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)
