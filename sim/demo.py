"""``kvsidecar demo``: a prefill engine (tp 1) hands hybrid attention+Mamba2 state
to a decode engine (tp 2) through real sidecars, and every byte is checked.

::

    driver ──spawns──▶ sidecar p0            sidecar d0, d1   (kvsidecar serve)
           ──spawns──▶ P engine process ──ipc──▶ p0
                       D engine process ──ipc──▶ d0, d1 ──NIXL READ──▶ p0

The P engine fills its pages with the oracle's logical state and holds them;
the D engine reads (after one warm-up request that pays the handshakes),
polls until every rank has a completion, and verifies its pages with the
oracle. The driver reads descriptor counts from the D sidecars' Prometheus
endpoints and measures one raw NIXL READ of the same bytes as the baseline.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

import numpy as np

from kvsidecar.sim.cluster import SidecarProcess, SimEngine
from kvsidecar.sim.models import nemotron_like
from kvsidecar.sim.oracle import Request

WARMUP = "warmup"


@dataclass(frozen=True)
class Plan:
    layers: int
    p_tp: int
    d_tp: int
    prompts: list[int]

    @property
    def blocks(self) -> int:
        # At most 2 attention pages + 1 Mamba page per request at these sizes.
        return 3 * (len(self.prompts) + 1) + 4


def _prefill(plan: Plan, sockets: list[str], to_driver: Queue[Any]) -> None:
    P = SimEngine("demo-P", nemotron_like(plan.layers), plan.p_tp, plan.blocks, sockets)
    try:
        sents = [P.prefill(WARMUP, Request(seed=999, prompt_tokens=64))]
        sents += [P.prefill(f"req-{i}", Request(seed=i, prompt_tokens=n))
                  for i, n in enumerate(plan.prompts)]
        to_driver.put(("sents", sents))
        got = P.wait_for([s.request_id for s in sents], timeout_s=120)
        kinds = sorted({c.kind for per in got.values() for c in per.values()})
        to_driver.put(("prefill-done", kinds))
    except BaseException as e:
        to_driver.put(("error", f"prefill engine: {type(e).__name__}: {e}"))
    finally:
        P.close()


def _decode(plan: Plan, sockets: list[str], from_driver: Queue[Any],
            to_driver: Queue[Any]) -> None:
    D = SimEngine("demo-D", nemotron_like(plan.layers), plan.d_tp, plan.blocks, sockets)
    try:
        sents = from_driver.get(timeout=120)
        D.start_read(sents[0])
        D.wait_for([WARMUP], timeout_s=60)
        to_driver.put(("warm", None))
        pids = from_driver.get(timeout=60)  # "go": the sidecars' pids
        cpu0 = _cpu_s(pids)
        t0 = time.perf_counter()
        for s in sents[1:]:
            D.start_read(s)
        got = D.wait_for([s.request_id for s in sents[1:]], timeout_s=120)
        elapsed = time.perf_counter() - t0
        sidecar_cpu = _cpu_s(pids) - cpu0
        kinds = sorted({c.kind for per in got.values() for c in per.values()})
        nbytes = sum(c.nbytes for per in got.values() for c in per.values())
        problems = [f"{rid}: {p}" for rid in got for p in D.verify(rid)]
        problems += [f"{WARMUP}: {p}" for p in D.verify(WARMUP)]
        checked = sum(len(g) for s in D.receiving.values() for g in s.block_ids)
        to_driver.put(("decode-done", {"elapsed": elapsed, "sidecar_cpu": sidecar_cpu,
                                       "kinds": kinds, "nbytes": nbytes,
                                       "problems": problems, "pages_checked": checked}))
    except BaseException as e:
        to_driver.put(("error", f"decode engine: {type(e).__name__}: {e}"))
    finally:
        D.close()


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds the processes ``pids`` ran so far, every thread (each one's
    process CPU clock, as ``clock_getcpuclockid`` gives it in C)."""
    return sum(time.clock_gettime((~pid << 3) | 2) for pid in pids)


def _metric(port: int, name: str) -> float:
    """Sum of one sample name over all its label sets."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


def _descriptors(sidecars: list[SidecarProcess]) -> tuple[float, float]:
    return (sum(_metric(s.metrics_port, "kvsidecar_transfer_descriptors_planned_sum")
                for s in sidecars),
            sum(_metric(s.metrics_port, "kvsidecar_transfer_descriptors_sum") for s in sidecars))


def _expect(q: Queue[Any], kind: str, timeout: float = 180) -> Any:
    got, payload = q.get(timeout=timeout)
    if got == "error":
        raise RuntimeError(payload)
    if got != kind:
        raise RuntimeError(f"expected {kind}, got {got}")
    return payload


def run_demo(*, requests: int = 12, layers: int = 4, p_tp: int = 1, d_tp: int = 2,
             seed: int = 0) -> int:
    rng = np.random.default_rng(seed)
    plan = Plan(layers, p_tp, d_tp, [int(x) for x in rng.integers(256, 8192, requests)])
    layout_p, layout_d = nemotron_like(layers)(p_tp, 1), nemotron_like(layers)(d_tp, 1)
    print(f"kvsidecar demo: Nemotron-3-Nano-like hybrid (attention + Mamba2), {layers} layers; "
          f"P tp {p_tp} -> D tp {d_tp}")
    print(f"  page: P {layout_p.page_bytes / 2**20:.2f} MiB ({layout_p.groups[0].sub_blocks} "
          f"kernel blocks), D {layout_d.page_bytes / 2**20:.2f} MiB "
          f"({layout_d.groups[0].sub_blocks} kernel blocks); {requests} requests of "
          f"{min(plan.prompts)}-{max(plan.prompts)} tokens")
    workdir = Path(tempfile.mkdtemp(prefix="kvsidecar-demo-"))
    ps = [SidecarProcess(workdir, f"p{i}") for i in range(p_tp)]
    ds = [SidecarProcess(workdir, f"d{i}", args=["--metrics-port", "0"]) for i in range(d_tp)]
    ctx = mp.get_context("spawn")
    to_driver: Queue[Any] = ctx.Queue()
    to_decode: Queue[Any] = ctx.Queue()
    procs: list[Any] = []
    try:
        t_start = time.perf_counter()
        for s in ps + ds:
            s.start()
        print(f"  {len(ps) + len(ds)} sidecars up in {time.perf_counter() - t_start:.1f} s "
              f"(logs in {workdir})")
        procs = [
            ctx.Process(target=_prefill, args=(plan, [s.socket for s in ps], to_driver)),
            ctx.Process(target=_decode,
                        args=(plan, [s.socket for s in ds], to_decode, to_driver)),
        ]
        for p in procs:
            p.start()
        to_decode.put(_expect(to_driver, "sents"))
        _expect(to_driver, "warm")
        before = _descriptors(ds)
        to_decode.put([s.proc.pid for s in ps + ds if s.proc is not None])  # "go"
        result: dict[str, Any] = {}
        prefill_kinds: list[str] = []
        for _ in range(2):
            kind, payload = to_driver.get(timeout=300)
            if kind == "error":
                raise RuntimeError(payload)
            if kind == "decode-done":
                result = payload
            else:
                prefill_kinds = payload
        after = _descriptors(ds)
        planned, posted = after[0] - before[0], after[1] - before[1]
        nbytes, elapsed = result["nbytes"], result["elapsed"]
        raw = _raw_baseline(nbytes)
        raw_scattered = _raw_baseline(nbytes, int(posted)) if posted > 1 else None
        print()
        print(f"  {'':28} {'requests':>8} {'bytes':>10} {'descriptors':>21} {'time':>9} "
              f"{'GB/s':>6}")
        print(f"  {'sidecars (D reads, 2 ranks)':28} {requests:>8} {nbytes / 1e6:>8.1f}MB "
              f"{planned:>10,.0f} -> {posted:>7,.0f} {elapsed * 1e3:>7.1f}ms "
              f"{nbytes / elapsed / 1e9:>6.2f}")
        if raw:
            print(f"  {'raw NIXL, one READ':28} {1:>8} {nbytes / 1e6:>8.1f}MB "
                  f"{1:>10} -> {1:>7} {raw * 1e3:>7.1f}ms {nbytes / raw / 1e9:>6.2f}")
        if raw_scattered:
            print(f"  {'raw NIXL, same # descriptors':28} {1:>8} {nbytes / 1e6:>8.1f}MB "
                  f"{posted:>10,.0f} -> {posted:>7,.0f} {raw_scattered * 1e3:>7.1f}ms "
                  f"{nbytes / raw_scattered / 1e9:>6.2f}")
        if raw:
            print(f"  sidecar time / raw NIXL time: {elapsed / raw:.2f}x one READ"
                  + (f", {elapsed / raw_scattered:.2f}x the same number of descriptors"
                     if raw_scattered else "")
                  + "\n  (the sidecar figure includes planning, IPC round trips, "
                    "notifications and completion polling; its two D ranks read in parallel)")
            cores = os.cpu_count() or 1
            spread = result["sidecar_cpu"] / cores
            print(f"  bound on this host: the sidecars ran {result['sidecar_cpu'] * 1e3:.1f} ms "
                  f"of CPU in that time, at least {spread * 1e3:.1f} ms on its {cores} cores: "
                  f"{spread / raw:.2f}x one READ at best while a read costs that much CPU")
        problems = result["problems"]
        ok = (not problems and result["kinds"] == ["received"] and prefill_kinds == ["sent"])
        print()
        print(f"  oracle: {result['pages_checked']} pages checked on every D rank, "
              f"{len(problems)} problems; D completions {result['kinds']}, "
              f"P completions {prefill_kinds}")
        for p in problems[:10]:
            print(f"    {p}")
        print("  RESULT: " + ("OK, every byte matches the oracle" if ok else "FAILED"))
        return 0 if ok else 1
    except Exception as e:
        print(f"  RESULT: FAILED ({e})", file=sys.stderr)
        for s in ps + ds:
            print(f"--- {s.name} log ---\n{s.read_log()[-2000:]}", file=sys.stderr)
        return 1
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        for s in ps + ds:
            s.stop()
        shutil.rmtree(workdir, ignore_errors=True)  # sockets, logs: nothing left in /tmp


def _raw_baseline(nbytes: int, descriptors: int = 1) -> float | None:
    from kvsidecar.sim.raw_nixl import raw_read_seconds

    try:
        return float(raw_read_seconds(nbytes, descriptors=descriptors))
    except Exception as e:  # the demo's verdict does not depend on the baseline
        print(f"  (raw NIXL baseline unavailable: {e})")
        return None
