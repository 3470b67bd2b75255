"""GPU end-to-end check: real sidecars on real GPUs, every byte checked.

One command (``.venv/bin/python benchmarks/gpu_e2e.py``; needs the gpu extra,
``pip install -e '.[gpu]'``, and a CUDA torch; ``scripts/gpu-check.sh`` runs it
with ``--json``, which appends each case as one JSON line, and
``--no-transport``, having run the check as a step of its own):

* for one GPU (P and D sidecars on cuda:0) and, when present, two GPUs (P on
  cuda:0, D on cuda:1);
* for hetero-TP hybrid attention + Mamba2 layouts (P tp1 -> D tp2, P tp2 -> D tp1);
* the sidecars allocate the engines' KV memory on their GPU (``--memory``:
  cuda_malloc = legacy IPC handle, cuda_vmm = VMM fd over SCM_RIGHTS), the
  engines (this process) map it zero-copy, fill P's pages with the LAYOUT.md
  oracle's state, D reads, and every byte of D's pages is checked;
* bandwidth: bytes read / (first read request -> last completion), against a
  device-to-device ``torch`` copy of the same bytes between the same GPUs;
* the transport: the VRAM self-check of each GPU (UCX protocol table, device
  facts, UCX version).

Without a GPU it prints one line saying so and exits with status 2
(``tests/e2e/test_gpu_e2e_script.py`` checks that). ``--memory memfd`` runs the same
cases on host memory without a GPU (sidecars without ``--device``, a numpy
copy as the baseline): the CPU rehearsal the test suite runs.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import append

HOST = "memfd"


def no_gpu() -> str | None:
    """Why CUDA work cannot run here, or None when it can."""
    try:
        from kvsidecar.ipc import cuda

        drv = cuda.driver()
        n = int(cuda.check(drv.cuDeviceGetCount(), "cuDeviceGetCount"))
    except Exception as e:  # CudaError, or the binding itself missing
        return str(e)
    if n < 1:
        return "the CUDA driver sees no GPU"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} has no CUDA (a CPU build)"
    return None


def _gpu_count() -> int:
    import torch

    return int(torch.cuda.device_count())


def d2d_gbps(nbytes: int, src_dev: int, dst_dev: int, repeats: int = 5) -> float:
    """GB/s of the best of ``repeats`` ``torch`` copies of ``nbytes`` between two GPUs
    (or on one): bytes copied per second."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src_dev}")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst_dev}")
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize(src_dev)
        torch.cuda.synchronize(dst_dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(dst_dev)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def copy_gbps(nbytes: int, src_dev: int | None, dst_dev: int | None,
              repeats: int = 5) -> tuple[float, str]:
    """The copy baseline, GB/s of the best of ``repeats``, and what it was: a
    ``torch`` copy between the GPUs, or (devices None) a numpy copy in host memory."""
    if src_dev is None or dst_dev is None:
        import numpy as np

        src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            best = min(best, time.perf_counter() - t0)
        return nbytes / best / 1e9, "numpy host copy"
    return d2d_gbps(nbytes, src_dev, dst_dev, repeats), "torch device-to-device copy"


def _transport(device: int) -> str:
    from kvsidecar.daemon.transport.check import run_check

    r = asyncio.run(run_check("require-zero-copy", 256 << 20, device=device))
    verdict = "zero-copy" if r.passed else "NOT zero-copy"
    return (f"cuda:{device}: {r.path} ({','.join(r.transports) or '-'}), "
            f"{r.bandwidth_bytes_s / 1e9:.1f} GB/s loopback, {verdict}: {r.detail}")


def _case(workdir: Path, label: str, p_dev: int | None, d_dev: int | None, p_tp: int,
          d_tp: int, memory: str, requests: int, blocks: int) -> dict[str, object]:
    """One direction: P (``p_tp`` sidecars on ``p_dev``) -> D (``d_tp`` on ``d_dev``);
    devices None: host memory, sidecars without ``--device``. A case that
    raises returns its error and the tails of its sidecars' logs."""
    from kvsidecar.sim.cluster import SidecarProcess, SimEngine
    from kvsidecar.sim.models import hybrid
    from kvsidecar.sim.oracle import Request

    tag = f"{label}-{p_tp}p{d_tp}d".replace(" ", "")

    def dev(d: int | None) -> list[str]:
        return [] if d is None else ["--device", f"cuda:{d}"]

    ps = [SidecarProcess(workdir, f"{tag}-p{i}", args=dev(p_dev)) for i in range(p_tp)]
    ds = [SidecarProcess(workdir, f"{tag}-d{i}", args=dev(d_dev)) for i in range(d_tp)]
    started: list[SidecarProcess] = []
    engines: list[SimEngine] = []
    case = f"{label}, hybrid P tp{p_tp} -> D tp{d_tp}"
    try:
        for s in ps + ds:
            s.start()
            started.append(s)
        P = SimEngine(f"{tag}-P", hybrid, p_tp, blocks, ps, memory=memory)  # type: ignore[arg-type]
        engines.append(P)
        D = SimEngine(f"{tag}-D", hybrid, d_tp, blocks, ds, memory=memory)  # type: ignore[arg-type]
        engines.append(D)
        warm = P.prefill("warm", Request(seed=1, prompt_tokens=32))
        D.start_read(warm)
        D.wait_for(["warm"])
        sents = [P.prefill(f"r{i}", Request(seed=10 + i, prompt_tokens=64 + 37 * i))
                 for i in range(requests)]
        t0 = time.perf_counter()
        for sent in sents:
            D.start_read(sent)
        got = D.wait_for([s.request_id for s in sents])
        elapsed = time.perf_counter() - t0
        bad = {rid: {c.kind for c in cs.values()} for rid, cs in got.items()
               if {c.kind for c in cs.values()} != {"received"}}
        problems = [p for rid in ["warm", *(s.request_id for s in sents)]
                    for p in D.verify(rid)]
        nbytes = sum(c.nbytes for cs in got.values() for c in cs.values())
        copy, copy_kind = copy_gbps(max(nbytes, 1 << 20), p_dev, d_dev)
        return {"what": "case", "memory": memory, "case": case, "requests": len(sents),
                "bytes": nbytes, "seconds": elapsed, "gbps": nbytes / elapsed / 1e9,
                "d2d_gbps": copy, "copy": copy_kind, "failed": bad,
                "oracle_problems": problems[:5],
                "oracle": "every byte ok" if not bad and not problems else "WRONG"}
    except Exception as err:  # reported, and the next case still runs
        return {"what": "case", "memory": memory, "case": case,
                "error": f"{type(err).__name__}: {err}",
                "logs": {s.name: s.read_log()[-3000:] for s in ps + ds}}
    finally:
        for e in engines:
            e.close()
        for s in started:
            s.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--memory", choices=("cuda_malloc", "cuda_vmm", HOST), default="cuda_malloc")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--directions", default="1x2,2x1",
                    help="P tp x D tp of each case, comma-separated (default: 1x2,2x1)")
    ap.add_argument("--json", default=None, help="append each case as a JSON line here")
    ap.add_argument("--no-transport", action="store_true",
                    help="skip the VRAM transport check (run as a step of its own)")
    ap.add_argument("--dry-run", action="store_true",
                    help="parse the arguments, load the modules, write a dry-run record, exit")
    args = ap.parse_args(argv)
    if args.requests < 1 or args.blocks < 1:
        ap.error("--requests and --blocks must be at least 1")
    try:
        directions = [(int(p), int(d)) for p, d in
                      (x.split("x") for x in args.directions.split(","))]
    except ValueError:
        ap.error(f"--directions {args.directions!r}: expected e.g. 1x2,2x1")
    if not directions or min(n for pd in directions for n in pd) < 1:
        ap.error("--directions: every TP size must be at least 1")
    if args.dry_run:
        import kvsidecar.sim.cluster
        import kvsidecar.sim.oracle  # noqa: F401

        append(args.json, {"what": "dry-run", "script": "gpu_e2e", "args": vars(args)})
        return 0
    pairs: list[tuple[str, int | None, int | None]]
    if args.memory == HOST:
        pairs = [("host memory", None, None)]
        print(f"host memory rehearsal: memory {HOST}")
    else:
        why = no_gpu()
        if why is not None:
            print(f"gpu_e2e: no CUDA GPU here ({why}); this benchmark needs one GPU (two for "
                  "the cross-GPU case) and the gpu extra: pip install -e '.[gpu]'",
                  file=sys.stderr)
            return 2
        n = _gpu_count()
        pairs = [("1 GPU", 0, 0)]
        if n >= 2:
            pairs.append(("2 GPUs", 0, 1))
        print(f"GPUs: {n}; memory: {args.memory}")
        if not args.no_transport:
            for dev in sorted({d for _, p, q in pairs for d in (p, q) if d is not None}):
                print("transport", _transport(dev))
    workdir = Path(tempfile.mkdtemp(prefix="kvs-gpu-e2e-"))
    ok = True
    try:
        print("| case | bytes | time | GB/s | copy GB/s | oracle |")
        print("| --- | --- | --- | --- | --- | --- |")
        for label, p_dev, d_dev in pairs:
            for p_tp, d_tp in directions:
                r = _case(workdir, label, p_dev, d_dev, p_tp, d_tp, args.memory,
                          args.requests, args.blocks)
                append(args.json, r, echo=False)
                if "error" in r:
                    ok = False
                    print(f"| {r['case']} | - | - | - | - | FAILED: {r['error']} |")
                    for name, log in r["logs"].items():  # type: ignore[attr-defined]
                        print(f"--- {name} log (tail) ---\n{log}")
                    continue
                fine = r["oracle"] == "every byte ok"
                ok &= fine
                print(f"| {r['case']} | {r['bytes']} | {float(r['seconds']):.3f} s | "  # type: ignore[arg-type]
                      f"{float(r['gbps']):.2f} | {float(r['d2d_gbps']):.1f} | "  # type: ignore[arg-type]
                      f"{'every byte ok' if fine else r['failed'] or r['oracle_problems']} |")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
