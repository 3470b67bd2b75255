# The two set-up commands (README): `make demo` and `make test`.
# Each creates .venv on first use and installs everything it needs.
PYTHON ?= python3
VENV ?= .venv
# This machine serves a CPU build of torch 2.13.0 from local disk; on another
# machine set TORCH_SPEC (e.g. "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu").
TORCH_SPEC ?= torch==2.13.0
PIP := $(VENV)/bin/python -m pip
STAMP := $(VENV)/.kvsidecar-installed
# vLLM for the connector tests (tests/vllm_connector): the wheel pins a CUDA torch, so it
# goes in without dependencies, then the `vllm` extra adds what it imports.
VLLM_SPEC ?= vllm==0.33.0
VLLM_STAMP := $(VENV)/.vllm-installed

.PHONY: test test-fast system-deps demo lint bench bench-quick chaos clean fuzz fuzz-engine fuzz-peer

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_SPEC)
	$(PIP) install -q -e '.[test,dev]'
	touch $@

$(VLLM_STAMP): $(STAMP)
	$(PIP) install -q --no-deps '$(VLLM_SPEC)'
	$(PIP) install -q -e '.[test,dev,vllm]'
	touch $@

# TORCH_SPEC: tests/e2e/test_wheel.py installs the same torch into its fresh venv.
test: $(STAMP) $(VLLM_STAMP) system-deps
	TORCH_SPEC='$(TORCH_SPEC)' KVSIDECAR_REQUIRE_VLLM=1 $(VENV)/bin/python -m pytest

# The unit tier (tests/unit): pure logic and fake agents, no processes, no vLLM.
test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest tests/unit

# prometheus/promtool and systemd-analyze for the ops tests (installed when root).
system-deps:
	./scripts/system-deps.sh

# The long chaos run of the lifecycle guarantees (docs/failure-handling.md).
chaos: $(STAMP)
	$(VENV)/bin/python -m kvsidecar.sim.chaos --requests 10000

demo: $(STAMP)
	$(VENV)/bin/kvsidecar demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	@# mypy cannot follow the editable install's package-dir mapping; a symlink
	@# named kvsidecar lets it check the real import paths.
	mkdir -p .typecheck && ln -sfn .. .typecheck/kvsidecar
	MYPYPATH=.typecheck $(VENV)/bin/mypy -m kvsidecar.cli -p kvsidecar.daemon -p kvsidecar.ipc \
		-p kvsidecar.metrics -p kvsidecar.sim -p kvsidecar.integrations

# Every figure of issue #12 against its baseline, measured in the same run:
# writes benchmarks/RESULTS.md (full: < 8 min on the 2-core machine; quick: < 3 min).
bench: $(STAMP)
	$(VENV)/bin/python benchmarks/run.py --scale full

bench-quick: $(STAMP)
	$(VENV)/bin/python benchmarks/run.py --scale quick

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis

# The long form of the hostile-input fuzzing (docs/security.md): 100,000
# inputs per protocol against a real sidecar; prints counts, RSS, fds, threads.
# `make fuzz-engine` / `make fuzz-peer` run one protocol only.
FUZZ_RUN = KVSIDECAR_FUZZ_EXAMPLES=100000 KVSIDECAR_FUZZ_TIMEOUT=14400 \
	$(VENV)/bin/python -m pytest -q -s -p no:cacheprovider tests/e2e/test_fuzz.py
fuzz: $(STAMP)
	$(FUZZ_RUN)
fuzz-engine: $(STAMP)
	$(FUZZ_RUN) -k engine_protocol
fuzz-peer: $(STAMP)
	$(FUZZ_RUN) -k peer_protocol
