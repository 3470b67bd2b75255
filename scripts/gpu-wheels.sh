#!/usr/bin/env bash
# Wheels the GPU machine lacks, for `scripts/gpu-check.sh` there (docs/gpu.md).
#
#   scripts/gpu-wheels.sh [--wheels DIR] [--no-download] [--plan] [--limit-mib N]
#
# The GPU machine (CPython 3.12, manylinux x86_64, torch 2.11+cu130, no network)
# has numpy, uvloop, prometheus-client, xxhash, torch, cuda-bindings and pytest, and
# lacks nixl, its CUDA 13 backend nixl-cu13, msgspec and pyzmq. This downloads
# exactly those into DIR (default .whl/, git-ignored), each pinned to the
# version installed in the project's venv ($PYTHON, default .venv/bin/python):
# the versions the test suite runs with. Then it prints the size of what would
# travel to the GPU machine (the repository's tracked and untracked-not-ignored
# files, plus DIR) and fails (status 1) above --limit-mib (62 MiB; the device
# tool's limit is 64 MiB).
#
#   --no-download  only check the size of what DIR already holds
#   --plan         print what would be downloaded and what the image provides, then exit
#
# pip's --platform matches a manylinux tag exactly, so every glibc 2.17..2.39
# tag is offered (the image is Ubuntu 24.04, glibc 2.39).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WHEELS="$ROOT/.whl"
LIMIT_MIB=62
DOWNLOAD=1
PLAN=0
PY_TAG=3.12

# What is carried, and what the image already has (docs/gpu.md; the
# device notes' package list). Every runtime dependency in pyproject.toml must
# be in one of the two lists (tests/e2e/test_gpu_check_script.py checks it).
CARRY=(nixl nixl-cu13 msgspec pyzmq)
IMAGE_HAS=(numpy uvloop prometheus-client xxhash torch cuda-bindings pytest pytest-timeout)

usage() { awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "${BASH_SOURCE[0]}"; }

while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) [ $# -ge 2 ] || { echo "gpu-wheels: --wheels needs a folder" >&2; exit 2; }
                  WHEELS=$2; shift 2 ;;
        --no-download) DOWNLOAD=0; shift ;;
        --plan) PLAN=1; shift ;;
        --limit-mib) [ $# -ge 2 ] || { echo "gpu-wheels: --limit-mib needs a number" >&2; exit 2; }
                     LIMIT_MIB=$2; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu-wheels: unknown argument: $1; see scripts/gpu-wheels.sh --help" >&2; exit 2 ;;
    esac
done
case "$LIMIT_MIB" in ''|*[!0-9]*) echo "gpu-wheels: --limit-mib needs a whole number" >&2; exit 2 ;; esac

if [ -z "${PYTHON:-}" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi

# name==version of each carried package, from the venv the tests run in.
pins=()
if [ "$DOWNLOAD" = 1 ] || [ "$PLAN" = 1 ]; then
    for name in "${CARRY[@]}"; do
        if ! version=$("$PYTHON" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$name" 2>/dev/null); then
            echo "gpu-wheels: $name is not installed in $PYTHON: set PYTHON to the project's venv (make test builds .venv)" >&2
            exit 1
        fi
        pins+=("$name==$version")
    done
fi

if [ "$PLAN" = 1 ]; then
    echo "python: cp${PY_TAG/./} manylinux x86_64"
    echo "carry: ${pins[*]}"
    echo "image has: ${IMAGE_HAS[*]}"
    exit 0
fi

if [ "$DOWNLOAD" = 1 ]; then
    mkdir -p "$WHEELS"
    # One version of each: two wheels of one package stop the whole install there.
    for name in "${CARRY[@]}"; do
        rm -f "$WHEELS/${name//-/_}"-*.whl
    done
    platforms=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
    for n in $(seq 17 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
    echo "gpu-wheels: downloading ${pins[*]} (CPython $PY_TAG) into $WHEELS"
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_TAG" \
        --implementation cp "${platforms[@]}" -d "$WHEELS" "${pins[@]}"
    commit=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo "?")
    if [ -n "$(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
        commit="$commit (uncommitted changes)"
    fi
    {
        echo "commit: $commit"
        echo "carry: ${pins[*]}"
        echo "downloaded: $(date -u '+%Y-%m-%d %H:%M UTC')"
    } > "$WHEELS/MANIFEST.txt"
fi

if [ ! -d "$WHEELS" ]; then
    echo "gpu-wheels: $WHEELS does not exist (run without --no-download first)" >&2
    exit 1
fi

# What travels: tracked and untracked-not-ignored files of the checkout (not
# those under the wheel folder, counted below), a shared/ folder in it whole
# (the device tool sends it, ignored or not), and the wheel folder (carried).
wheels_abs=$(cd "$WHEELS" && pwd)
rel=""
case "$wheels_abs/" in "$ROOT"/*) rel=${wheels_abs#"$ROOT"/}/ ;; esac
tree_bytes=$(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do
          if [ -n "$rel" ] && [ "${f#"$rel"}" != "$f" ]; then continue; fi
          if [ -d shared ] && [ "${f#shared/}" != "$f" ]; then continue; fi
          [ -f "$f" ] && [ ! -L "$f" ] && stat -c %s -- "$f"
      done | awk '{s += $1} END {print s + 0}')
if [ -d "$ROOT/shared" ]; then
    tree_bytes=$((tree_bytes + $(find "$ROOT/shared" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')))
fi
wheel_bytes=$(find "$wheels_abs" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
total=$((tree_bytes + wheel_bytes))
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
echo "gpu-wheels: travels $(mib "$total"): checkout $(mib "$tree_bytes") + $WHEELS $(mib "$wheel_bytes") (limit $LIMIT_MIB MiB)"
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
    echo "gpu-wheels: too large: $(mib "$total") > $LIMIT_MIB MiB; the device tool refuses over 64 MiB" >&2
    exit 1
fi
