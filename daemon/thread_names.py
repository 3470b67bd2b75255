"""OS-level settings of the daemon's own threads (Linux ``prctl``).

Python 3.11 does not pass ``threading.Thread`` names to the kernel, so ``top
-H``, ``perf`` and ``/proc/<pid>/task/*/comm`` show every thread as
``python``. Naming the NIXL worker (``kvs-nixl``) and planning (``kvs-plan``)
threads lets an operator, and the sustained benchmark, tell where a busy
daemon's CPU goes (the event loop is the thread whose id is the pid). The NIXL
worker also tightens its timer slack through :func:`prctl_this_thread`.
"""

from __future__ import annotations

import ctypes
import sys

_PR_SET_NAME = 15


def prctl_this_thread(option: int, arg: int | bytes) -> bool:
    """``prctl(option, arg)`` for the calling thread; best effort: Linux only,
    False where it is not available or failed (nothing else changes)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        value = ctypes.c_char_p(arg) if isinstance(arg, bytes) else ctypes.c_ulong(arg)
        return int(libc.prctl(option, value, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def name_this_thread(name: str) -> None:
    """Give the calling thread ``name`` (15 bytes at most) in the kernel."""
    prctl_this_thread(_PR_SET_NAME, name.encode()[:15])
