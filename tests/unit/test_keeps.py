"""Which P ranks each D rank keeps (daemon/keeps.py): every P rank by exactly one D
rank; a Keep's checks and the bounds on its claims."""

from __future__ import annotations

import pytest

from kvsidecar.daemon.keeps import (
    MAX_KEEP_CLAIMS_PER_MESSAGE,
    KeepBook,
    check_items,
    ranks_kept,
)
from kvsidecar.ipc.protocol import (
    BAD_REQUEST,
    UNAVAILABLE,
    KeepItem,
    RemoteEngine,
    RequestError,
)


@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4), (8, 8), (3, 8)])
def test_every_p_rank_is_kept_by_exactly_one_d_rank(p_tp: int, d_tp: int) -> None:
    kept = [p for d in range(d_tp) for p in ranks_kept(p_tp, d_tp, d)]
    assert sorted(kept) == list(range(p_tp))


def test_a_wider_d_leaves_some_ranks_nothing_to_keep() -> None:
    assert [list(ranks_kept(1, 2, d)) for d in range(2)] == [[0], []]
    assert [list(ranks_kept(4, 2, d)) for d in range(2)] == [[0, 2], [1, 3]]


def _items(n: int, p_tp: int, addresses: int | None = None,
           tokens: int = 0) -> list[KeepItem]:
    remote = RemoteEngine("p", p_tp, ["127.0.0.1:9"] * (p_tp if addresses is None
                                                        else addresses))
    return [KeepItem(remote, f"r{i}", ["t"] * tokens) for i in range(n)]


def test_a_keep_is_checked_as_a_read_and_bounded_per_message() -> None:
    assert check_items(_items(256, 16), 0, 1) == MAX_KEEP_CLAIMS_PER_MESSAGE
    assert check_items(_items(256, 16), 1, 2) == MAX_KEEP_CLAIMS_PER_MESSAGE // 2
    with pytest.raises(RequestError, match="over 4096 per message") as e:
        check_items(_items(256, 512), 0, 1)  # the audit's flood: 131,072 claims
    assert e.value.code == BAD_REQUEST
    with pytest.raises(RequestError, match="tp_size 512 but 1 handshake addresses"):
        check_items(_items(1, 512, addresses=1), 0, 1)
    with pytest.raises(RequestError, match="5 hold tokens"):
        check_items(_items(1, 4, tokens=5), 0, 1)


def test_keep_claims_in_flight_are_bounded_per_engine_and_in_all() -> None:
    refused: list[str] = []
    book = KeepBook(per_engine=10, total=15, on_refused=refused.append)
    book.admit("a", 10)
    with pytest.raises(RequestError, match="'a' has 10 keep claims in flight") as e:
        book.admit("a", 1)
    assert e.value.code == UNAVAILABLE
    book.admit("b", 5)
    with pytest.raises(RequestError, match="this sidecar has 15 keep claims in flight"):
        book.admit("c", 1)
    assert refused == ["a", "c"]  # counted (limit_refusals{limit="keep_claims"})
    book.done("a", 10)
    assert (book.of("a"), book.total) == (0, 5)
    book.admit("c", 10)
