"""``--nixl-progress-thread-ms`` against the default, same run, alternating blocks.

Two P sidecars, the fleet's default one and one started with the flag (NIXL's
UCX progress thread, woken by UCX events), each read by an engine of the same
D sidecar (default flags): the flag where it is meant to go, on the side whose
memory is read. Blocks of 1-block reads (engine ``read`` to ``received``,
waiting polls) and of sustained 16-block ``read_nowait`` rounds alternate
between the pairs, so both see the same minutes of a noisy host. What it
shows: the latency and the CPU of a lone read (P answers the READ's closing
flush from the thread instead of a 50 µs soon poll its worker opens at the
grant) against the CPU per read under load (a wake-up of P's thread per
message)."""

from __future__ import annotations

import statistics
import time

from suite import (
    Figure,
    Fleet,
    Pair,
    Scale,
    SidecarProcess,
    _per_read,
    pct,
    proc_threads_by_role,
    sidecars_of,
    small_attention,
    us,
    wait_all,
)

FLAG_MS = 10
#: the fleet's names for the pair with the flag on P (suite._NAMED_ARGS gives
#: "pt-" sidecars the flag); D is the default pair's
THREADED = ["pt-p0", "d0"]
ROUNDS = 2
ORDER = ("default", "thread")


def _cpu(sidecars: list[SidecarProcess]) -> dict[str, dict[str, float]]:
    """CPU seconds by thread role of the pair's P and D sidecars."""
    p, d = sidecars
    assert p.proc is not None and d.proc is not None
    return {"D": proc_threads_by_role(d.proc.pid), "P": proc_threads_by_role(p.proc.pid)}


def _cpu_note(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]],
              reads: int) -> str:
    return "; ".join(f"{who} {_per_read(before[who], after[who], reads)}" for who in before)


def _latency_block(pair: Pair, n: int, lat: list[float]) -> None:
    """``n`` 1-block reads, each timed from the engine's ``read`` to its
    ``received``. The first read's bytes are checked against the oracle, the
    others' completions only: the engines here hold 16 x the window's blocks
    for the sustained blocks, and checking a read sweeps its whole region
    (16 MiB), which between timed reads evicted the sidecars' working set from
    this host's caches: their loops' CPU per read doubled (D 476 -> 937 µs at
    9b67489) and the figure measured the sweep, not the flag."""
    for i in range(n):
        t0, t1, _ = pair.timed_read(verify=i == 0)
        lat.append((t1 - t0) / 1e9)


def _sustained_block(pair: Pair, reads: int, window: int) -> float:
    """Seconds the engine waited for ``reads`` 16-block ``read_nowait`` reads in rounds."""
    k, done, elapsed = 16, 0, 0.0
    while done < reads:
        n = min(window, reads - done)
        sents = [pair.prefill(8 * k, hold=False) for _ in range(n)]
        pair.P.hold_nowait(sents)
        t0 = time.perf_counter()
        pair.D.start_reads_nowait(sents)
        got = wait_all(pair.D, [x.request_id for x in sents])
        elapsed += time.perf_counter() - t0
        pair.finish(sents, got, verify=done == 0)
        done += n
    return elapsed


def bench(fleet: Fleet, s: Scale) -> list[Figure]:
    """Two figures: 1-block latency, and sustained ``read_nowait`` reads/s, each
    with the flag against the default (alternating blocks, same run)."""
    window = s.sustained_in_flight
    lat: dict[str, list[float]] = {"default": [], "thread": []}
    cpu_lat: dict[str, list[str]] = {"default": [], "thread": []}
    rate: dict[str, list[float]] = {"default": [], "thread": []}
    cpu_sus: dict[str, list[str]] = {"default": [], "thread": []}
    n_lat = max(1, s.latency_reads // ROUNDS)
    n_sus = max(window, s.sustained_requests // ROUNDS)
    with sidecars_of(fleet, ["p0", "d0"]) as plain, sidecars_of(fleet, THREADED) as threaded:
        procs = {"default": plain, "thread": threaded}
        pairs = {"default": Pair(*plain, small_attention, 16 * window, "ptd"),
                 "thread": Pair(*threaded, small_attention, 16 * window, "ptt")}
        try:
            for pair in pairs.values():  # links, wire-up, first plans
                _latency_block(pair, 5, [])
            for r in range(ROUNDS):  # ABBA...: each pair first as often as second
                for name in (ORDER if r % 2 == 0 else ORDER[::-1]):
                    pair = pairs[name]
                    c0 = _cpu(procs[name])
                    _latency_block(pair, n_lat, lat[name])
                    cpu_lat[name].append(_cpu_note(c0, _cpu(procs[name]), n_lat))
                    c0 = _cpu(procs[name])
                    elapsed = _sustained_block(pair, n_sus, window)
                    rate[name].append(n_sus / elapsed)
                    cpu_sus[name].append(_cpu_note(c0, _cpu(procs[name]), n_sus))
        finally:
            for pair in pairs.values():
                pair.close()
    flag = f"--nixl-progress-thread-ms {FLAG_MS}"
    t50, t99 = pct(lat["thread"], 50), pct(lat["thread"], 99)
    d50, d99 = pct(lat["default"], 50), pct(lat["default"], 99)
    t_rate, d_rate = statistics.median(rate["thread"]), statistics.median(rate["default"])
    order = (f"{ROUNDS} rounds of a block on each pair, alternating which goes first; the flag's "
             "\"NIXL worker\" is the worker thread and NIXL's progress thread, which inherits "
             "its name")
    return [
        Figure(f"1-block (16 KiB) read latency p50 / p99 with {flag} on P ({n_lat * ROUNDS} "
               "reads, engine `read` to `received`, waiting poll)",
               f"{us(t50)} / {us(t99)}",
               f"default flags, same run: {us(d50)} / {us(d99)}", f"{t50 / d50:.2f}x p50",
               "table (<1: the flag is faster)", None,
               [f"{order}; CPU per read cycle by thread (schedstat), per block: flag "
                + " | ".join(cpu_lat["thread"]) + "; default " + " | ".join(cpu_lat["default"]),
                "with the flag P's worker opens no 50 µs soon poll at a grant: NIXL's progress "
                "thread answers the READ's closing flush when it arrives (P's worker then takes "
                "the read's notification at its 1 ms lease poll, not a 50 µs one: P's hold "
                "ends that much later, which this figure does not time)"]),
        Figure(f"sustained 16-block (256 KiB) reads with {flag} on P, {window} in flight, "
               f"one `read_nowait` each ({n_sus * ROUNDS} reads)",
               f"{t_rate:,.0f} reads/s (blocks: "
               + ", ".join(f"{r:,.0f}" for r in rate["thread"]) + ")",
               f"default flags, same run: {d_rate:,.0f} reads/s (blocks: "
               + ", ".join(f"{r:,.0f}" for r in rate["default"]) + ")",
               f"{t_rate / d_rate:.2f}x", "table (>1: the flag is faster)", None,
               [f"{order}; daemon CPU per read by thread (schedstat), per block: flag "
                + " | ".join(cpu_sus["thread"]) + "; default " + " | ".join(cpu_sus["default"]),
                "under load the progress thread wakes for messages the worker's own polls "
                "would have taken anyway: each wake-up costs CPU on this 2-vCPU guest"]),
    ]
