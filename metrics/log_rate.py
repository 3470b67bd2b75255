"""How often a repeated refusal is logged: metrics count every one, the log few."""

from __future__ import annotations


def worth_logging(count: int) -> bool:
    """Whether the ``count``-th refusal of one kind gets a log line: the first ten,
    then every thousandth, so a flood of bad connections cannot flood the log
    (the metrics count every one)."""
    return count <= 10 or count % 1000 == 0
