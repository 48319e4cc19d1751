#!/usr/bin/env bash
# The prepared GPU check (issue 35 §3): one command that measures Sluice on a lent GPU machine
# within 8 minutes and writes $OUT/summary.json (every figure with the GPU's name and versions)
# plus logs: stages.log, pytest.log, serve.log, nvidia-smi.txt (5 files in $OUT, none deeper).
#
# Before the device call, here: bench/gpu_wheels.sh (.whl/) and `python -m bench.gpu_model
# prepare` (.gpu-model/); the call carries both: run(command="bench/gpu_check.sh",
# carry=[".whl", ".gpu-model"], timeout_s=540).
#
# Stages, each with its own timeout (seconds, below) cut to what is left of one budget
# (GPU_CHECK_BUDGET_S, default 450 s; a stage with under 5 s left is skipped); a failing or
# timed-out stage is recorded in summary.json's `stages` and the check goes on:
#   install 60     the carried wheels into /tmp/site (PYTHONPATH=/tmp/site:$PWD)
#   nvidia-smi 20, info 45   nvidia-smi; Python/torch/CUDA/Triton/transformers versions, GPU name
#   model 60       SmolLM2-135M's architecture with seeded random weights (bench/gpu_model.py)
#   cpu-kernel 120 the C++ decode kernel every runner loads, built once here
#   pytest 100     pytest -m gpu on the test files that hold gpu-marked tests
#   engine-N 45+N/3  sluice bench engine on the device at N = 1, 16, 64, 256 sequences:
#                  sequential HF generate (timed on 4 prompts), static batches of 32, HF
#                  generate_batch, Sluice (--keep-going: a failing system is noted, the rest run)
#   decode 60      the batch-1 decode step with CUDA graphs off and on (bench/gpu_decode.py)
#   serve 120      sluice serve --config configs/gpu.yaml on a loopback port, in the background
#   load-C 30+C/4  sluice bench load at concurrency C = 1, 16, 64, 256 (2*C requests, at least 8)
#
# Dry run on a CPU (same stages, tiny settings, no wheels installed: the venv has them):
#   bench/gpu_check.sh --dry-run     (or SLUICE_GPU_CHECK_DEVICE=cpu bench/gpu_check.sh)
# With OUT unset, the files go to bench-results/gpu-check/ (git-ignored).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEVICE=${SLUICE_GPU_CHECK_DEVICE:-cuda:0}
[[ "${1:-}" == "--dry-run" ]] && DEVICE=cpu
OUT=${OUT:-$ROOT/bench-results/gpu-check}
mkdir -p "$OUT"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/sluice-gpu-check.XXXXXX")
LOG=$OUT/stages.log
rm -f "$OUT"/{summary.json,pytest.log,serve.log,nvidia-smi.txt}
: >"$LOG"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [[ $DEVICE == cpu ]]; then
    DRY_RUN=1 PYTHON=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
    DTYPE=float32 MODEL_DIR=$WORK/model LAYERS=(--num-hidden-layers 2) THREADS=1
    ENGINE_LEVELS=(1 4) NEW_TOKENS=8 MAX_PROMPT_TOKENS=48 SEQUENTIAL_PROMPTS=2 DECODE_TOKENS=8
    LOAD_LEVELS=(1 4) LOAD_INPUT_WORDS=32 LOAD_OUTPUT_TOKENS=8 BUDGET_S=${GPU_CHECK_BUDGET_S:-900}
    # A cache of its own: the C++ kernel's build folder is shared by every checkout on a machine,
    # and another checkout's build of a different source replaced it mid-run (a rebuild per stage).
    export OMP_NUM_THREADS=1 SLUICE_CACHE_DIR=$WORK/cache
else
    DRY_RUN=0 PYTHON=${PYTHON:-python3}
    DTYPE=bfloat16 MODEL_DIR=/tmp/sluice-gpu-model LAYERS=() THREADS=$(nproc)
    ENGINE_LEVELS=(1 16 64 256) NEW_TOKENS=64 MAX_PROMPT_TOKENS=512 SEQUENTIAL_PROMPTS=4 DECODE_TOKENS=128
    LOAD_LEVELS=(1 16 64 256) LOAD_INPUT_WORDS=128 LOAD_OUTPUT_TOKENS=64 BUDGET_S=${GPU_CHECK_BUDGET_S:-450}
fi
DEADLINE=$((SECONDS + BUDGET_S))
RESERVE_S=15   # kept for stopping the server and writing the summary

record() { # record STAGE STATUS RC WALL_S TIMEOUT_S NOTE
    printf '{"stage": "%s", "status": "%s", "rc": %s, "wall_s": %s, "timeout_s": %s, "note": "%s"}\n' \
        "$1" "$2" "$3" "$4" "$5" "$6" >>"$WORK/stages.jsonl"
    echo "--- $1: $2 (rc $3, ${4} s of ${5} s) $6" | tee -a "$LOG"
}

stage() { # stage NAME CAP_S LOGFILE COMMAND...: run COMMAND under min(CAP_S, budget left)
    local name=$1 cap=$2 logfile=$3
    shift 3
    local left=$((DEADLINE - SECONDS - RESERVE_S))
    local limit=$((cap < left ? cap : left))
    if ((limit < 5)); then
        record "$name" skipped null 0 "$limit" "out of time"
        return 1
    fi
    echo "=== $name (timeout ${limit} s): $*" >>"$LOG"
    [[ $logfile != "$LOG" ]] && echo "=== $name: $*" >>"$logfile"
    local started=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >>"$logfile" 2>&1
    local rc=$? status=ok
    ((rc != 0)) && status=failed
    ((rc == 124 || rc == 137)) && status=timed_out
    record "$name" "$status" "$rc" $((SECONDS - started)) "$limit" ""
    return $rc
}

if ((DRY_RUN)); then
    record install skipped null 0 0 "dry run: the venv has the packages"
    export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
else
    stage install 60 "$LOG" "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site $(ls .whl/*.whl 2>/dev/null)
    export PYTHONPATH=/tmp/site:$ROOT
fi

if command -v nvidia-smi >/dev/null; then
    stage nvidia-smi 20 "$OUT/nvidia-smi.txt" nvidia-smi
else
    record nvidia-smi skipped null 0 0 "no nvidia-smi on this machine"
fi
stage info 45 "$LOG" "$PYTHON" -m bench.gpu_check versions --device "$DEVICE" --output "$WORK/versions.json"
stage model 60 "$LOG" "$PYTHON" -m bench.gpu_model materialise --output "$MODEL_DIR" "${LAYERS[@]}"
# Every runner loads the C++ decode kernel (built once per machine, about a minute on two cores):
# build it here, once, rather than inside the first timed stage.
stage cpu-kernel 120 "$LOG" "$PYTHON" -c \
    'from models.paged_attention import compiled_kernel_available as built; print("C++ decode kernel:", built())'

mapfile -t GPU_TESTS < <(grep -rlE --include='*.py' 'mark\.gpu' tests | sort)
stage pytest 100 "$OUT/pytest.log" "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider \
    --continue-on-collection-errors --junitxml="$WORK/pytest.xml" "${GPU_TESTS[@]}"

for n in "${ENGINE_LEVELS[@]}"; do
    systems=sequential,static_32,hf_continuous,sluice
    ((n == 1)) && systems=sequential,sluice
    stage "engine-$n" $((45 + n / 3)) "$LOG" "$PYTHON" -m gateway bench engine --source "$MODEL_DIR" \
        --device "$DEVICE" --dtype "$DTYPE" --threads "$THREADS" --num-prompts "$n" --systems "$systems" --keep-going \
        --max-new-tokens "$NEW_TOKENS" --max-prompt-tokens "$MAX_PROMPT_TOKENS" --max-num-seqs 256 \
        --sequential-prompts $((n < SEQUENTIAL_PROMPTS ? n : SEQUENTIAL_PROMPTS)) --output "$WORK/engine-$n.json"
done

stage decode 60 "$LOG" "$PYTHON" -m bench.gpu_decode --source "$MODEL_DIR" --device "$DEVICE" --dtype "$DTYPE" \
    --new-tokens "$DECODE_TOKENS" --output "$WORK/decode.json"

CONFIG=configs/gpu.yaml
if ((DRY_RUN)); then
    CONFIG=$WORK/serve.yaml
    "$PYTHON" -m bench.gpu_check cpu-config --config configs/gpu.yaml --source "$MODEL_DIR" --output "$CONFIG"
fi
MODEL_NAME=$("$PYTHON" -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["models"][0]["name"])' "$CONFIG")
PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$PYTHON" -m gateway serve --config "$CONFIG" --host 127.0.0.1 --port "$PORT" --log-level warning >"$OUT/serve.log" 2>&1 &
SERVER_PID=$!
trap 'kill "$SERVER_PID" 2>/dev/null; rm -rf "$WORK"' EXIT
if stage serve 120 "$LOG" "$PYTHON" -m bench.gpu_check wait --url "http://127.0.0.1:$PORT/health" \
    --pid "$SERVER_PID" --timeout-s 120; then
    for c in "${LOAD_LEVELS[@]}"; do
        requests=$((2 * c > 8 ? 2 * c : 8))
        stage "load-$c" $((30 + c / 4)) "$LOG" "$PYTHON" -m gateway bench load --base-url "http://127.0.0.1:$PORT" \
            --model "$MODEL_NAME" --concurrency "$c" --num-requests "$requests" --input-len "$LOAD_INPUT_WORDS" \
            --output-len "$LOAD_OUTPUT_TOKENS" --timeout 60 --no-progress --output "$WORK/load-$c"
    done
fi
kill "$SERVER_PID" 2>/dev/null
timeout 10 tail --pid="$SERVER_PID" -f /dev/null || kill -9 "$SERVER_PID" 2>/dev/null

summary_flags=()
((DRY_RUN)) && summary_flags=(--dry-run)
"$PYTHON" -m bench.gpu_check summary --work "$WORK" --output "$OUT/summary.json" "${summary_flags[@]}" >>"$LOG" 2>&1
echo "summary: $OUT/summary.json ($((SECONDS)) s)"
"$PYTHON" - "$OUT/summary.json" <<'EOF'
import json, sys
summary = json.load(open(sys.argv[1]))
print("gpu:", summary["gpu_name"], "| versions:", {k: summary["versions"].get(k) for k in ("torch", "cuda", "triton", "transformers")})
for s in summary["stages"]:
    print(f"  {s['stage']:<12} {s['status']:<10} {s['wall_s']:>4} s")
print("targets:", json.dumps(summary["targets"]))
EOF
