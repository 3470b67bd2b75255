"""A fake NIXL agent for the worker's unit tests (as vLLM's FakeNixlWrapper).

:class:`FakeNixlAgent` implements the subset of ``nixl._api.nixl_agent`` that
:mod:`kvsidecar.daemon.transport` calls, in-process: agents of one
:class:`FakeFabric` find each other by name, a READ copies bytes between
host buffers (``ctypes.memmove``) once it ends, and notifications go to the
remote agent's inbox when the reader observes its transfer DONE (lazily, as
NIXL does). What transfers do is scripted (:class:`Xfer`: how many polls
until they end, in which state, which call raises), and so are failures of
agent creation, notifications and calls (:attr:`FakeFabric.raise_in`).

Metadata is NIXL's serdes prefix and the agent name (so
``peek_agent_name`` reads it), then the registered regions as JSON: a peer's
regions are those of the metadata loaded, as in NIXL.
"""

from __future__ import annotations

import ctypes
import json
import struct
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_MD_PREFIX = b"nixlSerDes|Agent"


class nixlNotFoundError(Exception):  # NIXL's own name: errors.wrap hints by it
    pass


class nixlInvalidParamError(Exception):
    pass


class nixlBackendError(Exception):
    pass


@dataclass
class Xfer:
    """What one transfer does: ``polls`` checks answer PROC before it ends in
    ``end`` (0: it ends inside ``transfer()``; None: never); ``raise_in``
    names a call on it that raises (``initialize_xfer``, ``transfer``,
    ``check_xfer_state``, ``release_xfer_handle``)."""

    polls: int | None = 0
    end: str = "DONE"
    raise_in: str = ""


@dataclass
class Descs:
    rows: list[tuple[int, int, int]]
    mem_type: str
    reg: bool = False


@dataclass
class Handle:
    agent: FakeNixlAgent
    local: Descs
    remote: Descs
    peer: str
    notif: bytes
    xfer: Xfer
    state: str = "INIT"
    polls_left: int | None = 0
    released: bool = False


@dataclass
class Telemetry:
    totalBytes: int  # NIXL's field names
    postDuration: float
    xferDuration: float


@dataclass
class FakeFabric:
    """The fake agents of one test and the script of what happens next.

    Pass :meth:`factory` as the worker's ``agent_factory``."""

    #: behaviour of the next transfers, in order; then ``default``
    script: deque[Xfer] = field(default_factory=deque)
    default: Xfer = field(default_factory=Xfer)
    #: the next this many agent creations fail
    fail_creates: int = 0
    #: call name -> how many of the next calls (on any agent) raise
    raise_in: dict[str, int] = field(default_factory=dict)
    #: every agent name made, in order
    created: list[str] = field(default_factory=list)
    #: every initialize_xfer: (agent, peer, descriptors, notif)
    posted: list[tuple[str, str, int, bytes]] = field(default_factory=list)
    agents: weakref.WeakValueDictionary[str, FakeNixlAgent] = field(
        default_factory=weakref.WeakValueDictionary)

    def factory(self, name: str) -> FakeNixlAgent:
        self._maybe_raise("create", RuntimeError(
            "Failed to create UCX context: No such device (fake)"))
        agent = FakeNixlAgent(name, self)
        self.created.append(name)
        self.agents[name] = agent
        return agent

    def next_xfer(self) -> Xfer:
        return self.script.popleft() if self.script else self.default

    def alive(self, name: str) -> bool:
        """Whether the agent ``name`` still exists (the worker holds it)."""
        return self.agents.get(name) is not None

    def _maybe_raise(self, call: str, exc: BaseException) -> None:
        if call == "create" and self.fail_creates:
            self.fail_creates -= 1
            raise exc
        left = self.raise_in.get(call, 0)
        if left:
            self.raise_in[call] = left - 1
            raise exc


def _rows(arr: Any) -> list[tuple[int, int, int]]:
    return [(int(a), int(n), int(d)) for a, n, d in np.asarray(arr, dtype=np.int64)]


def _inside(addr: int, n: int, regions: list[tuple[int, int, int]]) -> bool:
    return any(a <= addr and addr + n <= a + ln for a, ln, _ in regions)


class FakeNixlAgent:
    """The calls of ``nixl_agent`` the worker makes (host memory only)."""

    def __init__(self, name: str, fabric: FakeFabric) -> None:
        self.name = name
        self.fabric = fabric
        self.regs: list[Descs] = []
        self.remotes: dict[str, list[tuple[int, int, int]]] = {}
        self.inbox: dict[str, list[bytes]] = {}
        self.progressed = 0
        self.deregistered = 0

    # -- registrations and metadata -----------------------------------------------------------

    def get_reg_descs(self, arr: Any, mem_type: str) -> Descs:
        return Descs(_rows(arr), mem_type, reg=True)

    def register_memory(self, descs: Descs) -> Descs:
        self.fabric._maybe_raise("register_memory", nixlBackendError("registration failed"))
        self.regs.append(descs)
        return descs

    def deregister_memory(self, descs: Descs) -> None:
        self.fabric._maybe_raise("deregister_memory", nixlBackendError("deregister failed"))
        self.regs.remove(descs)
        self.deregistered += 1

    def _regions(self) -> list[tuple[int, int, int]]:
        return [row for d in self.regs for row in d.rows]

    def get_agent_metadata(self) -> bytes:
        name = self.name.encode()
        return (_MD_PREFIX + struct.pack("<Q", len(name)) + name
                + json.dumps(self._regions()).encode())

    def add_remote_agent(self, metadata: bytes) -> bytes:
        if not metadata.startswith(_MD_PREFIX):
            raise nixlInvalidParamError("metadata could not be parsed")
        (n,) = struct.unpack_from("<Q", metadata, len(_MD_PREFIX))
        start = len(_MD_PREFIX) + 8
        name = metadata[start:start + n].decode()
        regions = [tuple(r) for r in json.loads(metadata[start + n:])]
        # NIXL merges the regions of a name loaded again
        self.remotes[name] = self.remotes.get(name, []) + regions  # type: ignore[operator]
        return name.encode()

    def remove_remote_agent(self, agent: str) -> None:
        if agent not in self.remotes:
            raise nixlNotFoundError(f"unknown agent {agent}")
        del self.remotes[agent]

    # -- transfers ------------------------------------------------------------------------------

    def get_xfer_descs(self, arr: Any, mem_type: str) -> Descs:
        return Descs(_rows(arr), mem_type)

    def initialize_xfer(self, op: str, local: Descs, remote: Descs, peer: str,
                        notif: bytes = b"") -> Handle:
        assert op == "READ"
        xfer = self.fabric.next_xfer()
        self.fabric.posted.append((self.name, peer, len(local.rows), bytes(notif)))
        if xfer.raise_in == "initialize_xfer":
            raise nixlBackendError("initialize_xfer failed (fake)")
        if peer not in self.remotes:
            raise nixlNotFoundError(f"unknown agent {peer}")
        if len(local.rows) != len(remote.rows) or any(
                a[1] != b[1] for a, b in zip(local.rows, remote.rows)):
            raise nixlInvalidParamError("descriptor lists differ")
        mine, theirs = self._regions(), self.remotes[peer]
        if not all(_inside(a, n, mine) for a, n, _ in local.rows) or not all(
                _inside(a, n, theirs) for a, n, _ in remote.rows):
            raise nixlNotFoundError("address outside every registered region")
        return Handle(self, local, remote, peer, bytes(notif), xfer, polls_left=xfer.polls)

    def transfer(self, handle: Handle) -> str:
        if handle.xfer.raise_in == "transfer":
            raise nixlBackendError("transfer failed (fake)")
        handle.state = "PROC"
        return self._advance(handle)

    def check_xfer_state(self, handle: Handle) -> str:
        if handle.xfer.raise_in == "check_xfer_state":
            raise nixlBackendError("check_xfer_state failed (fake)")
        if handle.state == "PROC" and handle.polls_left is not None:
            handle.polls_left -= 1
        return self._advance(handle)

    def _advance(self, handle: Handle) -> str:
        if handle.state != "PROC" or handle.polls_left is None or handle.polls_left > 0:
            return handle.state
        handle.state = handle.xfer.end
        if handle.state == "DONE":
            for (dst, n, _), (src, _, _) in zip(handle.local.rows, handle.remote.rows):
                ctypes.memmove(dst, src, n)
            peer = self.fabric.agents.get(handle.peer)
            if handle.notif and peer is not None:
                peer.inbox.setdefault(self.name, []).append(handle.notif)
        return handle.state

    def release_xfer_handle(self, handle: Handle) -> None:
        if handle.xfer.raise_in == "release_xfer_handle":
            raise nixlBackendError("cannot cancel the transfer (fake)")
        handle.released = True
        if handle.state == "PROC":
            handle.state = "CANCELLED"  # NIXL cancels what it can; no byte lands after

    def get_xfer_telemetry(self, handle: Handle) -> Telemetry:
        return Telemetry(sum(n for _, n, _ in handle.local.rows), 1.0, 2.0)

    # -- notifications --------------------------------------------------------------------------

    def send_notif(self, agent: str, message: bytes) -> None:
        self.fabric._maybe_raise("send_notif", nixlBackendError("send_notif failed (fake)"))
        if agent not in self.remotes:
            raise nixlNotFoundError(f"unknown agent {agent}")
        peer = self.fabric.agents.get(agent)
        if peer is not None:
            peer.inbox.setdefault(self.name, []).append(bytes(message))

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        self.progressed += 1
        self.fabric._maybe_raise("get_new_notifs", nixlBackendError("progress failed (fake)"))
        got, self.inbox = self.inbox, {}
        return got
