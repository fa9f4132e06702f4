#!/usr/bin/env bash
# Head sizes between and below the compiled ones on a GPU machine, in one call: backend_ops'
# any_head and v_head (V of its own head size) cases on every cuda route (plus the whole matrix
# once, as a control), compute-sanitizer memcheck over them, the host checks of pagedattn_cuda_tests, then the head-size
# sweeps of bench_decode (bytes/s) and bench_prefill (FLOP/s at the problem's head size) and
# their ratios to the nearest compiled size (head_sizes_table.py). Writes
# bench/results/head-sizes-<card>.txt (stamped with card, commit and date) and, when OUT is
# set, the logs and the result under $OUT.
#
#   tar xzf build/carry/gpu-bins.tar.gz && bash bench/gpu/head_sizes.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source bench/gpu/common.sh
OUT="${OUT:-$PWD/build/gpu-out}"
mkdir -p "$OUT" bench/results
card="$(gpu_card)"
log="$OUT/head_sizes.log"
: >"$log"
ops="$BUILD/tests/backend_ops"
fails=0

say "== backend_ops any_head and v_head per route ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1))"
routes=("" "decode_copy=bulk" "decode_copy=cp.async" "splits=5" "prefill=off" "prefill=all"
  "prefill=all prefill_kernel=portable" "prefill=all prefill_copy=cp.async"
  "prefill=all prefill_persistent=1")
for f in any_head v_head; do
  for r in "${routes[@]}"; do
    args=()
    for o in $r; do args+=(--cuda-option "$o"); done
    [ "$f" = v_head ] && args+=(--cuda-option v_head=on)  # off by default until this passes
    "$ops" test --device cuda --backend cuda --filter $f "${args[@]}" >"$OUT/route.log" 2>&1
    rc=$?
    line="$(grep '^backend cuda:.*passed' "$OUT/route.log"; grep -m3 FAIL "$OUT/route.log")"
    cat "$OUT/route.log" >>"$OUT/routes.log"
    say "route $f [${r:-auto}] rc=$rc: $line"
    [ "$rc" = 0 ] || fails=$((fails + 1))
  done
done
say "== backend_ops, the whole matrix (auto)"
"$ops" test --device cuda --backend cuda >"$OUT/backend_ops_all.log" 2>&1
rc=$?
say "rc=$rc: $(grep '^backend cuda:.*passed' "$OUT/backend_ops_all.log")"
[ "$rc" = 0 ] || fails=$((fails + 1))
"$ops" support --device cuda --backend cuda --filter any_head >>"$log" 2>&1
"$ops" support --device cuda --backend cuda --filter v_head --cuda-option v_head=on >>"$log" 2>&1

say "== compute-sanitizer memcheck, any_head and v_head (auto and prefill=all)"
for f in any_head v_head; do
  for r in "" "prefill=all"; do
    args=()
    for o in $r; do args+=(--cuda-option "$o"); done
    [ "$f" = v_head ] && args+=(--cuda-option v_head=on)
    mc="$OUT/memcheck_${f}_${r// /_}.log"
    compute-sanitizer --tool memcheck --error-exitcode 9 "$ops" test --device cuda --backend cuda \
      --filter $f "${args[@]}" >"$mc" 2>&1
    rc=$?
    say "memcheck $f [${r:-auto}] rc=$rc: $(grep -m1 'ERROR SUMMARY' "$mc")"
    [ "$rc" = 0 ] || fails=$((fails + 1))
  done
done

say "== pagedattn_cuda_tests (host checks, decode, graphs, MultiHeadAttention)"
"$BUILD/tests/pagedattn_cuda_tests" --gtest_filter='CudaBackendHost.*:CudaDecode.*:CudaGraph*:CudaMultiHeadAttention.*:CudaAttentionPadding.*' \
  >"$OUT/cuda_tests.log" 2>&1
rc=$?
say "rc=$rc: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/cuda_tests.log" | tr '\n' ' ')"
[ "$rc" = 0 ] || fails=$((fails + 1))

say "== benchmarks"
"$BUILD/bench/gpu/bench_decode" --only heads- --out "$OUT/decode_heads.json" >>"$log" 2>&1
"$BUILD/bench/gpu/bench_prefill" --only heads-,vit-mha --out "$OUT/prefill_heads.json" >>"$log" 2>&1
{
  echo "# Head sizes on the cuda backend: $(nvidia-smi --query-gpu=name,driver_version \
    --format=csv,noheader | head -1)"
  echo "# commit $(build_commit), $(date -u +%Y-%m-%d), bench/gpu/head_sizes.sh"
  echo "# checks: $fails failed (the log's lines follow the tables)"
  python3 bench/gpu/head_sizes_table.py "$OUT/decode_heads.json" "$OUT/prefill_heads.json"
  echo
  grep -E '^(==|route|rc=|memcheck)' "$log"
} >"bench/results/head-sizes-$card.txt"
cp "bench/results/head-sizes-$card.txt" "$OUT/"
say "head_sizes.sh: $fails failed checks"
exit $((fails > 0))
