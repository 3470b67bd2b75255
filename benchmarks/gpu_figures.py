"""GPU figures, each next to its baselines measured in the same run.

    python benchmarks/gpu_figures.py [--memory cuda_malloc|cuda_vmm|memfd] [--device N]
                                     [--mib 256] [--repeats 5] [--latency-reads 200]
                                     [--json PATH] [--dry-run]

A P and a D sidecar on GPU ``--device`` (tp1 -> tp1), the engines' memory
allocated by the sidecars (``--memory``), engines played by
:class:`~kvsidecar.sim.cluster.SimEngine` in this process:

* bulk: one read of ``--mib`` MiB of consecutive blocks, engine ``read`` to
  ``received``, ``--repeats`` times, each followed by one raw NIXL READ of the
  same bytes between two bare agents in two processes (VRAM descriptors,
  :mod:`kvsidecar.sim.raw_nixl`); and a ``torch`` device-to-device copy of
  the same bytes on the same GPU. GB/s are bytes moved per second (a copy
  reads and writes each byte once). The first read is checked byte for byte
  against the oracle, the others for their completion (filling and checking
  the oracle's bytes takes seconds per 100 MiB);
* latency: 1-block (16 KiB) reads, engine ``read`` to ``received`` with
  waiting polls, every one oracle-checked, against raw NIXL post +
  completion + notification of 16 KiB with both sides spinning (VRAM).

Each record names the ``UCX_*`` variables of the run (``scripts/gpu-check.sh``
runs the figures with UCX's defaults, then with
``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y``, which UCX leaves off without NVLink).

``--memory memfd`` runs the same on host memory without a GPU (sidecars
without ``--device``, DRAM descriptors, a numpy copy): the CPU rehearsal the
test suite runs. Each figure is printed and, with ``--json``, appended to
that file as one JSON line (``benchmarks/gpu_check.py summary`` renders them).
Without a GPU, a CUDA memory kind exits 2 with one line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_e2e
from gpu_check import append

HOST = "memfd"


def ucx_setting() -> str:
    """The UCX variables this run was given (the figures depend on them)."""
    return ", ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                     if k.startswith("UCX_")) or "UCX defaults"


def bulk(p0: Any, d0: Any, memory: str, device: int | None, mib: int,
         repeats: int) -> dict[str, Any]:
    """The bulk figure (module docstring); raises on a failed or wrong read."""
    import suite

    from kvsidecar.sim.cluster import Sent, SimEngine
    from kvsidecar.sim.oracle import Request
    from kvsidecar.sim.raw_nixl import RawPair, RawReader

    nbytes = mib << 20
    blocks = nbytes // (4 * 65536)  # bulk_attention at tp 1: 4 layers x 64 KiB pages
    make = suite.bulk_attention(mib)
    P = SimEngine("gpu-bulk-P", make, 1, blocks, [p0], memory=memory)  # type: ignore[arg-type]
    D = SimEngine("gpu-bulk-D", make, 1, blocks, [d0], memory=memory)  # type: ignore[arg-type]
    times: list[float] = []
    raws: list[float] = []
    moved = 0
    try:
        with RawPair(nbytes, device=device) as raw_pair:
            raw = RawReader(raw_pair, nbytes)
            raw.once()  # wires the bare agents up
            raw.once()  # the second READ of a fresh pair was slower again (host memory here)
            first = P.prefill("bulk", Request(seed=1, prompt_tokens=blocks * 16))
            for i in range(repeats + 1):  # the first one pays the handshake
                sent = first
                if i:
                    sent = Sent(f"bulk-{i}", first.remote, first.block_ids, first.req)
                    sent.tokens.append(P.clients[0].hold(P.engine_id, sent.request_id,
                                                         sent.block_ids).token)
                with raw_pair.resting():  # its target's polls stay off the cores
                    t0 = time.perf_counter()
                    D.start_read(sent)
                    got = suite.wait_all(D, [sent.request_id])
                    dt = time.perf_counter() - t0
                    P.wait_for([sent.request_id], timeout_s=60)
                if i == 0:
                    suite.check(D, got)  # every byte, against the oracle
                elif {c.kind for c in got[sent.request_id].values()} != {"received"}:
                    raise RuntimeError(f"bulk read {i}: {got[sent.request_id]}")
                D.release_blocks(D.receiving.pop(sent.request_id).block_ids)
                moved = sum(c.nbytes for c in got[sent.request_id].values())
                if i:
                    times.append(dt)
                    raws.append(raw.once())
    finally:
        D.close()
        P.close()
    copy, copy_kind = gpu_e2e.copy_gbps(nbytes, device, device)
    ours, base = statistics.median(times), statistics.median(raws)
    return {"what": "bandwidth", "memory": memory, "ucx": ucx_setting(), "bytes": moved,
            "reads": repeats,
            "sidecar_gbps": moved / ours / 1e9, "sidecar_best_gbps": moved / min(times) / 1e9,
            "raw_gbps": nbytes / base / 1e9, "raw_best_gbps": nbytes / min(raws) / 1e9,
            "copy_gbps": copy, "copy": copy_kind,
            "ratio": statistics.median(r / t for r, t in zip(raws, times)),
            "oracle": "first read: every byte ok; the others received"}


def latency(p0: Any, d0: Any, memory: str, device: int | None, reads: int) -> dict[str, Any]:
    """The 1-block latency figure (module docstring); raises on a failed or wrong read."""
    import suite

    from kvsidecar.sim.cluster import SimEngine
    from kvsidecar.sim.oracle import Request
    from kvsidecar.sim.raw_nixl import raw_latencies

    P = SimEngine("gpu-lat-P", suite.small_attention, 1, 8, [p0], memory=memory)  # type: ignore[arg-type]
    D = SimEngine("gpu-lat-D", suite.small_attention, 1, 8, [d0], memory=memory)  # type: ignore[arg-type]
    lat: list[float] = []
    try:
        for i in range(reads + 5):  # five warm-ups
            sent = P.prefill(f"lat-{i}", Request(seed=100 + i, prompt_tokens=8))
            t0 = time.perf_counter()
            D.start_read(sent)
            got = suite.wait_all(D, [sent.request_id])
            dt = time.perf_counter() - t0
            P.wait_for([sent.request_id], timeout_s=60)
            suite.check(D, got)
            D.finish(sent.request_id)
            P.free(sent.block_ids)
            if i >= 5:
                lat.append(dt)
    finally:
        D.close()
        P.close()
    raw = raw_latencies(16384, reads, device)
    return {"what": "latency", "memory": memory, "ucx": ucx_setting(), "reads": reads,
            "bytes": 16384,
            "sidecar_p50_us": suite.pct(lat, 50) * 1e6, "sidecar_p99_us": suite.pct(lat, 99) * 1e6,
            "raw_p50_us": suite.pct(raw, 50) * 1e6, "raw_p99_us": suite.pct(raw, 99) * 1e6,
            "oracle": "every read: every byte ok"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--memory", choices=("cuda_malloc", "cuda_vmm", HOST), default="cuda_malloc")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--latency-reads", type=int, default=200)
    ap.add_argument("--json", default=None, help="append each figure as a JSON line here")
    ap.add_argument("--dry-run", action="store_true",
                    help="parse the arguments, load the modules, write a dry-run record, exit")
    args = ap.parse_args(argv)
    if args.mib < 1 or args.repeats < 1 or args.latency_reads < 1:
        ap.error("--mib, --repeats and --latency-reads must be at least 1")
    if args.dry_run:
        import suite  # noqa: F401  (what a real run imports, without touching CUDA)

        import kvsidecar.sim.cluster
        import kvsidecar.sim.raw_nixl  # noqa: F401

        append(args.json, {"what": "dry-run", "script": "gpu_figures", "args": vars(args)})
        return 0
    device: int | None = None
    if args.memory != HOST:
        why = gpu_e2e.no_gpu()
        if why is not None:
            print(f"gpu_figures: no CUDA GPU here ({why}); --memory {args.memory} needs one",
                  file=sys.stderr)
            return 2
        device = args.device
    from kvsidecar.sim.cluster import SidecarProcess

    workdir = Path(tempfile.mkdtemp(prefix="kvs-gpu-fig-"))
    extra = [] if device is None else ["--device", f"cuda:{device}"]
    sidecars = [SidecarProcess(workdir, name, args=["--metrics-port", "0", "--engine-lease",
                                                    "600", *extra]) for name in ("p0", "d0")]
    ok = True
    try:
        for s in sidecars:
            s.start()
        p0, d0 = sidecars
        runs: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            ("bandwidth", lambda: bulk(p0, d0, args.memory, device, args.mib, args.repeats)),
            ("latency", lambda: latency(p0, d0, args.memory, device, args.latency_reads))]
        for name, run in runs:
            try:
                append(args.json, run())
            except Exception as e:  # one figure failing does not cost the other
                ok = False
                append(args.json, {"what": name, "memory": args.memory, "ucx": ucx_setting(),
                                   "error": f"{type(e).__name__}: {e}",
                                   "logs": {s.name: s.read_log()[-3000:] for s in sidecars}})
    finally:
        for s in sidecars:
            s.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
