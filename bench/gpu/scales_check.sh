#!/usr/bin/env bash
# Per-KV-head k/v scales (cuda option head_scales=on) on a GPU machine, in one short call: the cuda tests of scales, write_kv,
# graphs and MultiHeadAttention, backend_ops' head_scales cases on six cuda routes, the whole
# matrix once (auto), which head_scales cases cuda refuses and why, and compute-sanitizer
# memcheck over them. Prints its results; OUT (the device tool's folder) keeps the logs.
#
#   tar xJf build/carry/bins.tar.xz && bash bench/gpu/scales_check.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-$PWD/build/gpu-out}"
mkdir -p "$OUT"
[ -f build/carry/bins.tar.xz ] && tar xJf build/carry/bins.tar.xz
B=build/cuda-sm90; O=$B/tests/backend_ops
nvidia-smi --query-gpu=name --format=csv,noheader
$B/tests/pagedattn_cuda_tests --gtest_filter='CudaBackendHost.*:CudaDecode.*:CudaWriteKV.*:CudaGraph*:CudaMultiHeadAttention.*' > $OUT/cuda_tests.log 2>&1; echo "cuda_tests rc=$?"; grep -E "^\[  (PASSED|FAILED)|FAILED  \]" $OUT/cuda_tests.log | head
for r in "head_scales=on" "head_scales=on prefill=all" "head_scales=on prefill=all prefill_kernel=portable" "head_scales=on splits=5" "head_scales=on decode_copy=cp.async" "head_scales=on prefill=off"; do a=(); for o in $r; do a+=(--cuda-option $o); done; $O test --device cuda --backend cuda --filter head_scales "${a[@]}" > $OUT/r.log 2>&1; echo "head_scales [${r:-auto}] rc=$? $(grep '^backend cuda:.*passed' $OUT/r.log) $(grep -m2 FAIL $OUT/r.log)"; done
$O test --device cuda --backend cuda > $OUT/all.log 2>&1; echo "whole matrix rc=$? $(grep '^backend cuda:.*passed' $OUT/all.log)"; grep -m3 FAIL $OUT/all.log
$O support --device cuda --backend cuda --filter head_scales --cuda-option head_scales=on | head -8
compute-sanitizer --tool memcheck --error-exitcode 9 $O test --device cuda --backend cuda --filter head_scales --cuda-option head_scales=on > $OUT/mc.log 2>&1; echo "memcheck rc=$? $(grep -m1 'ERROR SUMMARY' $OUT/mc.log)"
