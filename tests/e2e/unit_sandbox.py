"""The seccomp part of systemd/kvsidecar@.service, without systemd.

The sandbox this suite runs in has no systemd as PID 1, so ``systemctl start``
is not available; what breaks a daemon under a unit is mostly its seccomp
filters, and those a process can install on itself. :func:`unit_filter`
computes what systemd 252 computes from the unit:

- ``SystemCallFilter=``: the lines in order; the first decides allow-list
  (plus ``@default``, which systemd adds) or deny-list; in an allow-list a
  plain entry adds and a ``~`` entry removes, in a deny-list the other way
  round. Groups are expanded with ``systemd-analyze syscall-filter`` (the
  same tables systemd uses). Everything not allowed fails with
  ``SystemCallErrorNumber=``;
- ``RestrictAddressFamilies=``: ``socket()`` with any other family fails with
  EAFNOSUPPORT (a second filter, as systemd does it);
- ``RestrictRealtime=yes``: ``sched_setscheduler`` to SCHED_FIFO, SCHED_RR or
  SCHED_DEADLINE fails with EPERM.

Run as a program (``python unit_sandbox.py SPEC.json -- CMD ARGS...``) it
installs the filters from the JSON that :func:`unit_filter` wrote and execs
CMD. libseccomp is used through ctypes (``libseccomp.so.2``, the library
systemd links against), so no Python binding is needed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import os
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_ACT_ERRNO = 0x00050000
SCMP_CMP_EQ = 4
SCHED_RESET_ON_FORK = 0x40000000
REALTIME_POLICIES = (1, 2, 6)  # SCHED_FIFO, SCHED_RR, SCHED_DEADLINE


@dataclass
class UnitFilter:
    allow_list: bool
    syscalls: list[str]          # allowed (allow_list) or denied (deny-list)
    error: str = "EPERM"
    families: list[str] = field(default_factory=list)  # empty: no restriction
    restrict_realtime: bool = False


def unit_lines(unit: Path) -> list[tuple[str, str]]:
    out = []
    for line in unit.read_text().splitlines():
        s = line.strip()
        if s and not s.startswith(("#", ";", "[")) and "=" in s:
            k, v = s.split("=", 1)
            out.append((k.strip(), v.strip()))
    return out


def syscall_groups(analyze: str) -> dict[str, list[str]]:
    """``@group`` -> its entries (syscalls and nested ``@groups``), as systemd has them."""
    text = subprocess.run([analyze, "syscall-filter", "--no-pager"], capture_output=True,
                          text=True, check=True, timeout=60).stdout
    groups: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("@"):
            current = groups.setdefault(line.split()[0], [])
        elif not line.strip() or not line.startswith(" "):
            current = None
        elif current is not None and not line.strip().startswith("#"):
            current.append(line.strip())
    return groups


def expand(entry: str, groups: dict[str, list[str]]) -> set[str]:
    if not entry.startswith("@"):
        return {entry.split(":", 1)[0]}
    out: set[str] = set()
    for e in groups[entry]:
        out |= expand(e, groups)
    return out


def unit_filter(unit: Path, analyze: str) -> UnitFilter:
    groups = syscall_groups(analyze)
    allow_list: bool | None = None
    chosen: set[str] = set()
    error = "EPERM"
    families: list[str] = []
    realtime = False
    for key, value in unit_lines(unit):
        if key == "SystemCallFilter":
            if not value:
                allow_list, chosen = None, set()
                continue
            invert = value.startswith("~")
            names = value.lstrip("~").split()
            if allow_list is None:
                allow_list = not invert
                if allow_list:
                    chosen |= expand("@default", groups)
            for name in names:
                if invert == allow_list:  # ~ in an allow-list, plain in a deny-list
                    chosen -= expand(name, groups)
                else:
                    chosen |= expand(name, groups)
        elif key == "SystemCallErrorNumber":
            error = value
        elif key == "RestrictAddressFamilies":
            assert not value.startswith("~"), "only an allow-list of families is handled"
            families = value.split()
        elif key == "RestrictRealtime":
            realtime = value in ("yes", "true", "1", "on")
    assert allow_list is not None, f"{unit} has no SystemCallFilter="
    return UnitFilter(allow_list, sorted(chosen), error, families, realtime)


def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(ctypes.util.find_library("seccomp") or "libseccomp.so.2")
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_exact_array.argtypes = [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


def libseccomp_available() -> bool:
    try:
        _lib()
    except OSError:
        return False
    return True


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


def install(spec: UnitFilter) -> None:
    lib = _lib()
    err = SCMP_ACT_ERRNO | getattr(errno, spec.error)

    def rule(ctx: int, action: int, name: str, *cmps: tuple[int, int]) -> None:
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:  # not on this architecture
            return
        arr = (_ArgCmp * max(len(cmps), 1))(*[_ArgCmp(a, SCMP_CMP_EQ, v, 0) for a, v in cmps])
        rc = lib.seccomp_rule_add_exact_array(ctx, action, nr, len(cmps), arr)
        if rc not in (0, -errno.EEXIST):
            raise OSError(-rc, f"seccomp_rule_add({name})")

    def load(ctx: int) -> None:
        rc = lib.seccomp_load(ctx)
        lib.seccomp_release(ctx)
        if rc:
            raise OSError(-rc, "seccomp_load")

    # RestrictAddressFamilies=
    if spec.families:
        allowed = {int(getattr(socket, f)) for f in spec.families}
        ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
        for fam in range(64):
            if fam not in allowed:
                rule(ctx, SCMP_ACT_ERRNO | errno.EAFNOSUPPORT, "socket", (0, fam))
        load(ctx)
    # RestrictRealtime=yes
    if spec.restrict_realtime:
        ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
        for policy in REALTIME_POLICIES:
            for flags in (0, SCHED_RESET_ON_FORK):
                rule(ctx, SCMP_ACT_ERRNO | errno.EPERM, "sched_setscheduler", (1, policy | flags))
        load(ctx)
    # SystemCallFilter= last, as systemd does: it may forbid seccomp() itself
    ctx = lib.seccomp_init(err if spec.allow_list else SCMP_ACT_ALLOW)
    for name in spec.syscalls:
        rule(ctx, SCMP_ACT_ALLOW if spec.allow_list else err, name)
    load(ctx)

def write_spec(spec: UnitFilter, path: Path) -> None:
    path.write_text(json.dumps(asdict(spec)))


def main(argv: list[str]) -> None:
    spec_path, sep, *cmd = argv
    assert sep == "--" and cmd, "usage: unit_sandbox.py SPEC.json -- CMD [ARGS...]"
    install(UnitFilter(**json.loads(Path(spec_path).read_text())))
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
