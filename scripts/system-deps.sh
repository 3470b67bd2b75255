#!/usr/bin/env bash
# System packages the test suite uses beyond Python: prometheus + promtool (the
# dashboard and alert tests), systemd-analyze and libseccomp (the unit tests:
# tests/e2e/test_systemd.py starts the daemon under the unit's seccomp filters,
# through ctypes, so only the shared library is needed). `make test`
# calls this; it installs only when running as root with apt-get, and otherwise
# says what is missing (those tests then skip with the reason).
set -euo pipefail
missing=()
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
# (systemd depends on libseccomp2 on Debian and Ubuntu; checked on its own all the same)
case "$( (ldconfig -p || /sbin/ldconfig -p) 2>/dev/null)" in
    *"libseccomp.so.2 "*) ;;
    *) missing+=(libseccomp2) ;;
esac
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "system-deps: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq || echo "system-deps: apt-get update failed; trying the cached lists"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
        || echo "system-deps: could not install ${missing[*]}; their tests will skip"
else
    echo "system-deps: not root (or no apt-get): ${missing[*]} missing; their tests will skip"
fi
