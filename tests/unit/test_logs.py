"""--log-format json: one object per line with the event's identifiers; NIXL's
logger routed below ours and off stdout."""

from __future__ import annotations

import json
import logging

from kvsidecar.daemon.logs import JsonFormatter, quiet_libraries


def test_json_line_carries_event_fields() -> None:
    rec = logging.LogRecord("kvsidecar.daemon.reads", logging.WARNING, __file__, 1,
                            "read %r failed", ("r1",), None)
    for k, v in {"request_id": "r1", "engine": "D0", "peer": "P0", "rank": 1}.items():
        setattr(rec, k, v)
    line = JsonFormatter().format(rec)
    assert "\n" not in line
    got = json.loads(line)
    assert got["msg"] == "read 'r1' failed" and got["level"] == "WARNING"
    assert (got["request_id"], got["engine"], got["peer"], got["rank"]) == ("r1", "D0", "P0", 1)


def test_nixl_logger_goes_through_ours_below_info() -> None:
    import nixl._api  # noqa: F401  (installs NIXL's own stdout handler)

    quiet_libraries("INFO")
    lib = logging.getLogger("nixl")
    assert lib.handlers == [] and lib.propagate
    assert not lib.isEnabledFor(logging.INFO) and lib.isEnabledFor(logging.WARNING)
