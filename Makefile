# Every target creates and reuses .venv and installs what it needs; a fresh machine with only
# Python >= 3.11 is enough. torch is pinned to 2.13.0 on CPU machines: any other spec may pull a
# multi-GB CUDA build (nixl depends on an unpinned torch, so torch goes in the same pip command).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: help install test lint bench demo clean

help:
	@echo "make demo   - the main job on an embedded local Ray"
	@echo "make test   - the test suite (what CI runs)"
	@echo "make bench  - every benchmark, then BENCHMARKS.md"
	@echo "make lint   - ruff and mypy"

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "tessera-ray needs Python >= 3.11, found " + sys.version.split()[0]'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)" -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check tessera_ray tests benchmarks
	$(BIN)/ruff format --check tessera_ray tests benchmarks
	$(BIN)/mypy tessera_ray

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py $(BENCH_ARGS)

demo: $(STAMP)
	$(BIN)/tessera-ray demo --report demo_report.json --plot demo.png

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
