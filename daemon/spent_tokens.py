"""Which hold tokens this sidecar's reads have presented already (D side).

A read posts during its claim only with tokens no earlier read on this sidecar
presented: a token presented again (a replay, or a second reader of the same
hold) waits for P's grant before anything is posted, so a hold that ended
since cannot be read through a recently confirmed link. Bounded: at most
``max_entries`` tokens, each forgotten at its expiry or when the oldest make
room (a forgotten token only loses its "seen" mark: it is checked as ever).
Pure and clock-injected, like :class:`~kvsidecar.daemon.holds.HoldBook`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvsidecar.ipc import hold_token

__all__ = ["SpentTokens"]


class SpentTokens:
    def __init__(self, max_entries: int = 65536) -> None:
        self.max_entries = max_entries
        self._seen: OrderedDict[str, float] = OrderedDict()  # token -> its expiry (Unix s)
        self.forgotten = 0
        """Tokens dropped for room before they expired."""

    def __len__(self) -> int:
        return len(self._seen)

    def first_use(self, tokens: Sequence[str], now: float) -> bool:
        """Record ``tokens``; True when none of them was presented before."""
        while self._seen:
            token, expires = next(iter(self._seen.items()))
            if expires > now:
                break
            del self._seen[token]
        fresh = True
        for t in tokens:
            if t in self._seen:
                fresh = False
                continue
            try:
                expires = hold_token.parse(t).expires
            except hold_token.TokenError:
                continue  # refused by the check anyway
            self._seen[t] = float(expires)
            if len(self._seen) > self.max_entries:
                self._seen.popitem(last=False)
                self.forgotten += 1
        return fresh
