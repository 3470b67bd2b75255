"""A layout's fingerprint is computed once per registration, never per handshake,
and comparing two layouts' facts does not grow with ``num_regions``.

Counted, not timed: the tests count the hashes (``hashlib.sha256`` in
:mod:`kvsidecar.ipc.layout`) and look at what the facts hold."""

from __future__ import annotations

import asyncio
import hashlib
import types
from typing import Any, cast

import msgspec
import pytest

from kvsidecar.daemon.peers.links import PeerLinks
from kvsidecar.daemon.peers.messages import (
    HandshakeFailed,
    HandshakeInfo,
    check_peer,
    make_handshake_info,
)
from kvsidecar.ipc import layout as layout_mod
from kvsidecar.ipc.layout import (
    MAX_REGIONS,
    AllRegions,
    IncompatibleLayout,
    Layout,
    attention_layout,
    check_compatible,
    fingerprint,
    fingerprint_fields,
    fingerprinted,
)

REGIONS = MAX_REGIONS  # 65,536: the most an engine may register


def _layout(num_layers: int = REGIONS, *, kv_separate: bool = False, heads: int = 2,
            tp_size: int = 1) -> Layout:
    return attention_layout(model="m", num_layers=num_layers, total_kv_heads=heads, head_dim=8,
                            block_tokens=4, tp_size=tp_size, num_blocks=2,
                            kv_separate=kv_separate)


def _old_fingerprint(layout: Layout) -> str:
    """The fingerprint as computed before AllRegions (the tuple of every region):
    what older sidecars send, so the value must not change."""
    fields = {k: (tuple(range(layout.num_regions)) if isinstance(v, AllRegions) else v)
              for k, v in fingerprint_fields(layout).items()}
    blob = msgspec.json.encode(sorted((k, repr(v)) for k, v in fields.items()))
    return hashlib.sha256(blob).hexdigest()[:16]


@pytest.mark.parametrize("kv_separate", [False, True])
@pytest.mark.parametrize("num_layers", [1, 7, 300])
def test_the_fingerprint_is_the_one_older_sidecars_compute(num_layers: int,
                                                           kv_separate: bool) -> None:
    lay = _layout(num_layers, kv_separate=kv_separate)
    assert fingerprint(lay) == _old_fingerprint(lay) == fingerprinted(lay).fingerprint


def test_facts_do_not_grow_with_num_regions() -> None:
    """A segment in every region is one AllRegions fact, not a 65,536-long tuple;
    it still equals a segment naming every region, and a layout of another size
    differs in it."""
    facts = fingerprint_fields(_layout())
    assert all(not isinstance(v, tuple) or len(v) <= 2 for v in facts.values()), facts
    every = facts["group[0].k.regions"]
    assert every == AllRegions(REGIONS) and every == tuple(range(REGIONS))
    assert every != AllRegions(REGIONS - 1) and every != tuple(range(1, REGIONS + 1))
    assert len(repr(every)) < 40  # error messages quote it
    with pytest.raises(IncompatibleLayout, match=r"model\.num_layers differs"):
        check_compatible(_layout(), _layout(REGIONS - 1))


class _Hashes:
    """Counts the hashes :mod:`kvsidecar.ipc.layout` computes (fingerprints)."""

    def __init__(self) -> None:
        self.count = 0

    def sha256(self, data: bytes) -> Any:
        self.count += 1
        return hashlib.sha256(data)


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch) -> _Hashes:
    counter = _Hashes()
    monkeypatch.setattr(layout_mod, "hashlib", types.SimpleNamespace(sha256=counter.sha256))
    return counter


class _Worker:
    """The NixlWorker calls a link makes: load a remote agent."""

    agent_name = "d-agent"
    generation = 0

    async def add_remote_at(self, metadata: bytes) -> tuple[str, int]:
        return metadata.decode(), 0

    def remove_remote_soon(self, agent: str) -> asyncio.Future[None]:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


class _Client:
    """The handshake answers of several P sidecars, each serving engine 'p'."""

    def __init__(self, infos: dict[str, HandshakeInfo]) -> None:
        self.infos = infos
        self.fetched = 0

    async def fetch(self, address: str, engine_id: str, rank: int, reader: Any) -> HandshakeInfo:
        self.fetched += 1
        return self.infos[address]

    def forget(self, address: str, engine_id: str) -> None:
        pass


def _info(address: str, layout: Layout) -> HandshakeInfo:
    region = layout.region_bytes
    return make_handshake_info(
        engine_id="p", tp_rank=0, agent_name=f"agent-{address}",
        agent_metadata=f"agent-{address}".encode(), layout=layout,
        bases=[(1 << 30) + r * region for r in range(layout.num_regions)],
        daemon_id=f"daemon-{address}")


async def test_a_handshake_hashes_no_fingerprint(hashes: _Hashes) -> None:
    """D's links to four P sidecars serving a model of 65,536 regions: the
    registration hashes its layout once; the four handshakes hash nothing (before:
    each hashed the peer's layout and its own again, two 65,536-region
    fingerprints per handshake on the event loop)."""
    addresses = [f"tcp://p{i}:1" for i in range(4)]
    infos = {a: _info(a, _layout()) for a in addresses}  # P's registrations
    client = _Client(infos)
    hashes.count = 0
    links = PeerLinks(cast(Any, _Worker()), _layout(), cast(Any, client))  # D's registration
    assert hashes.count == 1
    for a in addresses:
        peer = await links.get(a, "p", 1, 0)
        assert peer.agent == f"agent-{a}"
    assert client.fetched == 4 and len(links) == 4
    assert hashes.count == 1  # none per handshake


def test_a_peer_that_does_not_fit_is_still_told_apart(hashes: _Hashes) -> None:
    """Only a peer that does not fit has its layout hashed, to name what is wrong."""
    local = fingerprinted(_layout(8))
    good = _info("p", _layout(8))
    hashes.count = 0
    check_peer(good, "p", 1, local)
    assert hashes.count == 0
    lying = msgspec.structs.replace(good, fingerprint="0" * 16)
    with pytest.raises(HandshakeFailed, match="peer sent fingerprint 0000000000000000 but its "
                                              "layout hashes to"):
        check_peer(lying, "p", 1, local)
    with pytest.raises(IncompatibleLayout, match=r"model\.num_layers differs"):
        check_peer(_info("p", _layout(9)), "p", 1, local)
    # claims the local fingerprint, but holds another model: the facts catch it
    other = msgspec.structs.replace(_info("p", _layout(8, heads=4)), fingerprint=local.fingerprint)
    with pytest.raises(IncompatibleLayout, match=r"model\.total_kv_heads differs"):
        check_peer(other, "p", 1, local)
