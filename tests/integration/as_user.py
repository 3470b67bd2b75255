"""Run a piece of a test as another user: in a forked child that drops to
``uid`` (root tests only: "another user" made real with setuid, as an engine
of another account would be)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

#: the ``nobody`` account's uid and gid
NOBODY = 65534


def run_as(uid: int, work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``work()`` in a forked child running as ``uid`` (gid ``uid``, no
    supplementary groups); its JSON-able result, or ``{"exception": repr}`` when
    it raised."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            try:
                out = work()
            except Exception as e:
                out = {"exception": repr(e)}
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    got: dict[str, Any] = json.loads(data)
    return got
