#!/usr/bin/env bash
# System packages the test suite uses beyond Python: prometheus + promtool (the
# dashboard and alert tests) and systemd-analyze (the unit tests). `make test`
# calls this; it installs only when running as root with apt-get, and otherwise
# says what is missing (those tests then skip with the reason).
set -euo pipefail
missing=()
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
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
