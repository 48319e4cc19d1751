#!/usr/bin/env bash
# Download the wheels that the lent GPU machine lacks into the git-ignored .whl/ (run here, where
# PyPI is reachable; bench/gpu_check.sh installs them there with --no-index). The machine has no
# network; its image holds torch, transformers, triton, numpy, httpx, prometheus-client, pyyaml,
# matplotlib, onnx(runtime), accelerate, peft, pytest, pytest-xdist, pytest-timeout, hypothesis
# (/work/.library/device/KINDS.md), so only these are carried, pinned to what our venv runs:
#   - importing gateway/, buckets/, models/, bench/ and the gpu tests: structlog, pydantic (+ core,
#     annotated-types, typing-inspection, a recent typing-extensions), litestar (+ msgspec,
#     multipart), llguidance (models/structured_sampling.py, imported by the runner), jsonschema
#     (+ referencing, rpds-py, jsonschema-specifications; gateway/structured_fields.py);
#   - `sluice serve`: uvicorn (its pure-Python h11 server; click and h11 are there).
# Left out: ray (imported only by Ray slices), plotly (read only when a dashboard asks for its
# script), gguf (GGUF sources only; the check's model is a safetensors folder), litestar's CLI
# and test extras (rich-click, polyfactory, litestar-htmx: never imported by our code), and the
# test extras that only other test modules import (openai, schemathesis, playwright, langchain,
# mypy): gpu_check.sh runs only the test files that hold gpu-marked tests.
# The machine runs Python 3.12.3 (Ubuntu 24.04, glibc 2.39), so manylinux tags up to 2_35 fit.
# Usage: bench/gpu_wheels.sh  (from the repository root; prints the wheels' and the tree's size)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
WHEELS=(
    structlog==26.1.0
    pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    typing_extensions==4.16.0
    litestar==2.25.0 msgspec==0.23.0 multipart==2.0.1
    llguidance==1.9.1
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
    uvicorn==0.55.0
)
PLATFORMS=()
for platform in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
    manylinux2014_x86_64 manylinux1_x86_64; do
    PLATFORMS+=(--platform "$platform")
done
mkdir -p .whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d .whl "${WHEELS[@]}"
# One version of each: a stale wheel of another version beside the pinned one stops the install.
expected=$(printf '%s\n' "${WHEELS[@]}" | sed 's/==/-/' | tr 'A-Z-' 'a-z_' | sort)
for wheel in .whl/*.whl; do
    name=$(basename "$wheel" | cut -d- -f1-2 | tr 'A-Z-' 'a-z_')
    if ! grep -qx "$name" <<<"$expected"; then
        echo "removing $wheel (not in the pinned list)"
        rm -f "$wheel"
    fi
done
wheel_bytes=$(du -cb .whl/*.whl | tail -1 | cut -f1)
tree_bytes=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | awk '$2 == "total" {s += $1} END {print s}')
model_bytes=$( [ -d .gpu-model ] && du -sb .gpu-model | cut -f1 || echo 0)
echo "wheels: $(ls .whl/*.whl | wc -l) files, $((wheel_bytes / 1024)) KiB"
echo "tree: $((tree_bytes / 1024)) KiB; .gpu-model: $((model_bytes / 1024)) KiB"
echo "together: $(((wheel_bytes + tree_bytes + model_bytes) / 1048576)) MiB (the device tool carries at most 64 MiB)"
