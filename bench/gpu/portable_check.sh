#!/usr/bin/env bash
# The portable kernels (what Ampere, Ada and later GPUs run) on a Hopper machine, in one call:
#   1. the cuda-sm90 build with the option kernels=portable (the portable kernels' sm_90a code):
#      backend_ops' whole matrix, compute-sanitizer memcheck over it, the CUDA-graph tests;
#   2. the cuda-portable build (sm_80 code and compute_80 PTX only): the driver compiles the PTX
#      at load, as on a Blackwell; `backends` names the family, then the whole matrix;
#   3. decode and prefill timed on the portable route beside the Hopper route and torch's SDPA in
#      the same call (a floor of what Ampere users get on this card, not an A100 figure).
# Writes bench/results/portable-<card>.txt (card, commit, date) and, when OUT is set, the logs.
#
#   tar xJf build/carry/bins.tar.xz && tar xJf build/carry/portable.tar.xz && \
#     bash bench/gpu/portable_check.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source bench/gpu/common.sh
OUT="${OUT:-$PWD/build/gpu-out}"
mkdir -p "$OUT" bench/results
card="$(gpu_card)"
log="$OUT/portable.log"
: >"$log"
fails=0
check() {  # name, then the command
  local name="$1"
  shift
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  say "$name rc=$rc: $(grep -E '^backend cuda:.*passed|ERROR SUMMARY|^\[  (PASSED|FAILED) ' \
    "$OUT/$name.log" | tr '\n' ' ') $(grep -m3 FAIL "$OUT/$name.log" | tr '\n' ' ')"
  [ "$rc" = 0 ] || fails=$((fails + 1))
}
portable=(--cuda-option kernels=portable)
say "== $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
say "== 1. cuda-sm90 build, kernels=portable"
check matrix "$BUILD/tests/backend_ops" test --device cuda --backend cuda "${portable[@]}"
check matrix_splits "$BUILD/tests/backend_ops" test --device cuda --backend cuda "${portable[@]}" \
  --cuda-option splits=5
check memcheck compute-sanitizer --tool memcheck --error-exitcode 9 "$BUILD/tests/backend_ops" \
  test --device cuda --backend cuda "${portable[@]}"

say "== 2. cuda-portable build (compute_80 PTX compiled by the driver)"
P=build/cuda-portable
"$P/tests/backend_ops" support --device cuda --backend cuda >"$OUT/support_ptx.log" 2>&1
grep -m3 -i "kernels\|MLA" "$OUT/support_ptx.log" | tee -a "$log"
check matrix_ptx "$P/tests/backend_ops" test --device cuda --backend cuda
check cuda_tests_ptx "$P/tests/pagedattn_cuda_tests" \
  --gtest_filter='CudaBackendHost.*:CudaDecode.*:CudaWriteKV.*:CudaGraph*:CudaMultiHeadAttention.*'

say "== 3. timings: Hopper route, then portable (same binary, same call)"
mkdir -p "$OUT/raw"
for b in decode prefill; do
  "$BUILD/bench/gpu/bench_$b" --quick --out "$OUT/raw/$b-hopper-1.json" >>"$log" 2>&1
  "$BUILD/bench/gpu/bench_$b" --quick "${portable[@]}" --out "$OUT/raw/$b-portable-1.json" \
    >>"$log" 2>&1
done
# torch's SDPA (cuDNN and flash) on the prefill shapes, and its ratios to the portable route.
python3 bench/gpu/peers_prefill.py --quick --out "$OUT/peers_prefill.json" >>"$log" 2>&1
python3 bench/gpu/report_prefill.py --ours "$OUT/raw/prefill-portable-1.json" \
  --peers "$OUT/peers_prefill.json" --json "$OUT/prefill_portable_vs_sdpa.json" \
  >"$OUT/prefill_portable_vs_sdpa.txt" 2>&1
{
  echo "# The portable kernels on a Hopper card: $(nvidia-smi --query-gpu=name,driver_version \
    --format=csv,noheader | head -1); not an A100 figure"
  echo "# commit $(build_commit), $(date -u +%Y-%m-%d), bench/gpu/portable_check.sh"
  echo "# checks: $fails failed"
  grep -E '^(==|[a-z_]+ rc=)' "$log"
  echo "## time per point: Hopper route, then kernels=portable (ratio > 1: slower)"
  python3 bench/gpu/ab_table.py "$OUT/raw" hopper portable
  echo "## prefill on the portable route against torch SDPA (same call)"
  cat "$OUT/prefill_portable_vs_sdpa.txt"
} >"bench/results/portable-$card.txt"
cp "bench/results/portable-$card.txt" "$OUT/"
say "portable_check.sh: $fails failed checks"
exit $((fails > 0))
