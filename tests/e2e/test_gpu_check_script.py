"""The GPU check's scripts without a GPU (issue #28).

``scripts/gpu-check.sh --dry-run`` does everything the GPU run does except
CUDA: its arguments, the wheel install into a target folder (a wheel built
here), the steps under their time limits (a hung ``nvidia-smi``, played by a
script that sleeps, is killed and recorded, and the next steps still run),
the result files and the summary. ``scripts/gpu-wheels.sh`` is checked for
its size limit on a prepared folder and for what it would download, without
downloading. The summary renderer and the driver-API scan are checked on
records and modules made here; the benchmarks the GPU run uses are rehearsed
on host memory against real sidecars.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.integration.test_gpu import NO_GPU

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "gpu-check.sh"
WHEELS = ROOT / "scripts" / "gpu-wheels.sh"
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402

STEPS = ["install", "nvidia-smi", "env", "tests", "transport", "e2e-cuda_malloc",
         "e2e-cuda_vmm", "figures", "figures-get-zcopy"]


def _wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel (module ``kvsgpuprobe``), built here: what the
    install step does with the real wheels, offline and in milliseconds."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "kvsgpuprobe-1.0-py3-none-any.whl"
    info = "kvsgpuprobe-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("kvsgpuprobe.py", "VALUE = 42\n")
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: kvsgpuprobe\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                   "Root-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", f"kvsgpuprobe.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n"
                   f"{info}/RECORD,,\n")
    return path


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHON": sys.executable, **extra}


def _steps(out: Path) -> dict[str, list[str]]:
    rows = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()[1:]]
    return {r[0]: r[1:] for r in rows}  # the last row of each step


@pytest.mark.timeout(600)
def test_dry_run_kills_a_hung_step_records_it_and_runs_the_rest(tmp_path: Path) -> None:
    _wheel(tmp_path / "wheels")
    fake = tmp_path / "bin" / "nvidia-smi"  # a hung nvidia-smi, as on a broken GPU node
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho $$ > {tmp_path / 'smi.pid'}\n"
                    'echo "fake nvidia-smi: hanging" > "$TMPDIR/smi.log"\nexec sleep 120\n')
    fake.chmod(0o755)
    out, site = tmp_path / "out", tmp_path / "site"
    proc = subprocess.run(
        ["bash", str(CHECK), "--dry-run", "--wheels", str(tmp_path / "wheels"), "--site",
         str(site), "--limit", "nvidia-smi=3", str(out)],
        env=_env(PATH=f"{fake.parent}:{os.environ['PATH']}"), capture_output=True, text=True,
        timeout=540)
    assert proc.returncode == 1, proc.stdout + proc.stderr + (out / "log.txt").read_text()

    # The outcome of every step, in order; the hung one killed at its limit.
    steps = _steps(out)
    assert list(steps) == STEPS
    smi = steps.pop("nvidia-smi")
    assert smi[0] == "3" and smi[1] in ("124", "137") and 3 <= float(smi[2]) < 60, smi
    assert smi[3] == "timed out after 3 s (killed)"
    assert {name: row[1:2] + row[3:] for name, row in steps.items()} == {
        name: ["0", "passed"] for name in steps}, (out / "log.txt").read_text()
    pid = int((tmp_path / "smi.pid").read_text())
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists(), "the hung step's process was left running"

    # The wheel went into the target folder; what the steps recorded.
    assert (site / "kvsgpuprobe.py").read_text() == "VALUE = 42\n"
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["what"] for r in records] == ["facts", "tests", "transport", "transport",
                                            "dry-run", "dry-run", "dry-run", "dry-run"]
    facts, tests, *transport = records[:4]
    assert facts["versions"]["nixl"] == md.version("nixl")
    assert facts["nixl"]["ucx_version"] and "cma" in facts["nixl"]["ucx_modules"]
    assert tests["failed"] == tests["error"] == 0 and tests["skipped"] == 2
    assert [(t["device"], t["variant"], t["passed"]) for t in transport] == [
        ("host", "default", True), ("host", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y", True)]
    assert [(r["script"], r["args"].get("memory")) for r in records[4:]] == [
        ("gpu_e2e", "cuda_malloc"), ("gpu_e2e", "cuda_vmm"), ("gpu_figures", "cuda_malloc"),
        ("gpu_figures", "cuda_malloc")]

    # What comes back: few files, names the device tool accepts; a summary saying dry run.
    names = sorted(p.name for p in out.iterdir())
    assert names == ["log.txt", "results.jsonl", "steps.tsv", "summary.md"]
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", n) for n in names)
    summary = (out / "summary.md").read_text()
    assert "**DRY RUN" in summary
    assert "| nvidia-smi | 3 s |" in summary and "timed out after 3 s (killed)" in summary
    assert "## Figures" not in summary and "## Sidecars end to end" not in summary
    log = (out / "log.txt").read_text()
    assert "===== figures" in log and "gpu-check: nvidia-smi: timed out" in log
    # what the killed step left in its temporary folder, shown after it
    assert ("gpu-check: nvidia-smi: timed out after 3 s (killed) (" in log
            and " s)\n--- smi.log (its last 4000 bytes) ---\nfake nvidia-smi: hanging\n"
            "\n\n===== env (limit" in log)


@pytest.mark.parametrize(("args", "says"), [
    ([], "OUTDIR is missing"),
    (["--limit", "nosuch=3", "out"], "no step named 'nosuch' (steps: install nvidia-smi"),
    (["--limit", "env=soon", "out"], "seconds must be a whole number above 0"),
    (["--limit", "env=0", "out"], "seconds must be a whole number above 0"),
    (["--budget", "-1", "out"], "--budget needs whole seconds"),
    (["--frobnicate", "out"], "unknown option: --frobnicate"),
    (["a", "b"], "one OUTDIR only"),
])
def test_bad_arguments_exit_2_with_the_reason(tmp_path: Path, args: list[str],
                                              says: str) -> None:
    proc = subprocess.run(["bash", str(CHECK), *args], capture_output=True, text=True,
                          cwd=tmp_path, env=_env(), timeout=60)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "a").exists()


def test_a_spent_budget_skips_the_steps_it_cannot_hold(tmp_path: Path) -> None:
    """A budget of 4 s leaves every step under the 5 s a step needs: each is
    recorded as skipped, the summary is still written, status 1."""
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(CHECK), "--dry-run", "--budget", "4", str(out)],
                          capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 1, proc.stderr
    steps = _steps(out)
    assert {s: steps[s][3] for s in STEPS} == {s: "skipped: the 4 s budget is spent"
                                                for s in STEPS}
    assert "| figures | 120 s | - | skipped: the 4 s budget is spent |" in (
        out / "summary.md").read_text()


def test_without_wheels_the_install_fails_and_says_why(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(CHECK), "--dry-run", "--wheels", str(tmp_path / "none"),
                           "--budget", "8", str(out)],
                          capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert _steps(out)["install"][1:] == ["1", _steps(out)["install"][2], "failed (status 1)"]
    assert (f"no wheels in {tmp_path / 'none'}: run scripts/gpu-wheels.sh first and carry "
            ".whl") in (out / "log.txt").read_text()


# -- gpu-wheels.sh --------------------------------------------------------------------------------

def _tree_bytes() -> int:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], cwd=ROOT, capture_output=True,
                           check=True).stdout.split(b"\0")
    return sum(os.path.getsize(ROOT / f.decode()) for f in files
               if f and not f.startswith(b".whl/") and (ROOT / f.decode()).is_file()
               and not (ROOT / f.decode()).is_symlink())


def test_wheel_size_check_passes_under_the_limit_and_fails_over_it(tmp_path: Path) -> None:
    wheels = tmp_path / "w"
    wheels.mkdir()
    big = wheels / "nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl"
    with open(big, "wb") as f:  # sparse: the size counts, nothing is written
        f.truncate(30 << 20)
    run = ["bash", str(WHEELS), "--no-download", "--wheels", str(wheels)]
    ok = subprocess.run([*run, "--limit-mib", "62"], capture_output=True, text=True,
                        env=_env(), timeout=120)
    assert ok.returncode == 0, ok.stderr
    total = _tree_bytes() + (30 << 20)
    assert f"gpu-wheels: travels {total / 2**20:.1f} MiB: checkout " in ok.stdout, ok.stdout
    assert f"{wheels} 30.0 MiB (limit 62 MiB)" in ok.stdout
    over = subprocess.run([*run, "--limit-mib", "30"], capture_output=True, text=True,
                          env=_env(), timeout=120)
    assert over.returncode == 1
    assert f"gpu-wheels: too large: {total / 2**20:.1f} MiB > 30 MiB" in over.stderr


def test_wheels_carried_are_pinned_to_the_tested_versions_and_cover_our_dependencies() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    plan = subprocess.run(["bash", str(WHEELS), "--plan"], capture_output=True, text=True,
                          env=_env(), timeout=120)
    assert plan.returncode == 0, plan.stderr
    lines = dict(line.split(": ", 1) for line in plan.stdout.splitlines())
    assert lines["python"] == "cp312 manylinux x86_64"
    carry = lines["carry"].split()
    assert carry == [f"{n}=={md.version(n)}" for n in ("nixl", "nixl-cu13", "msgspec", "pyzmq")]
    known = {c.split("==")[0] for c in carry} | set(lines["image has"].split())
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].lower() for d in deps}
    assert names <= known, f"runtime dependencies neither carried nor in the image: {names - known}"


# -- the summary and the driver-API scan ---------------------------------------------------------

def _gpu_like_records() -> list[dict[str, object]]:
    return [
        {"what": "smi", "gpus": [{"name": "NVIDIA H100 80GB HBM3", "driver_version": "580.1",
                                  "memory.total": "81559 MiB", "compute_cap": "9.0"}]},
        {"what": "facts", "python": "3.12.3", "kernel": "6.18", "versions": {"nixl": "1.5.1"},
         "torch": {"version": "2.11.0+cu130", "cuda": "13.0", "cuda_available": True,
                   "devices": [{"name": "H100", "capability": "9.0", "memory_gib": 79.1}]},
         "nixl": {"backend": "nixl_cu13", "ucx_version": "1.23.0", "ucx_modules": ["cuda"]},
         "driver_api_problems": []},
        {"what": "transport", "device": 0, "variant": "default", "path": "cuda_ipc",
         "transports": ["cuda_ipc/cuda"], "gbps": 1234.5, "passed": True, "detail": "fine"},
        {"what": "case", "memory": "cuda_malloc", "case": "1 GPU, hybrid P tp1 -> D tp2",
         "requests": 16, "bytes": 2568192, "seconds": 0.0123, "gbps": 0.21, "d2d_gbps": 900.0,
         "copy": "torch device-to-device copy", "failed": {}, "oracle_problems": [],
         "oracle": "every byte ok"},
        {"what": "case", "memory": "cuda_vmm", "case": "1 GPU, hybrid P tp2 -> D tp1",
         "error": "CudaError: cuMemImportFromShareableHandle failed", "logs": {}},
        {"what": "bandwidth", "memory": "cuda_malloc", "ucx": "UCX defaults",
         "bytes": 256 << 20, "reads": 5,
         "sidecar_gbps": 500.0, "sidecar_best_gbps": 520.0, "raw_gbps": 1000.0,
         "raw_best_gbps": 1100.0, "copy_gbps": 1500.0, "copy": "torch device-to-device copy",
         "ratio": 0.5, "oracle": "first read: every byte ok; the others received"},
        {"what": "latency", "memory": "cuda_malloc", "ucx": "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y",
         "reads": 200, "bytes": 16384,
         "sidecar_p50_us": 300.0, "sidecar_p99_us": 900.0, "raw_p50_us": 40.0,
         "raw_p99_us": 60.0, "oracle": "every read: every byte ok"},
        {"what": "tests", "passed": 2, "failed": 0, "error": 0, "skipped": 0,
         "cases": [{"name": "tests.test_gpu::x[cuda_malloc]", "outcome": "passed",
                    "message": ""}]},
    ]


def test_summary_renders_what_was_recorded(tmp_path: Path) -> None:
    (tmp_path / "steps.tsv").write_text(
        "step\tlimit_s\trc\tseconds\toutcome\n"
        "install\t60\t0\t3.1\tpassed\n"
        "figures\t120\t-\t-\tstarted, did not finish\n"
        "figures\t120\t124\t120.2\ttimed out after 120 s (killed)\n"
        "tests\t60\t-\t-\tstarted, did not finish\n")
    with open(tmp_path / "results.jsonl", "w") as f:
        for r in _gpu_like_records():
            f.write(json.dumps(r) + "\n")
        f.write("{not json: a line cut by a kill\n")
    text = gpu_check.summarize(tmp_path).read_text()
    assert "DRY RUN" not in text
    assert ("- GPU: NVIDIA H100 80GB HBM3, 81559 MiB, compute capability 9.0, driver 580.1 "
            "(nvidia-smi)") in text
    assert "| install | 60 s | 3.1 s | passed |" in text
    assert "| figures | 120 s | 120.2 s | timed out after 120 s (killed) |" in text
    assert "| tests | 60 s | - | started, did not finish |" in text
    assert "| 0 | default | cuda_ipc | cuda_ipc/cuda | 1,234.5 | passed: fine |" in text
    assert ("| cuda_malloc | 1 GPU, hybrid P tp1 -> D tp2 | 16 | 2568192 | 12.3 ms | 0.21 | "
            "900.0 (torch device-to-device copy) | every byte ok |") in text
    assert ("| cuda_vmm | 1 GPU, hybrid P tp2 -> D tp1 | - | - | - | - | - | FAILED: "
            "CudaError: cuMemImportFromShareableHandle failed |") in text
    assert ("| cuda_malloc | UCX defaults | one read of 256 MiB, tp1 -> tp1 (median of 5) | "
            "500.0 GB/s (best "
            "520.0) | 1,000.0 GB/s (best 1,100.0) | 1,500.0 GB/s (torch device-to-device "
            "copy) | 0.50x |") in text
    assert ("| cuda_malloc | UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y | 1-block (16 KiB) read latency "
            "p50 / p99 (200 reads) | 300 µs / 900 µs | 40 µs / 60 µs (post + completion + "
            "notification) | - | p50 raw + 260 µs |") in text
    assert "2 passed, 0 failed, 0 errors, 0 skipped." in text
    assert "- CUDA driver API calls of our code this cuda-bindings would refuse: none" in text


def test_the_scan_finds_our_driver_calls_and_what_a_binding_lacks() -> None:
    sources = [(ROOT / s).read_text() for s in gpu_check.CUDA_SOURCES]
    names = gpu_check.binding_names(sources)
    assert {("driver", "cuIpcOpenMemHandle"), ("driver", "cuMemCreate"),
            ("driver", "CUipcMem_flags", "CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS"),
            ("driver", "CUdevice_attribute", "CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED"),
            ("nvml", "init_v2")} <= names
    assert ("driver", "cuMemAddressReserve", 4) in gpu_check.binding_calls(sources)

    def cu_mem_alloc(bytesize: int) -> None: ...

    fake = SimpleNamespace(cuMemAlloc=cu_mem_alloc,
                           CUipcMem_flags=SimpleNamespace(CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS=1))
    got = gpu_check.missing_names({"driver": fake}, [
        ("driver", "cuMemAlloc"), ("driver", "cuMemCreate"),
        ("driver", "CUipcMem_flags", "CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS"),
        ("driver", "CUipcMem_flags", "CU_IPC_MEM_NONE"), ("nvml", "init_v2")])
    assert got == ["driver.CUipcMem_flags.CU_IPC_MEM_NONE", "driver.cuMemCreate"]
    assert gpu_check.arity_mismatches({"driver": fake}, [("driver", "cuMemAlloc", 1)]) == []
    assert gpu_check.arity_mismatches({"driver": fake}, [("driver", "cuMemAlloc", 2)]) == [
        "driver.cuMemAlloc: called with 2 arguments, takes (bytesize: 'int') -> 'None'"]


# -- the GPU benchmarks, rehearsed on host memory -------------------------------------------------

@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_the_gpu_benchmarks_run_on_host_memory_and_the_summary_shows_them(
        tmp_path: Path) -> None:
    """gpu_e2e (hetero TP, every byte against the oracle) and gpu_figures (bulk vs
    raw NIXL vs a copy, and latency) with ``--memory memfd``: the code the GPU run
    executes, minus CUDA, against real sidecars; tiny sizes, and one TP direction
    (P tp2 -> D tp1: the other is the same code with the sizes swapped)."""
    results = tmp_path / "results.jsonl"
    env = _env(PYTHONUNBUFFERED="1")
    for cmd in (["gpu_e2e.py", "--memory", "memfd", "--requests", "2", "--blocks", "32",
                 "--directions", "2x1"],
                ["gpu_figures.py", "--memory", "memfd", "--mib", "4", "--repeats", "1",
                 "--latency-reads", "3"]):
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / cmd[0]), *cmd[1:],
                               "--json", str(results)], capture_output=True, text=True,
                              env=env, timeout=800, start_new_session=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    records = gpu_check.read_records(results)
    assert [(r["what"], r.get("case")) for r in records] == [
        ("case", "host memory, hybrid P tp2 -> D tp1"), ("bandwidth", None), ("latency", None)]
    assert [r["oracle"] for r in records] == ["every byte ok",
                                              "first read: every byte ok; the others received",
                                              "every read: every byte ok"]
    case, bulk, lat = records
    assert case["requests"] == 2 and case["bytes"] > 0 and not case["failed"]
    assert bulk["bytes"] == 4 << 20 and bulk["copy"] == "numpy host copy"
    ucx = ", ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("UCX_"))
    assert bulk["ucx"] == lat["ucx"] == (ucx or "UCX defaults")
    assert min(bulk["sidecar_gbps"], bulk["raw_gbps"], bulk["copy_gbps"]) > 0
    assert min(lat["sidecar_p50_us"], lat["raw_p50_us"]) > 0
    text = gpu_check.render([], records, "now")
    assert "## Sidecars end to end" in text and "## Figures" in text
    assert text.count("| every byte ok |") == 1


@pytest.mark.skipif(NO_GPU is None, reason="a GPU is present: the script would run for real")
def test_gpu_figures_without_a_gpu_says_so_and_exits_2() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_figures.py")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("gpu_figures: no CUDA GPU here (")
    assert line.endswith("--memory cuda_malloc needs one")


@pytest.mark.e2e
def test_a_failing_e2e_case_returns_its_error_and_the_sidecars_logs(tmp_path: Path) -> None:
    """A case that cannot run (here: GPU memory asked of host sidecars, which
    refuse it) comes back as a record with the reason and its sidecars' log
    tails, so the GPU run goes on to the next case and the summary shows why."""
    import gpu_e2e

    r = gpu_e2e._case(tmp_path, "host memory", None, None, 1, 1, "cuda_malloc", 1, 8)
    assert r["case"] == "host memory, hybrid P tp1 -> D tp1" and "oracle" not in r
    assert "memory kind 'cuda_malloc' needs a GPU sidecar" in str(r["error"]), r["error"]
    logs = r["logs"]
    assert isinstance(logs, dict) and sorted(logs) == ["hostmemory-1p1d-d0", "hostmemory-1p1d-p0"]
