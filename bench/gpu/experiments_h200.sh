#!/usr/bin/env bash
# The prefill experiments on the H200 machine, built there (it has cmake, ninja and nvcc): the
# persistent Hopper kernel (-DPAGEDATTN_SM90_PERSISTENT=1, one head size (128) for a short
# build) checked by backend_ops with every prefill row on it, then timed beside the default
# build and the default build with the pingpong in every CTA (PAGEDATTN_CUDA_PINGPONG_MIN_TILES).
#
#   OUT=... bash bench/gpu/experiments_h200.sh [base build dir, default build/cuda-h200]
#
# Writes $OUT/exp_*.log and $OUT/sweep.txt.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-$PWD/build/h200-exp}"
BASE="${1:-build/cuda-h200}"
mkdir -p "$OUT"
variant() {  # name, CUDA flags
  local dir="build/exp-$1"
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPAGEDATTN_ENABLE_CUDA=ON \
    -DPAGEDATTN_ENABLE_CPU_BACKEND=OFF -DPAGEDATTN_BUILD_TOOLS=OFF \
    -DPAGEDATTN_CUDA_HEAD_SIZES=128 "-DCMAKE_CUDA_FLAGS=$2" >"$OUT/exp_$1_cmake.log" 2>&1 &&
    ninja -C "$dir" bench_prefill backend_ops >"$OUT/exp_$1_build.log" 2>&1
  echo "$1 build rc=$?"
}
variant persist -DPAGEDATTN_SM90_PERSISTENT=1
for pass in all:Hopper auto:auto; do
  PAGEDATTN_CUDA_PREFILL="${pass%%:*}" timeout 120 build/exp-persist/tests/backend_ops test \
    --device cuda --backend cuda >"$OUT/exp_persist_bo_${pass%%:*}.log" 2>&1
  echo "persistent backend_ops (${pass#*:}) rc=$?: $(grep -E 'passed' "$OUT/exp_persist_bo_${pass%%:*}.log")"
  grep FAIL "$OUT/exp_persist_bo_${pass%%:*}.log" | head -5
done
timeout 120 compute-sanitizer --tool memcheck --error-exitcode 99 build/exp-persist/tests/backend_ops \
  test --device cuda --backend cuda --filter d=128 >"$OUT/exp_persist_san.log" 2>&1
echo "persistent memcheck rc=$?: $(tail -n1 "$OUT/exp_persist_san.log")"
ONLY='h32/8 d128 auto' OUT="$OUT" timeout 300 bash bench/gpu/sweep_prefill_h200.sh \
  "base=$BASE" persist=build/exp-persist "pp=$BASE@PAGEDATTN_CUDA_PINGPONG_MIN_TILES=1" >/dev/null 2>&1
cat "$OUT/sweep.txt"
