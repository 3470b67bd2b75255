"""DrainBook: which generations drain and when their memory may be freed (pure)."""

from __future__ import annotations

from kvsidecar.daemon.drain import DrainBook, keepable


def test_keepable_memory_is_what_the_sidecar_holds_valid() -> None:
    assert keepable(True, frozenset())  # allocated by the sidecar
    assert keepable(False, frozenset({"shm"}))  # its own mapping outlives the engine
    assert keepable(False, frozenset({"reserved"}))
    assert not keepable(False, frozenset({"cuda_ipc"}))  # freed with its process
    assert not keepable(False, frozenset({"shm", "cuda_ipc"}))
    assert not keepable(False, frozenset())


def test_memory_is_freed_once_reads_are_over_and_the_last_hold_ended() -> None:
    book: DrainBook[str] = DrainBook()
    g = book.start("e", "rank", "engine gone", 4096, now=10.0)
    assert len(book) == 1 and book.nbytes == 4096
    assert not book.may_free(g, 0)  # its own reads may still write into it
    g.quiet = True
    assert not book.may_free(g, 2)  # holds open
    book.ended(g, "sent")
    assert not book.may_free(g, 1)
    book.ended(g, "expired")
    assert book.may_free(g, 0)
    assert not book.may_free(g, 0)  # exactly once
    assert "sent 1, expired 1" in g.summary(now=12.5) and "2.5 s" in g.summary(now=12.5)
    book.finish(g)
    assert len(book) == 0 and book.nbytes == 0
    assert not book.may_free(g, 0)


def test_generations_of_one_engine_newest_first() -> None:
    book: DrainBook[str] = DrainBook()
    a = book.start("e", "old", "gone", 1, now=0.0)
    book.start("other", "x", "gone", 1, now=0.0)
    b = book.start("e", "newer", "gone", 1, now=1.0)
    assert [g.rank for g in book.of_engine("e")] == ["newer", "old"]
    assert a.number < b.number
    book.finish(a)
    assert [g.rank for g in book.of_engine("e")] == ["newer"]
