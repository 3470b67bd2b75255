"""Which UCX transport host-memory reads will take here, predicted without a transfer.

The same probes UCX runs at start-up (``UCX_TLS``, a ``process_vm_readv``
self-test, Yama's ptrace_scope), so the daemon can say in its first log line
whether reads go over CMA (one copy) or fall back to TCP. ``check.py`` proves
the prediction with a real loopback read.
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["transport_note"]


_SM_ALIASES = {"cma", "sm", "shm", "all"}


def _ucx_tls_allows_cma(tls: str | None) -> bool:
    """Mirror UCX_TLS semantics closely enough to say whether cma can be picked."""
    if not tls:
        return True
    if tls.startswith("^"):
        excluded = {t.strip() for t in tls[1:].split(",")}
        return not excluded & {"cma", "sm", "shm"}
    included = {t.strip() for t in tls.split(",")}
    return bool(included & _SM_ALIASES)


def _cma_blocker() -> str | None:
    """Why UCX would disable CMA here, or None if it would enable it.

    Follows UCX's own check (``uct_cma_query_md_resources``): a
    ``process_vm_writev`` self-test (fails under a seccomp filter) plus Yama's
    ptrace_scope (0: fine, 1: UCX calls ``PR_SET_PTRACER_ANY`` itself, 2: needs
    CAP_SYS_PTRACE, 3: never). We probe with ``process_vm_readv`` on ourselves,
    which a seccomp filter blocks the same way and which writes nothing.
    """
    if not sys.platform.startswith("linux"):
        return "not Linux"
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # the running process, libc included

        class _IoVec(ctypes.Structure):
            _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

        src = ctypes.c_uint64(0x5EED)
        dst = ctypes.c_uint64(0)
        local = _IoVec(ctypes.cast(ctypes.byref(dst), ctypes.c_void_p), 8)
        remote = _IoVec(ctypes.cast(ctypes.byref(src), ctypes.c_void_p), 8)
        fn = libc.process_vm_readv
        fn.restype = ctypes.c_ssize_t
        got = fn(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got != 8 or dst.value != src.value:
            return f"process_vm_readv self-test failed: {os.strerror(ctypes.get_errno())}"
    except (OSError, AttributeError) as exc:
        return f"process_vm_readv unavailable: {exc}"
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = f.read().strip()
    except OSError:
        return None  # no Yama: ptrace access within one uid is allowed
    if scope in ("0", "1"):
        return None
    if scope == "2" and _has_cap_sys_ptrace():
        return None
    return f"yama ptrace_scope={scope} without CAP_SYS_PTRACE"


def _has_cap_sys_ptrace() -> bool:
    cap_sys_ptrace = 19
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> cap_sys_ptrace & 1)
    except (OSError, ValueError):
        pass
    return False


def transport_note() -> str:
    """One line saying which UCX transports host-memory reads will use here.

    This is a prediction from UCX_TLS and the same probes UCX runs; to see
    UCX's actual choice, run with ``UCX_PROTO_INFO=y`` (it prints its protocol
    tables: ``remote memory read by ucp_get* ... cma/memory`` when CMA is used).
    """
    tls = os.environ.get("UCX_TLS")
    shown = f"UCX_TLS={tls}" if tls else "UCX_TLS unset (UCX picks)"
    if not _ucx_tls_allows_cma(tls):
        data = "host-memory reads over tcp or another listed transport (cma excluded by UCX_TLS)"
    else:
        blocker = _cma_blocker()
        if blocker is None:
            data = "host-memory reads over cma (process_vm_readv, one copy)"
        else:
            data = f"host-memory reads fall back to tcp, about 5x slower than cma ({blocker})"
    return f"{shown}; {data}; wire-up and notifications over UCX active messages (tcp)"
