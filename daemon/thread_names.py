"""OS names for the daemon's busy threads.

Python 3.11 does not pass ``threading.Thread`` names to the kernel, so ``top
-H``, ``perf`` and ``/proc/<pid>/task/*/comm`` show every thread as
``python``. Naming the NIXL worker (``kvs-nixl``) and planning (``kvs-plan``)
threads lets an operator, and the sustained benchmark, tell where a busy
daemon's CPU goes (the event loop is the thread whose id is the pid).
"""

from __future__ import annotations

import ctypes
import sys

_PR_SET_NAME = 15


def name_this_thread(name: str) -> None:
    """Give the calling thread ``name`` (15 bytes at most) in the kernel; best
    effort: Linux only, and a failure changes nothing else."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass
