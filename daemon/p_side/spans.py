"""The tracing span of each open hold, from ``Hold`` to its completion.

Keyed by (engine id, request id); empty when tracing is off (every method
is then a dictionary miss).
"""

from __future__ import annotations

from typing import Any

from kvsidecar.daemon.tracing import Tracing
from kvsidecar.ipc.protocol import Completion


class HoldSpans:
    def __init__(self, tracing: Tracing) -> None:
        self.tracing = tracing
        self._spans: dict[tuple[str, str], Any] = {}

    def start(self, engine_id: str, request_id: str, rank: int, readers: int) -> None:
        """Open the hold's span (tracing on only)."""
        if self.tracing.enabled:
            self._spans[(engine_id, request_id)] = self.tracing.start(
                "kvsidecar.hold", request_id, engine=engine_id, rank=rank, readers=readers)

    def get(self, engine_id: str, request_id: str) -> Any:
        """The open span of a hold (None when none)."""
        return self._spans.get((engine_id, request_id))

    def end(self, engine_id: str, request_id: str, outcome: str) -> None:
        """Close the hold's span (if any) with its outcome."""
        self.tracing.end(self._spans.pop((engine_id, request_id), None), outcome=outcome)

    def completed(self, engine_id: str, c: Completion) -> None:
        """An engine rank's ``on_complete``: the completion ends the span."""
        self.end(engine_id, c.request_id, c.kind)
