#!/usr/bin/env bash
# The GPU check (issue #28): the one command a GPU machine runs (docs/gpu.md).
#
#   scripts/gpu-check.sh [--dry-run] [--wheels DIR] [--site DIR] [--budget SECONDS]
#                        [--limit STEP=SECONDS]... OUTDIR
#
# Installs the wheels of scripts/gpu-wheels.sh (DIR, default .whl/) into a
# temporary target (--site) with pip --no-index --no-deps, puts it and this
# checkout (as the package kvsidecar) on PYTHONPATH, then runs the steps below
# in order, each under its own time limit (timeout(1), which ends the step's
# whole process group: its sidecars too), and all of them within --budget
# seconds (330 by default, so that a second try fits a 15-minute lease):
#
#   install          the wheels
#   nvidia-smi       GPU, driver, memory
#   env              versions (Python, torch, CUDA driver, cuda-bindings, NIXL, UCX and its
#                    transport modules), UCX_TLS and the UCX/NIXL/CUDA variables seen, the
#                    device's facts, the driver API calls this cuda-bindings would refuse
#   tests            the tests marked gpu
#   transport        the VRAM loopback transport check, UCX defaults and GET zero-copy on
#   e2e-cuda_malloc  benchmarks/gpu_e2e.py: sidecars on the one GPU, P tp1 -> D tp2 and
#   e2e-cuda_vmm     P tp2 -> D tp1, every byte checked against the oracle
#   figures          benchmarks/gpu_figures.py: GB/s through the sidecars vs a raw NIXL VRAM
#                    READ vs a torch device copy, and 1-block latency, same run
#   figures-get-zcopy  the same with UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y (UCX leaves cuda_ipc
#                    READs off without NVLink); last, so the budget cuts it first
#
# Results go into OUTDIR as each step ends (few files: the device tool returns
# at most 8): steps.tsv (each step's limit, status, seconds, outcome),
# results.jsonl (what the steps measured), log.txt (every step's output) and
# summary.md (rendered after every step, to paste into benchmarks/RESULTS-gpu.md).
# A step that overruns is killed and recorded as timed out; the next one runs.
# Each step's temporary files go to a folder of its own (TMPDIR): after a step
# that failed or was killed, the end of every *.log left there (its sidecars'
# logs) is appended to log.txt.
#
# --dry-run: everything but CUDA, for a machine without a GPU (the test suite):
# the transport step checks host memory, the benchmarks only parse their
# arguments and load their modules; the rest runs as on the GPU machine.
# --limit STEP=SECONDS overrides one step's limit. Status: 0 when every step
# passed, 1 otherwise, 2 for bad arguments.
set -uo pipefail  # no -e: a failed step is recorded and the next one runs

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
STEPS=(install nvidia-smi env tests transport e2e-cuda_malloc e2e-cuda_vmm figures
       figures-get-zcopy)
declare -A LIMIT=([install]=60 [nvidia-smi]=20 [env]=60 [tests]=60 [transport]=60
                  [e2e-cuda_malloc]=90 [e2e-cuda_vmm]=90 [figures]=120
                  [figures-get-zcopy]=120)
BUDGET=330
DRY=0
WHEELS="$ROOT/.whl"
SITE=""
OUT=""

usage() { awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "${BASH_SOURCE[0]}"; }
bad() { echo "gpu-check: $*; see scripts/gpu-check.sh --help" >&2; exit 2; }
whole() { case "$1" in ''|*[!0-9]*) return 1 ;; esac; }

while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1; shift ;;
        --wheels) [ $# -ge 2 ] || bad "--wheels needs a folder"; WHEELS=$2; shift 2 ;;
        --site) [ $# -ge 2 ] || bad "--site needs a folder"; SITE=$2; shift 2 ;;
        --budget) [ $# -ge 2 ] && whole "$2" || bad "--budget needs whole seconds"
                  BUDGET=$2; shift 2 ;;
        --limit) [ $# -ge 2 ] || bad "--limit needs STEP=SECONDS"
                 step=${2%%=*}; secs=${2#*=}
                 [ -n "${LIMIT[$step]+x}" ] || bad "--limit: no step named '$step' (steps: ${STEPS[*]})"
                 whole "$secs" && [ "$secs" -gt 0 ] || bad "--limit $2: seconds must be a whole number above 0"
                 LIMIT[$step]=$secs; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        -*) bad "unknown option: $1" ;;
        *) [ -z "$OUT" ] || bad "one OUTDIR only (got '$OUT' and '$1')"; OUT=$1; shift ;;
    esac
done
[ -n "$OUT" ] || bad "OUTDIR is missing"
mkdir -p "$OUT" || bad "cannot create $OUT"
OUT=$(cd "$OUT" && pwd)

WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvs-gpu-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
[ -n "$SITE" ] || SITE="$WORK/site"
mkdir -p "$WORK/pkg" "$SITE"
ln -s "$ROOT" "$WORK/pkg/kvsidecar"  # the checkout is the package
export PYTHONPATH="$SITE:$WORK/pkg${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

LOG="$OUT/log.txt"
RESULTS="$OUT/results.jsonl"
: > "$LOG"
: > "$RESULTS"
printf 'step\tlimit_s\trc\tseconds\toutcome\n' > "$OUT/steps.tsv"
START=$(date +%s)
FAILED=0

summarize() {
    "$PY" "$ROOT/benchmarks/gpu_check.py" summary "$OUT" >/dev/null 2>>"$LOG" \
        || echo "gpu-check: the summary could not be written (see above)" >>"$LOG"
}

# run_step NAME COMMAND...: under min(its limit, what is left of the budget).
run_step() {
    local name=$1; shift
    local left=$((BUDGET - ($(date +%s) - START)))
    local limit=${LIMIT[$name]}
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$left" -lt 5 ]; then  # too little left to start a step
        printf '%s\t%s\t-\t-\tskipped: the %s s budget is spent\n' "$name" "${LIMIT[$name]}" \
            "$BUDGET" >> "$OUT/steps.tsv"
        FAILED=1
        summarize
        return
    fi
    printf '%s\t%s\t-\t-\tstarted, did not finish\n' "$name" "$limit" >> "$OUT/steps.tsv"
    printf '\n===== %s (limit %s s) %s =====\n' "$name" "$limit" "$(date -u +%H:%M:%S)" >> "$LOG"
    local t0 t1 rc secs outcome tmp="$WORK/tmp/$name"
    mkdir -p "$tmp"
    t0=$(date +%s%N)
    # The step's temporary files (sidecar logs) in a folder of its own: what a
    # killed step leaves there is shown below.
    TMPDIR="$tmp" timeout -k 10 "$limit" "$@" >> "$LOG" 2>&1
    rc=$?
    t1=$(date +%s%N)
    secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.1f", (b - a) / 1e9}')
    if [ "$rc" -eq 0 ]; then
        outcome="passed"
    elif { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } \
            && awk -v s="$secs" -v l="$limit" 'BEGIN {exit !(s >= l - 0.5)}'; then
        outcome="timed out after $limit s (killed)"
    else
        outcome="failed (status $rc)"
    fi
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$limit" "$rc" "$secs" "$outcome" >> "$OUT/steps.tsv"
    echo "gpu-check: $name: $outcome ($secs s)" | tee -a "$LOG"
    if [ "$rc" -ne 0 ]; then
        FAILED=1
        find "$tmp" -name '*.log' -type f -size +0 2>/dev/null | sort | while read -r f; do
            printf -- '--- %s (its last 4000 bytes) ---\n' "${f#"$tmp"/}" >> "$LOG"
            tail -c 4000 "$f" >> "$LOG"
            echo >> "$LOG"
        done
    fi
    # log.txt must stay under the device tool's 16 MiB per file: keep its end.
    if [ "$(stat -c %s "$LOG")" -gt $((12 << 20)) ]; then
        tail -c $((8 << 20)) "$LOG" > "$WORK/log.tail" && mv "$WORK/log.tail" "$LOG"
    fi
    summarize
}

install_wheels() {
    shopt -s nullglob
    local wheels=("$WHEELS"/*.whl)
    shopt -u nullglob
    if [ ${#wheels[@]} -eq 0 ]; then
        echo "no wheels in $WHEELS: run scripts/gpu-wheels.sh first and carry .whl"
        return 1
    fi
    printf 'installing %s\n' "${wheels[@]##*/}"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "${wheels[@]}"
}

run_tests() {
    (cd "$ROOT" && "$PY" -m pytest -q -m gpu tests/integration/test_gpu.py -p no:cacheprovider \
        --junit-xml="$WORK/junit.xml")
    local rc=$?
    [ -f "$WORK/junit.xml" ] && "$PY" "$ROOT/benchmarks/gpu_check.py" junit "$WORK/junit.xml" \
        --json "$RESULTS" >/dev/null
    return $rc
}

# timeout(1) runs programs, not shell functions: the two below run in a bash of their own.
export -f install_wheels run_tests
export PY ROOT WHEELS SITE WORK RESULTS
dry=()
check_mib=256
[ "$DRY" = 1 ] && dry=(--dry-run) && check_mib=16
B="$ROOT/benchmarks"
echo "gpu-check: $([ "$DRY" = 1 ] && echo "DRY RUN, ")results in $OUT, budget $BUDGET s" | tee -a "$LOG"
run_step install bash -c install_wheels
run_step nvidia-smi "$PY" "$B/gpu_check.py" smi --json "$RESULTS"
run_step env "$PY" "$B/gpu_check.py" env --json "$RESULTS" --manifest "$WHEELS/MANIFEST.txt"
run_step tests bash -c run_tests
run_step transport "$PY" "$B/gpu_check.py" transport --json "$RESULTS" --mib "$check_mib" "${dry[@]}"
run_step e2e-cuda_malloc "$PY" "$B/gpu_e2e.py" --memory cuda_malloc --no-transport --json "$RESULTS" "${dry[@]}"
run_step e2e-cuda_vmm "$PY" "$B/gpu_e2e.py" --memory cuda_vmm --no-transport --json "$RESULTS" "${dry[@]}"
run_step figures "$PY" "$B/gpu_figures.py" --memory cuda_malloc --json "$RESULTS" "${dry[@]}"
run_step figures-get-zcopy env UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y \
    "$PY" "$B/gpu_figures.py" --memory cuda_malloc --json "$RESULTS" "${dry[@]}"
echo "gpu-check: done in $(($(date +%s) - START)) s; summary in $OUT/summary.md" | tee -a "$LOG"
exit $FAILED
