"""Which keys were added within a horizon, in bounded memory: a rotating Bloom filter.

:class:`RecentKeys` answers :meth:`~RecentKeys.may_contain`: ``False`` means
the key was not added within the last ``horizon_s`` (exact); ``True`` means it
may have been (a false positive about ``0.15 %`` of the time for each slice
checked, up to ``slices``, while each holds at most its capacity). Memory is
fixed: ``slices`` bit arrays of ``capacity * BITS_PER_KEY`` bits, allocated
as the keys come. The horizon may only widen (:meth:`RecentKeys.widen`).

Time is cut in slices of ``horizon_s / (slices - 1)``; a key goes into the
newest slice, and the oldest slice is dropped only once every key in it is
older than the horizon. A slice that fills up before its time ends is closed
early; if that forces out a slice whose keys are still within the horizon,
the set is *saturated* until they would have aged out: every key may be in
it then (:attr:`RecentKeys.saturated_until`, :attr:`RecentKeys.overflows`).
So the answer errs only towards ``True``, which is what a caller refusing
what may have happened needs.

Pure: no I/O, the clock is passed in.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

__all__ = ["RecentKeys"]

BITS_PER_KEY = 14
"""Bits per key at capacity: with :data:`HASHES` hashes, about a 0.15 % false-positive
rate per slice."""
HASHES = 7


@dataclass
class _Slice:
    started: float
    last_added: float
    bits: bytearray
    count: int = 0


class RecentKeys:
    """Keys (bytes) added within the last ``horizon_s`` seconds (see the module)."""

    def __init__(self, horizon_s: float, *, capacity: int = 1 << 18, slices: int = 4) -> None:
        if horizon_s <= 0 or capacity < 1 or slices < 2:
            raise ValueError("RecentKeys needs horizon_s > 0, capacity >= 1 and slices >= 2")
        self.horizon_s = horizon_s
        self.capacity = capacity
        self.slices = slices
        self._span_s = horizon_s / (slices - 1)
        self._nbits = capacity * BITS_PER_KEY
        self._slices: list[_Slice] = []
        #: until when every key may be in the set (a slice was dropped too early)
        self.saturated_until = -math.inf
        #: how many slices were dropped while their keys were within the horizon
        self.overflows = 0

    def widen(self, horizon_s: float) -> None:
        """Remember keys for ``horizon_s`` from now on (a longer horizon only)."""
        if horizon_s > self.horizon_s:
            self.horizon_s = horizon_s
            self._span_s = horizon_s / (self.slices - 1)

    def _positions(self, key: bytes) -> list[int]:
        h = hashlib.blake2b(key, digest_size=16).digest()
        a = int.from_bytes(h[:8], "little")
        b = int.from_bytes(h[8:], "little") | 1
        n = self._nbits
        return [(a + i * b) % n for i in range(HASHES)]

    def add(self, key: bytes, now: float) -> None:
        """Remember ``key`` as added at ``now``."""
        cur = self._slices[-1] if self._slices else None
        if cur is None or now - cur.started >= self._span_s or cur.count >= self.capacity:
            cur = _Slice(now, now, bytearray(self._nbits // 8 + 1))
            self._slices.append(cur)
            while len(self._slices) > self.slices:
                old = self._slices.pop(0)
                if now - old.last_added < self.horizon_s:
                    self.overflows += 1
                    self.saturated_until = max(self.saturated_until,
                                               old.last_added + self.horizon_s)
        bits = cur.bits
        for p in self._positions(key):
            bits[p >> 3] |= 1 << (p & 7)
        cur.count += 1
        cur.last_added = now

    def may_contain(self, key: bytes, now: float) -> bool:
        """Whether ``key`` may have been added within the horizon before ``now``
        (False: it was not)."""
        if now < self.saturated_until:
            return True
        live = [s for s in self._slices if now - s.last_added < self.horizon_s]
        if not live:
            return False
        positions = self._positions(key)
        return any(all(s.bits[p >> 3] & (1 << (p & 7)) for p in positions) for s in live)

    def saturated(self, now: float) -> bool:
        """Whether every key counts as possibly added (a slice was dropped early)."""
        return now < self.saturated_until
