"""Label values to a series key, for the loop-owned collectors
(:mod:`~kvsidecar.metrics.loop_histogram`, :mod:`~kvsidecar.metrics.loop_counter`):
``labels()`` takes what ``prometheus_client``'s does, and refuses what it refuses
with a ``ValueError`` that names the metric."""

from __future__ import annotations

from collections.abc import Sequence


def label_key(metric: str, labelnames: Sequence[str], values: Sequence[str],
              named: dict[str, str]) -> tuple[str, ...]:
    """The series key of ``labels(*values, **named)`` on ``metric``: all label
    values, positional or all named (exactly the metric's label names)."""
    if named:
        if values:
            raise ValueError(f"{metric}: label values positional or named, not both")
        if set(named) != set(labelnames):
            raise ValueError(f"{metric}: label names {sorted(named)}, expected "
                             f"{sorted(labelnames)}")
        values = [named[n] for n in labelnames]
    if len(values) != len(labelnames):
        raise ValueError(f"{metric}: {len(labelnames)} label values expected, "
                         f"got {len(values)}")
    return tuple(str(v) for v in values)
