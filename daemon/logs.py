"""Logging set-up: ours on stderr (text or one JSON object per line), NIXL's below ours.

stdout carries exactly one line, ``KVSIDECAR READY {...}``, for supervisors;
NIXL's Python logger ships its own stdout handler at INFO, so it is
re-routed through ours (stderr) and held at WARNING unless we run at DEBUG.
UCX's C-level logging is kept at ``warn`` unless the operator set
``UCX_LOG_LEVEL``.

Event lines carry their identifiers as ``extra`` fields (``request_id``,
``engine``, ``peer``, ``rank``); the JSON format emits them as keys, so a log
pipeline can join P and D lines of one request.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

#: ``extra=`` keys that become top-level JSON fields.
EVENT_FIELDS = ("request_id", "engine", "peer", "rank", "outcome", "reason")
LIBRARY_LOGGERS = ("nixl", "nixl_cu12", "nixl_cu13")
FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, plus event fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                  + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in EVENT_FIELDS:
            if hasattr(record, key):
                out[key] = getattr(record, key)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup(level: str = "INFO", fmt: str = "text") -> None:
    """Configure the root logger on stderr; call once, before importing NIXL."""
    os.environ.setdefault("UCX_LOG_LEVEL", "warn")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level, logging.INFO))
    quiet_libraries(level)


def quiet_libraries(level: str = "INFO") -> None:
    """Route NIXL's logger through the root handlers (stderr), below our level."""
    for name in LIBRARY_LOGGERS:
        lib = logging.getLogger(name)
        for h in list(lib.handlers):
            lib.removeHandler(h)
        lib.propagate = True
        lib.setLevel(logging.DEBUG if level == "DEBUG" else logging.WARNING)
