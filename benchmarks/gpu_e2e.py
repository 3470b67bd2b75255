"""GPU end-to-end check: real sidecars on real GPUs, every byte checked.

One command (``.venv/bin/python benchmarks/gpu_e2e.py``; needs the gpu extra,
``pip install -e '.[gpu]'``, and a CUDA torch):

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
(``tests/test_gpu_e2e_script.py`` checks that).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path


def _no_gpu() -> str | None:
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


def _d2d_gbps(nbytes: int, src_dev: int, dst_dev: int) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src_dev}")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst_dev}")
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize(src_dev)
        torch.cuda.synchronize(dst_dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(dst_dev)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _transport(device: int) -> str:
    from kvsidecar.daemon.transport.check import run_check

    r = asyncio.run(run_check("require-zero-copy", 256 << 20, device=device))
    verdict = "zero-copy" if r.passed else "NOT zero-copy"
    return (f"cuda:{device}: {r.path} ({','.join(r.transports) or '-'}), "
            f"{r.bandwidth_bytes_s / 1e9:.1f} GB/s loopback, {verdict}: {r.detail}")


def _case(workdir: Path, label: str, p_dev: int, d_dev: int, p_tp: int, d_tp: int,
          memory: str, requests: int, blocks: int) -> dict[str, object]:
    from kvsidecar.sim.cluster import SidecarProcess, SimEngine
    from kvsidecar.sim.models import hybrid
    from kvsidecar.sim.oracle import Request

    tag = f"{label}-{p_tp}p{d_tp}d".replace(" ", "")
    ps = [SidecarProcess(workdir, f"{tag}-p{i}", args=["--device", f"cuda:{p_dev}"])
          for i in range(p_tp)]
    ds = [SidecarProcess(workdir, f"{tag}-d{i}", args=["--device", f"cuda:{d_dev}"])
          for i in range(d_tp)]
    started: list[SidecarProcess] = []
    engines: list[SimEngine] = []
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
        for s in sents:
            D.start_read(s)
        got = D.wait_for([s.request_id for s in sents])
        elapsed = time.perf_counter() - t0
        bad = {rid: {c.kind for c in cs.values()} for rid, cs in got.items()
               if {c.kind for c in cs.values()} != {"received"}}
        problems = [p for s in sents for p in D.verify(s.request_id)]
        nbytes = sum(c.nbytes for cs in got.values() for c in cs.values())
        return {"case": f"{label}, hybrid P tp{p_tp} -> D tp{d_tp}", "bytes": nbytes,
                "seconds": elapsed, "gbps": nbytes / elapsed / 1e9,
                "d2d_gbps": _d2d_gbps(max(nbytes, 1 << 20), p_dev, d_dev),
                "failed": bad, "oracle_problems": problems[:5]}
    finally:
        for e in engines:
            e.close()
        for s in started:
            s.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--memory", choices=("cuda_malloc", "cuda_vmm"), default="cuda_malloc")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=256)
    args = ap.parse_args(argv)
    why = _no_gpu()
    if why is not None:
        print(f"gpu_e2e: no CUDA GPU here ({why}); this benchmark needs one GPU (two for the "
              "cross-GPU case) and the gpu extra: pip install -e '.[gpu]'", file=sys.stderr)
        return 2
    n = _gpu_count()
    pairs = [("1 GPU", 0, 0)] + ([("2 GPUs", 0, 1)] if n >= 2 else [])
    print(f"GPUs: {n}; memory: {args.memory}")
    for dev in sorted({d for _, p, q in pairs for d in (p, q)}):
        print("transport", _transport(dev))
    workdir = Path(tempfile.mkdtemp(prefix="kvs-gpu-e2e-"))
    ok = True
    try:
        print("| case | bytes | time | GB/s | torch d2d GB/s | oracle |")
        print("| --- | --- | --- | --- | --- | --- |")
        for label, p_dev, d_dev in pairs:
            for p_tp, d_tp in ((1, 2), (2, 1)):
                r = _case(workdir, label, p_dev, d_dev, p_tp, d_tp, args.memory, args.requests,
                          args.blocks)
                fine = not r["failed"] and not r["oracle_problems"]
                ok &= fine
                print(f"| {r['case']} | {r['bytes']} | {float(r['seconds']):.3f} s | "  # type: ignore[arg-type]
                      f"{float(r['gbps']):.2f} | {float(r['d2d_gbps']):.1f} | "  # type: ignore[arg-type]
                      f"{'every byte ok' if fine else r['failed'] or r['oracle_problems']} |")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
