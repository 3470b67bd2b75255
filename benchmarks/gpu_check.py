"""The Python steps of ``scripts/gpu-check.sh`` and its summary.

    python benchmarks/gpu_check.py smi --json PATH
    python benchmarks/gpu_check.py env --json PATH [--manifest .whl/MANIFEST.txt]
    python benchmarks/gpu_check.py transport --json PATH [--device 0] [--mib 256] [--dry-run]
    python benchmarks/gpu_check.py junit XML --json PATH
    python benchmarks/gpu_check.py summary OUTDIR

Each step appends JSON lines (``{"what": ...}`` records) to ``--json``; the
shell script records each step's outcome in ``OUTDIR/steps.tsv``; ``summary``
renders both as ``OUTDIR/summary.md``, shaped to be pasted into
``benchmarks/RESULTS-gpu.md``. It renders what was recorded and nothing else:
a step that did not finish leaves its rows out and its outcome in the steps
table, and a dry run says so at the top.

Facts are gathered one by one: a fact that cannot be read is recorded as the
error that stopped it, and the others are still read.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: Modules whose CUDA driver API (``cuda.bindings``) use the GPU run depends on.
CUDA_SOURCES = ("ipc/cuda.py", "daemon/cuda_device.py", "daemon/transport/gpu_facts.py",
                "daemon/transport/check.py", "sim/raw_nixl.py")
#: Variable names that hold a binding module there -> that module.
_BINDING_NAMES = {"drv": "driver", "_drv": "driver", "nv": "nvml"}
_DEVICE_ATTRIBUTE = re.compile(r"^CU_DEVICE_ATTRIBUTE_[A-Z0-9_]+$")
#: Packages whose versions the environment facts name.
PACKAGES = ("nixl", "nixl-cu13", "nixl-cu12", "msgspec", "pyzmq", "numpy", "uvloop",
            "prometheus-client", "torch", "cuda-bindings", "pytest")


def append(path: str | None, record: dict[str, Any], *, echo: bool = True) -> None:
    """Append one record to ``path`` as one JSON line (and print it, with ``echo``)."""
    line = json.dumps(record, default=str)
    if echo:
        print(line, flush=True)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


# -- the CUDA driver API names our code uses ------------------------------------------------------

def binding_names(sources: Iterable[str]) -> set[tuple[str, ...]]:
    """``(module, name[, member])`` for every ``drv.X``, ``drv.X.Y``, ``self._drv.X``
    and ``nv.X`` in the sources, and ``("driver", "CUdevice_attribute", A)`` for
    every string constant ``CU_DEVICE_ATTRIBUTE_...`` (looked up with getattr)."""
    out: set[tuple[str, ...]] = set()
    for text in sources:
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and _DEVICE_ATTRIBUTE.match(node.value):
                out.add(("driver", "CUdevice_attribute", node.value))
            if not isinstance(node, ast.Attribute):
                continue
            base = node.value
            holder = (base.id if isinstance(base, ast.Name)
                      else base.attr if isinstance(base, ast.Attribute) else None)
            module = _BINDING_NAMES.get(holder or "")
            if module is not None:
                out.add((module, node.attr))
    # members: drv.X.Y where drv.X was found
    for text in sources:
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
                inner = node.value
                root = inner.value
                name = (root.id if isinstance(root, ast.Name)
                        else root.attr if isinstance(root, ast.Attribute) else None)
                module = _BINDING_NAMES.get(name or "")
                if module is not None and inner.attr[:1].isupper():
                    out.add((module, inner.attr, node.attr))
    return out


def missing_names(modules: dict[str, Any], names: Iterable[tuple[str, ...]]) -> list[str]:
    """The names (dotted) that the given binding modules lack, sorted."""
    out = []
    for module, *path in names:
        obj = modules.get(module)
        if obj is None:
            continue
        for part in path:
            if not hasattr(obj, part):
                out.append(".".join([module, *path]))
                break
            obj = getattr(obj, part)
    return sorted(set(out))


def binding_calls(sources: Iterable[str]) -> set[tuple[str, str, int]]:
    """``(module, function, positional arguments)`` of every call ``drv.f(...)``
    (and ``self._drv.f``, ``nv.f``) in the sources."""
    out: set[tuple[str, str, int]] = set()
    for text in sources:
        for node in ast.walk(ast.parse(text)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            base = node.func.value
            holder = (base.id if isinstance(base, ast.Name)
                      else base.attr if isinstance(base, ast.Attribute) else None)
            module = _BINDING_NAMES.get(holder or "")
            if module is not None and node.func.attr[:1].islower() and not node.keywords:
                out.add((module, node.func.attr, len(node.args)))
    return out


def arity_mismatches(modules: dict[str, Any], calls: Iterable[tuple[str, str, int]]) -> list[str]:
    """Calls whose argument count the binding's signature does not accept."""
    import inspect

    out = []
    for module, name, nargs in calls:
        fn = getattr(modules.get(module), name, None)
        if fn is None:
            continue  # reported by missing_names
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            continue  # no signature to check against
        try:
            sig.bind(*([None] * nargs))
        except TypeError:
            out.append(f"{module}.{name}: called with {nargs} arguments, takes {sig}")
    return sorted(out)


def driver_api_problems() -> list[str]:
    """Names our CUDA code uses that this cuda-bindings lacks, and calls whose
    argument count its signatures refuse (what changed between CUDA 12 and 13
    would show here first); needs cuda-bindings, not a GPU."""
    from cuda.bindings import driver

    modules: dict[str, Any] = {"driver": driver}
    with contextlib.suppress(ImportError):
        from cuda.bindings import nvml

        modules["nvml"] = nvml
    sources = [(ROOT / s).read_text() for s in CUDA_SOURCES]
    return [*(f"missing: {n}" for n in missing_names(modules, binding_names(sources))),
            *arity_mismatches(modules, binding_calls(sources))]


# -- steps ---------------------------------------------------------------------------------------

def _fact(out: dict[str, Any], name: str, read: Callable[[], Any]) -> None:
    try:
        out[name] = read()
    except Exception as e:  # recorded, and the other facts are still read
        out[name] = f"error: {type(e).__name__}: {e}"


def _version(name: str) -> str:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "not installed"


def _torch() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda,
                            "cuda_available": torch.cuda.is_available()}
    if info["cuda_available"]:
        info["devices"] = [
            {"name": torch.cuda.get_device_name(i),
             "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
             "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
            for i in range(torch.cuda.device_count())]
    return info


def _cuda_driver_version() -> str:
    from kvsidecar.ipc import cuda

    v = int(cuda.check(cuda.driver().cuDriverGetVersion(), "cuDriverGetVersion"))
    return f"{v // 1000}.{v % 1000 // 10}"


def _nixl() -> dict[str, Any]:
    import nixl._api as api

    from kvsidecar.daemon.transport.gpu_facts import ucx_version

    backend = api.__name__.split(".")[0]
    libs = Path(sys.modules[backend].__file__ or "").parent.parent / f"{backend}.libs" / "ucx"
    modules = sorted(m.group(1) for p in libs.glob("libuct_*.so*")
                     if (m := re.match(r"libuct_(\w+?)\.so", p.name)))
    return {"backend": backend, "ucx_version": ucx_version(), "ucx_modules": modules}


def _device_facts() -> dict[str, Any]:
    from kvsidecar.daemon.transport.gpu_facts import gather

    return gather(0).as_dict()


def _manifest(path: str | None) -> str:
    if not path or not os.path.exists(path):
        return "no manifest (wheels not made by scripts/gpu-wheels.sh)"
    return "; ".join(line.strip() for line in open(path) if line.strip())


def env_facts(manifest: str | None) -> dict[str, Any]:
    """Everything about this machine the results depend on (module docstring)."""
    out: dict[str, Any] = {"what": "facts"}
    _fact(out, "python", lambda: f"{platform.python_version()} ({sys.executable})")
    _fact(out, "kernel", platform.release)
    _fact(out, "versions", lambda: {n: _version(n) for n in PACKAGES})
    _fact(out, "torch", _torch)  # before nixl: NIXL picks its CUDA backend from torch's CUDA
    _fact(out, "cuda_driver", _cuda_driver_version)
    _fact(out, "nixl", _nixl)
    _fact(out, "UCX_TLS", lambda: os.environ.get("UCX_TLS", "unset (UCX uses every transport "
                                                            "it finds)"))
    _fact(out, "environment", lambda: {k: v for k, v in sorted(os.environ.items())
                                       if k.startswith(("UCX_", "NIXL_", "CUDA_", "NCCL_"))})
    _fact(out, "device_facts", _device_facts)
    _fact(out, "driver_api_problems", driver_api_problems)
    _fact(out, "wheels", lambda: _manifest(manifest))
    return out


def smi() -> tuple[dict[str, Any], int]:
    """nvidia-smi's summary and query; a hung nvidia-smi is the shell step's timeout."""
    query = "name,driver_version,memory.total,pci.bus_id,compute_cap"
    try:
        full = subprocess.run(["nvidia-smi"], capture_output=True, text=True)
        q = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                           capture_output=True, text=True)
    except OSError as e:
        return {"what": "smi", "error": f"nvidia-smi: {e}"}, 1
    print(full.stdout + full.stderr)
    rows = [dict(zip(query.split(","), (c.strip() for c in line.split(","))))
            for line in q.stdout.splitlines() if line.strip()]
    rec: dict[str, Any] = {"what": "smi", "gpus": rows}
    if q.returncode != 0:
        rec["error"] = (q.stderr or q.stdout).strip()[-500:]
    return rec, 0 if q.returncode == 0 else 1


async def _checks(device: int | None, nbytes: int) -> list[dict[str, Any]]:
    from kvsidecar.daemon.transport.check import run_check

    out = []
    # UCX leaves cuda_ipc GETs (READs) off without NVLink unless asked: both, same run.
    for variant in ("default", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y"):
        saved = os.environ.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY")
        if variant != "default":
            os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = "y"
        try:
            r = await run_check("require-zero-copy", nbytes, device=device)
        finally:
            if saved is None:
                os.environ.pop("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", None)
            else:
                os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = saved
        out.append({"what": "transport", "device": "host" if device is None else device,
                    "variant": variant, "path": r.path, "transports": list(r.transports),
                    "gbps": r.bandwidth_bytes_s / 1e9, "bytes": r.nbytes, "passed": r.passed,
                    "detail": r.detail})
    return out


def junit(path: str) -> dict[str, Any]:
    """Counts and outcomes of a pytest JUnit XML report."""
    import xml.etree.ElementTree as ET

    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (el.get("message") or "")[:300]
        cases.append({"name": f"{case.get('classname')}::{case.get('name')}",
                      "outcome": outcome, "message": message})
    counts = {k: sum(c["outcome"] == k for c in cases)
              for k in ("passed", "failed", "error", "skipped")}
    return {"what": "tests", **counts, "cases": cases}


# -- summary -------------------------------------------------------------------------------------

def read_steps(path: Path) -> list[dict[str, str]]:
    """steps.tsv rows (name, limit_s, rc, seconds, outcome), the last row of each step."""
    rows: dict[str, dict[str, str]] = {}
    if path.exists():
        for line in path.read_text().splitlines()[1:]:
            cells = line.split("\t")
            if len(cells) == 5:
                rows[cells[0]] = dict(zip(("name", "limit", "rc", "seconds", "outcome"), cells))
    return list(rows.values())


def read_records(path: Path) -> list[dict[str, Any]]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if isinstance(rec, dict):
                    out.append(rec)
    return out


def _gb(x: Any) -> str:
    return f"{float(x):,.1f}" if isinstance(x, (int, float)) else "?"


def _us(x: Any) -> str:
    return f"{float(x):,.0f} µs" if isinstance(x, (int, float)) else "?"


def _machine(records: Sequence[dict[str, Any]]) -> list[str]:
    facts = next((r for r in records if r.get("what") == "facts"), None)
    smi_rec = next((r for r in records if r.get("what") == "smi"), None)
    out = []
    if smi_rec is not None:
        gpus = smi_rec.get("gpus") or []
        for g in gpus:
            out.append(f"- GPU: {g.get('name', '?')}, {g.get('memory.total', '?')}, compute "
                       f"capability {g.get('compute_cap', '?')}, driver "
                       f"{g.get('driver_version', '?')} (nvidia-smi)")
        if not gpus:
            out.append(f"- GPU: none listed ({smi_rec.get('error', 'nvidia-smi answered')})")
    else:
        out.append("- nvidia-smi: no answer recorded")
    if facts is None:
        return [*out, "- environment facts: not recorded"]
    versions = facts.get("versions")
    v: dict[str, Any] = versions if isinstance(versions, dict) else {}
    torch_info = facts.get("torch")
    if isinstance(torch_info, dict):
        devs = ", ".join(f"{d['name']} (sm {d['capability']}, {d['memory_gib']} GiB)"
                         for d in torch_info.get("devices", []))
        out.append(f"- torch {torch_info.get('version')} (CUDA {torch_info.get('cuda')}), "
                   f"CUDA available: {torch_info.get('cuda_available')}"
                   + (f"; {devs}" if devs else ""))
    else:
        out.append(f"- torch: {torch_info}")
    out.append(f"- CUDA driver API: {facts.get('cuda_driver')}; cuda-bindings "
               f"{v.get('cuda-bindings', '?')}")
    out.append(f"- Python {facts.get('python')}; kernel {facts.get('kernel')}")
    nx = facts.get("nixl")
    if isinstance(nx, dict):
        out.append(f"- NIXL {v.get('nixl', '?')} (backend {nx.get('backend')}), UCX "
                   f"{nx.get('ucx_version') or '?'} (transport modules: "
                   f"{', '.join(nx.get('ucx_modules', [])) or 'none found'})")
    else:
        out.append(f"- NIXL: {nx}")
    out.append(f"- msgspec {v.get('msgspec', '?')}, pyzmq {v.get('pyzmq', '?')}, numpy "
               f"{v.get('numpy', '?')}, uvloop {v.get('uvloop', '?')}")
    out.append(f"- UCX_TLS: {facts.get('UCX_TLS')}; UCX/NIXL/CUDA/NCCL variables: "
               f"{facts.get('environment') or 'none'}")
    out.append(f"- device facts (cuda:0): {facts.get('device_facts')}")
    problems = facts.get("driver_api_problems")
    out.append("- CUDA driver API calls of our code this cuda-bindings would refuse: "
               f"{('; '.join(problems) or 'none') if isinstance(problems, list) else problems}")
    out.append(f"- wheels: {facts.get('wheels')}")
    return out


def render(steps: Sequence[dict[str, str]], records: Sequence[dict[str, Any]],
           when: str) -> str:
    """summary.md from the recorded steps and records (module docstring)."""
    dry = [r for r in records if r.get("what") == "dry-run"] \
        or any(r.get("device") == "host" for r in records if r.get("what") == "transport")
    out = ["# kvsidecar on a GPU (issue #28)", ""]
    if dry:
        out += ["**DRY RUN (`scripts/gpu-check.sh --dry-run`): no CUDA was used; nothing "
                "below is a GPU measurement.**", ""]
    out += [f"Generated by `scripts/gpu-check.sh` ({when}).", "", "## Machine", "",
            *_machine(records), "", "## Steps", "",
            "| step | limit | time | outcome |", "| --- | --- | --- | --- |"]
    for s in steps:
        took = f"{s['seconds']} s" if s["seconds"] not in ("", "-") else "-"
        out.append(f"| {s['name']} | {s['limit']} s | {took} | {s['outcome']} |")
    transport = [r for r in records if r.get("what") == "transport"]
    if transport:
        out += ["", "## Transport check (loopback READ between two buffers, UCX's own "
                "protocol table)", "",
                "| device | UCX setting | path | transports | GB/s | verdict |",
                "| --- | --- | --- | --- | --- | --- |"]
        for r in transport:
            verdict = ("passed" if r.get("passed") else "FAILED") + f": {r.get('detail')}"
            out.append(f"| {r.get('device')} | {r.get('variant')} | {r.get('path')} | "
                       f"{', '.join(r.get('transports', [])) or '-'} | {_gb(r.get('gbps'))} | "
                       f"{verdict} |")
    cases = [r for r in records if r.get("what") == "case"]
    if cases:
        out += ["", "## Sidecars end to end: hybrid attention + Mamba2, every byte checked "
                "against the oracle", "",
                "| memory | case | requests | bytes | time | GB/s | copy GB/s | oracle |",
                "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in cases:
            if "error" in r:
                out.append(f"| {r.get('memory')} | {r.get('case')} | - | - | - | - | - | "
                           f"FAILED: {r['error']} |")
                continue
            oracle = r.get("oracle") if r.get("oracle") == "every byte ok" else \
                f"WRONG: {r.get('failed') or r.get('oracle_problems')}"
            out.append(f"| {r.get('memory')} | {r.get('case')} | {r.get('requests')} | "
                       f"{r.get('bytes')} | {float(r.get('seconds', 0)) * 1e3:.1f} ms | "
                       f"{float(r.get('gbps', 0)):.2f} | {_gb(r.get('d2d_gbps'))} "
                       f"({r.get('copy')}) | {oracle} |")
    figures = [r for r in records if r.get("what") in ("bandwidth", "latency")]
    if figures:
        out += ["", "## Figures, each with its baselines from the same run", "",
                "| memory | UCX | figure | through the sidecars | raw NIXL READ | plain copy | "
                "sidecars vs raw | oracle |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in figures:
            where = f"| {r.get('memory')} | {r.get('ucx', '?')} |"
            if "error" in r:
                out.append(f"{where} {r.get('what')} | FAILED: {r['error']} | - | - | - | - |")
            elif r["what"] == "bandwidth":
                out.append(
                    f"{where} one read of {int(r.get('bytes', 0)) >> 20} MiB, "
                    f"tp1 -> tp1 (median of {r.get('reads')}) | {_gb(r.get('sidecar_gbps'))} "
                    f"GB/s (best {_gb(r.get('sidecar_best_gbps'))}) | "
                    f"{_gb(r.get('raw_gbps'))} GB/s (best {_gb(r.get('raw_best_gbps'))}) | "
                    f"{_gb(r.get('copy_gbps'))} GB/s ({r.get('copy')}) | "
                    f"{float(r.get('ratio', 0)):.2f}x | {r.get('oracle')} |")
            else:
                gap = (r.get("sidecar_p50_us", 0) or 0) - (r.get("raw_p50_us", 0) or 0)
                out.append(
                    f"{where} 1-block (16 KiB) read latency p50 / p99 "
                    f"({r.get('reads')} reads) | {_us(r.get('sidecar_p50_us'))} / "
                    f"{_us(r.get('sidecar_p99_us'))} | {_us(r.get('raw_p50_us'))} / "
                    f"{_us(r.get('raw_p99_us'))} (post + completion + notification) | - | "
                    f"p50 raw + {_us(gap)} | {r.get('oracle')} |")
    tests = [r for r in records if r.get("what") == "tests"]
    if tests:
        t = tests[-1]
        out += ["", "## Tests marked `gpu`", "",
                f"{t.get('passed')} passed, {t.get('failed')} failed, {t.get('error')} errors, "
                f"{t.get('skipped')} skipped.", ""]
        out += [f"- {c['outcome']}: `{c['name']}`" + (f" ({c['message']})" if c["message"]
                                                       else "") for c in t.get("cases", [])]
    if dry:
        out += ["", "## Dry-run records", ""]
        out += [f"- {r.get('script')}: arguments {r.get('args')}" for r in records
                if r.get("what") == "dry-run"]
    return "\n".join(out) + "\n"


def summarize(outdir: Path) -> Path:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = render(read_steps(outdir / "steps.tsv"), read_records(outdir / "results.jsonl"), when)
    path = outdir / "summary.md"
    path.write_text(text)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("smi")
    p.add_argument("--json", required=True)
    p = sub.add_parser("env")
    p.add_argument("--json", required=True)
    p.add_argument("--manifest", default=str(ROOT / ".whl" / "MANIFEST.txt"))
    p = sub.add_parser("transport")
    p.add_argument("--json", required=True)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--dry-run", action="store_true", help="the host-memory check, no CUDA")
    p = sub.add_parser("junit")
    p.add_argument("xml")
    p.add_argument("--json", required=True)
    p = sub.add_parser("summary")
    p.add_argument("outdir")
    args = ap.parse_args(argv)
    if args.cmd == "smi":
        rec, rc = smi()
        append(args.json, rec)
        return rc
    if args.cmd == "env":
        append(args.json, env_facts(args.manifest))
        return 0
    if args.cmd == "transport":
        recs = asyncio.run(_checks(None if args.dry_run else args.device, args.mib << 20))
        for r in recs:
            append(args.json, r)
        return 0 if recs[0]["passed"] else 1
    if args.cmd == "junit":
        append(args.json, junit(args.xml))
        return 0
    print(summarize(Path(args.outdir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
