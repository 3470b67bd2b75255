"""What both engine clients share (ipc/client_core.py): the poll acknowledgements,
a parked poll's answer, the holds checked before they are sent. Pure, no socket."""

from __future__ import annotations

import pytest

from kvsidecar.ipc.client_core import PARK_S, ClientCore, HoldSpec
from kvsidecar.ipc.errors import BadMessage, SidecarTimeout, UnknownEngine
from kvsidecar.ipc.protocol import (
    UNKNOWN_ENGINE,
    Completion,
    Completions,
    Error,
    decode_request,
    encode_request,
)


def test_a_completion_two_polls_returned_is_reported_once() -> None:
    """A parked poll's answer and a blocking poll's can both hold completions
    not acknowledged yet: each is returned by the first and dropped after."""
    core = ClientCore("/nowhere", 1.0)
    a, b, c = (Completion(r, "received") for r in "abc")
    assert core.polled("d0", Completions([a, b], last=2, epoch="e1")) == [a, b]
    assert core.polled("d0", Completions([a, b, c], last=3, epoch="e1")) == [c]
    assert core.polled("d0", Completions([b, c], last=3, epoch="e1")) == []
    assert core.polled("d0", Completions([], last=3, epoch="e1")) == []
    assert core.acks["d0"] == ("e1", 3)
    assert core.polled("d0", Completions([a, b], last=2, epoch="e1")) == []  # a late one
    assert core.acks["d0"] == ("e1", 3)  # never acknowledged back
    # another registration (a restarted sidecar): its numbers start again
    assert core.polled("d0", Completions([a], last=1, epoch="e2")) == [a]
    # unnumbered (a sidecar that does not acknowledge): every reply is new
    assert core.polled("d1", Completions([a])) == [a]
    assert core.polled("d1", Completions([a])) == [a]
    park = core.park("d0")
    assert (park.engine_id, park.ack, park.epoch, park.wait_s) == ("d0", 1, "e2", PARK_S)


def test_an_older_polls_answer_of_another_registration_is_stale() -> None:
    """A poll parked for the engine's first registration (E1) answered after a
    newer poll's answer of the next (E2) was taken: returned nothing, and the
    acknowledgement stays E2's (else the next poll would take every E2
    completion again)."""
    core = ClientCore("/nowhere", 1.0)
    a, h = Completion("a", "received"), Completion("h", "expired")
    assert core.polled("d0", Completions([a], last=1, epoch="e1", id=4)) == [a]
    assert core.polled("d0", Completions([h], last=1, epoch="e2", id=9)) == [h]
    assert core.polled("d0", Completions([a], last=1, epoch="e1", id=7)) == []
    assert core.acks["d0"] == ("e2", 1)
    assert core.polled("d0", Completions([h], last=1, epoch="e2", id=11)) == []
    assert core.polled("d0", Completions([a], last=1, epoch="e3", id=12)) == [a]


def test_a_parked_polls_answer_is_taken_once_and_its_silence_said_once() -> None:
    core = ClientCore("/nowhere", 1.0)
    core.posted.add(core.park("d0"), b"poll", 10.0)
    assert core.pushed("d0", 10.0 + PARK_S + 1.0) == []  # its time, not past it
    with pytest.raises(SidecarTimeout, match="no answer to a poll parked"):
        core.pushed("d0", 10.1 + PARK_S + 1.0)
    assert core.pushed("d0", 99.0) == []  # forgotten: the next call parks again
    park = core.park("d0")
    core.posted.add(park, b"poll", 100.0)
    a = Completion("a", "received")
    assert core.posted.answered(park.id, Completions([a], last=1, epoch="e1", id=park.id))
    assert core.pushed("d0", 200.0) == [a] and core.pushed("d0", 200.0) == []
    park = core.park("d0")
    core.posted.add(park, b"poll", 300.0)
    core.posted.answered(park.id, Error(UNKNOWN_ENGINE, "engine 'd0' is not registered here"))
    with pytest.raises(UnknownEngine, match="not registered"):
        core.pushed("d0", 300.0)


def test_a_checked_hold_goes_out_as_its_check_encoded_it_once() -> None:
    """The bytes the decode check made are the bytes sent (no second encode),
    once; a batch of holds is checked whole and its error names the item."""
    core = ClientCore("/nowhere", 1.0)
    hold = core.hold_request("d0", "h1", [[0, 1]], 1, None)
    data = core.encode(hold)
    assert decode_request(data) == hold
    again = core.encode(hold)
    assert again == data and again is not data  # encoded anew: the check's are spent
    batch = core.batch_request(core.hold_items("d0", [HoldSpec("a", [[0]]),
                                                      HoldSpec("b", [[1]])]))
    assert core.encode(batch) == encode_request(batch)
    with pytest.raises(BadMessage, match=r"the batch's hold 'b'.*readers"):
        core.batch_request(core.hold_items("d0", [HoldSpec("a", [[0]]),
                                                  HoldSpec("b", [[1]], readers=0)]))
    with pytest.raises(BadMessage, match="hold 'h2'"):
        core.hold_request("d0", "h2", [[0]], 1, 1e9)
