"""Start-up transport self-check: which path do host-memory READs really take?

A prediction from ``UCX_TLS`` (``transport_note``) is not proof. The check
runs a real loopback NIXL READ between two agents of a child process with
``UCX_PROTO_INFO=y``, reads UCX's own protocol table for "remote memory read"
out of the child's output, checks the bytes and measures bandwidth. A child
process because UCX prints its tables with C ``fprintf`` on the process's
stdout: capturing that inside the daemon would mean redirecting file
descriptor 1, where the READY line goes.

The result feeds the log, metrics and ``/readyz``: a TCP path ("software
emulation" over tcp, about 5x slower than CMA) fails readiness unless the
operator allowed it, since it usually means a container without
``CAP_SYS_PTRACE``/shared PID namespace or ``UCX_TLS`` set wrongly.

Pure parts (:func:`read_transports`, :func:`classify`, :func:`judge`) carry
the logic; :func:`run_check` is the thin process shell and :func:`_loopback`
the child's body.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass

from kvsidecar.daemon.transport.gpu_facts import DeviceFacts, expected_vram_path, judge_vram

#: Transport name prefix (UCX's "tl/device") -> the path operators care about.
PATHS: dict[str, str] = {
    "cma": "cma", "knem": "cma", "xpmem": "shm", "posix": "shm", "sysv": "shm",
    "cuda_ipc": "cuda_ipc", "cuda_copy": "cuda_copy", "rc": "rdma", "rc_mlx5": "rdma",
    "rc_verbs": "rdma", "dc": "rdma", "dc_mlx5": "rdma", "ud": "rdma", "ud_mlx5": "rdma",
    "ud_verbs": "rdma", "gga": "rdma", "srd": "rdma", "tcp": "tcp", "self": "self",
}
#: Paths that copy without a socket in between.
ZERO_COPY = frozenset({"cma", "shm", "cuda_ipc", "rdma", "self"})
#: ``--transport-check`` values.
MODES = ("require-zero-copy", "allow-tcp", "off")

_ROW = re.compile(r"\|\s*[0-9.]+\s*(?:\.\.\s*\S+)?\s*\|[^|]*\|\s*([^|]+?)\s*\|")
_TITLE = re.compile(r"\|\s*(.*?)\s*\|\s*$")


@dataclass(frozen=True)
class CheckResult:
    """What the self-check found; ``passed`` already applies the mode."""

    path: str  # cma, shm, rdma, cuda_ipc, tcp, unknown, error
    transports: tuple[str, ...]
    bandwidth_bytes_s: float
    nbytes: int
    passed: bool
    detail: str

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def read_transports(ucx_output: str) -> tuple[str, ...]:
    """The transports (``cma/memory``, ``tcp/lo``...) UCX lists in its
    "remote memory read" protocol tables, in order, without repeats."""
    out: list[str] = []
    in_read = False
    for line in ucx_output.splitlines():
        body = line.split("]", 2)[-1] if line.startswith("[") else line
        title = _TITLE.search(body)
        if "remote memory read" in body:
            in_read = True
            continue
        if title and ("remote memory" in body or "active message" in body
                      or "cfg#" in body):
            in_read = False
            continue
        if in_read:
            m = _ROW.search(body)
            if m:
                for tl in re.split(r"[,\s]+", m.group(1)):
                    if "/" in tl and tl not in out:
                        out.append(tl)
    return tuple(out)


def classify(transports: tuple[str, ...]) -> str:
    """The path of the READs: the slowest transport UCX listed for them
    (a read table that includes tcp anywhere can end up on tcp)."""
    paths = [PATHS.get(t.split("/", 1)[0], "unknown") for t in transports]
    if not paths:
        return "unknown"
    for worst in ("tcp", "unknown"):
        if worst in paths:
            return worst
    return paths[0]


def judge(path: str, mode: str) -> tuple[bool, str]:
    """Does this path pass in this mode? With a reason operators can act on."""
    if path in ZERO_COPY:
        return True, f"host-memory READs take the zero-copy {path} path"
    if path == "tcp" and mode == "allow-tcp":
        return True, "host-memory READs go over tcp (allowed by --transport-check allow-tcp)"
    if path == "tcp":
        return False, ("host-memory READs go over tcp, not zero-copy: check UCX_TLS and that "
                       "the sidecar may use process_vm_readv (same PID namespace as the engine, "
                       "ptrace scope / CAP_SYS_PTRACE); pass --transport-check allow-tcp to "
                       "accept it")
    return False, f"cannot tell which path READs take ({path})"


async def run_check(mode: str, nbytes: int = 32 << 20, timeout_s: float = 120.0,
                    device: int | None = None) -> CheckResult:
    """Run the loopback check in a child process and judge it; with ``device``
    the READ is between two buffers on that GPU (VRAM), judged against what the
    device's facts say should be possible (``gpu_facts``)."""
    env = {**os.environ, "UCX_PROTO_INFO": "y", "KVSIDECAR_CHECK_BYTES": str(nbytes),
           "KVSIDECAR_CHECK_DEVICE": "" if device is None else str(device)}
    env.pop("UCX_LOG_FILE", None)
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvsidecar.daemon.transport.check", env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            raw, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            return CheckResult("error", (), 0.0, nbytes, False,
                               f"loopback READ did not finish within {timeout_s:.0f} s")
        except asyncio.CancelledError:  # the daemon stops: leave no child behind
            proc.kill()
            await asyncio.shield(proc.wait())
            raise
    except OSError as e:
        return CheckResult("error", (), 0.0, nbytes, False, f"cannot run the check: {e}")
    text = raw.decode(errors="replace")
    verdict = _last_json(text)
    if proc.returncode != 0 or verdict is None or not verdict.get("ok"):
        why = (verdict or {}).get("error") or text.strip().splitlines()[-1:] or ["no output"]
        return CheckResult("error", (), 0.0, nbytes, False, f"loopback READ failed: {why}")
    transports = read_transports(text)
    path = classify(transports)
    facts = verdict.get("facts")
    if device is not None and isinstance(facts, dict):
        known = {k: v for k, v in facts.items() if k in DeviceFacts.__dataclass_fields__}
        df = DeviceFacts(**known)
        expected, why = expected_vram_path(
            df, get_zcopy=os.environ.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "auto"))
        passed, detail = judge_vram(path, expected, mode)
        detail = (f"{detail} (expected: {expected or 'nothing zero-copy'}, {why}; "
                  f"UCX {df.ucx_version or '?'}, dma-buf {df.dma_buf}, GPUDirect RDMA "
                  f"{df.gpudirect_rdma}, VMM RDMA {df.vmm_rdma}, nvidia_peermem "
                  f"{df.nvidia_peermem}, NVLinks {df.nvlinks})")
    else:
        passed, detail = judge(path, mode)
        if verdict.get("ucx"):
            detail = f"{detail} (UCX {verdict.get('ucx')})"
    bandwidth = verdict.get("bandwidth")
    bw = float(bandwidth) if isinstance(bandwidth, (int, float)) else 0.0
    return CheckResult(path, transports, bw, nbytes, passed, detail)


def _last_json(text: str) -> dict[str, object] | None:
    for line in reversed(text.splitlines()):
        if line.startswith("KVSIDECAR CHECK "):
            try:
                got = json.loads(line[len("KVSIDECAR CHECK "):])
            except ValueError:
                return None
            return got if isinstance(got, dict) else None
    return None


class _Buffers:
    """The two buffers of the loopback READ: host arrays, or (``device`` set)
    two cuMemAlloc allocations on that GPU filled from / read back to host."""

    def __init__(self, nbytes: int, device: int | None) -> None:
        import numpy as np

        self.device = device
        self.src_host = np.frombuffer(os.urandom(4096), np.uint8).repeat(
            max(1, nbytes // 4096))[:nbytes].copy()
        self.n = int(self.src_host.size)
        self.mem = "DRAM" if device is None else "VRAM"
        self.dev_id = 0 if device is None else device
        if device is None:
            self.dst_host = np.zeros_like(self.src_host)
            self.src, self.dst = self.src_host.ctypes.data, self.dst_host.ctypes.data
            return
        from kvsidecar.ipc import cuda

        cuda.make_current(device)
        self._drv = drv = cuda.driver()
        self.src = int(cuda.check(drv.cuMemAlloc(self.n), "cuMemAlloc"))
        self.dst = int(cuda.check(drv.cuMemAlloc(self.n), "cuMemAlloc"))
        cuda.check(drv.cuMemcpyHtoD(self.src, self.src_host.ctypes.data, self.n), "HtoD")
        cuda.check(drv.cuMemsetD8(self.dst, 0, self.n), "cuMemsetD8")
        # Both writes may still run when their calls return (pageable HtoD,
        # memset); the READ runs on UCX's streams, unordered with them.
        cuda.check(drv.cuCtxSynchronize(), "cuCtxSynchronize")

    def same(self) -> bool:
        import numpy as np

        if self.device is None:
            return bool(np.array_equal(self.src_host, self.dst_host))
        from kvsidecar.ipc import cuda

        back = np.zeros_like(self.src_host)
        cuda.check(self._drv.cuMemcpyDtoH(back.ctypes.data, self.dst, self.n), "DtoH")
        return bool(np.array_equal(self.src_host, back))


def _loopback(nbytes: int, device: int | None = None) -> dict[str, object]:
    """Child body: agent ``a`` READs ``nbytes`` from agent ``b``; best of three.
    Host memory, or GPU memory of ``device`` (VRAM descriptors with its id)."""
    from nixl._api import nixl_agent, nixl_agent_config

    from kvsidecar.daemon.transport.gpu_facts import ucx_version

    bufs = _Buffers(nbytes, device)
    cfg = nixl_agent_config(backends=["UCX"])
    tag = f"{os.getpid()}"
    a, b = nixl_agent(f"kvs-check-a-{tag}", cfg), nixl_agent(f"kvs-check-b-{tag}", cfg)
    n, mem, dev = bufs.n, bufs.mem, bufs.dev_id
    a.register_memory(a.get_reg_descs([(bufs.dst, n, dev, "")], mem))
    b.register_memory(b.get_reg_descs([(bufs.src, n, dev, "")], mem))
    peer = a.add_remote_agent(b.get_agent_metadata())
    local = a.get_xfer_descs([(bufs.dst, n, dev)], mem)
    remote = a.get_xfer_descs([(bufs.src, n, dev)], mem)
    best = float("inf")
    for _ in range(3):
        handle = a.initialize_xfer("READ", local, remote, peer, b"")
        t0 = time.perf_counter()
        state = a.transfer(handle)
        deadline = time.monotonic() + 60
        while state in ("PROC", "INIT") and time.monotonic() < deadline:
            state = a.check_xfer_state(handle)
        best = min(best, time.perf_counter() - t0)
        a.release_xfer_handle(handle)
        if state != "DONE":
            return {"ok": False, "error": f"READ ended in state {state}"}
    if not bufs.same():
        return {"ok": False, "error": "bytes read differ from the source"}
    out: dict[str, object] = {"ok": True, "bandwidth": n / best, "ucx": ucx_version()}
    if device is not None:
        from kvsidecar.daemon.transport.gpu_facts import gather

        out["facts"] = gather(device).as_dict()
    return out


_USAGE = """usage: python -m kvsidecar.daemon.transport.check

The start-up transport self-check's child process (kvsidecar serve runs it):
one loopback NIXL READ between two agents, reported as one line on stdout,
KVSIDECAR CHECK {"ok": ..., ...}. Takes no arguments; the environment
KVSIDECAR_CHECK_BYTES (default 32 MiB) and KVSIDECAR_CHECK_DEVICE (a GPU
index; unset: host memory) set what it reads, UCX_TLS what UCX may use."""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args:
        if args[0] in ("-h", "--help"):
            print(_USAGE)
            return 0
        print(f"{_USAGE.splitlines()[0]}\ncheck: error: takes no arguments, got "
              f"{' '.join(args)}", file=sys.stderr)
        return 2
    try:
        device = os.environ.get("KVSIDECAR_CHECK_DEVICE", "")
        verdict = _loopback(int(os.environ.get("KVSIDECAR_CHECK_BYTES", str(32 << 20))),
                            int(device) if device else None)
    except Exception as e:  # reported to the parent, which decides
        verdict = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    sys.stdout.flush()
    print("KVSIDECAR CHECK " + json.dumps(verdict), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
