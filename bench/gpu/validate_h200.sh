#!/usr/bin/env bash
# Correctness on the H200, from binaries built here and carried in build/carry/h200-bins.tar.gz:
# the CUDA unit tests, backend_ops with every prefill kernel forced and with auto selection, the
# MLA kernel variants, and compute-sanitizer memcheck. Logs under $OUT.
set -u
tar xzf build/carry/h200-bins.tar.gz
B=build/cuda-h200; O=$OUT; S=$(date +%s)
t(){ echo "[$(( $(date +%s)-S ))s] $*"; }
left(){ [ $(( $(date +%s)-S )) -lt "$1" ]; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
BO="$B/tests/backend_ops test --device cuda --backend cuda"
timeout 150 $B/tests/pagedattn_cuda_tests > $O/cuda_tests.log 2>&1; t "cuda_tests rc=$?"
grep -E "^\[  (PASSED|FAILED)|^\[  FAILED|tests ran" $O/cuda_tests.log | head -20
# query_quant: fp8 products on the Hopper kernel (d64/96/128), the 16-bit kernels elsewhere and
# with PAGEDATTN_CUDA_FP8_MATH=off, the auto route, and memcheck over the fp8-product kernel.
PAGEDATTN_CUDA_PREFILL=all timeout 60 $BO --filter qquant > $O/bo_qq_all.log 2>&1; t "bo qquant prefill=all rc=$?"; grep -E "^backend|FAIL" $O/bo_qq_all.log | head -12
PAGEDATTN_CUDA_PREFILL=all PAGEDATTN_CUDA_FP8_MATH=off timeout 60 $BO --filter qquant > $O/bo_qq_off.log 2>&1; t "bo qquant fp8 math off rc=$?"; grep -E "^backend|FAIL" $O/bo_qq_off.log | head -6
timeout 60 $BO --filter qquant > $O/bo_qq_auto.log 2>&1; t "bo qquant auto rc=$?"; grep -E "^backend|FAIL" $O/bo_qq_auto.log | head -6
PAGEDATTN_CUDA_PREFILL=all timeout 90 compute-sanitizer --tool memcheck --error-exitcode 99 $BO --filter qquant > $O/san_qq.log 2>&1; t "san qquant rc=$?"; tail -2 $O/san_qq.log
PAGEDATTN_CUDA_PREFILL=all timeout 150 $BO > $O/bo_all.log 2>&1; t "bo prefill=all rc=$?"; grep -E "^backend|FAIL" $O/bo_all.log | head -12
timeout 60 $BO --filter mla > $O/bo_mla.log 2>&1; t "bo mla rc=$?"; grep -E "^backend|FAIL" $O/bo_mla.log | head -6
PAGEDATTN_CUDA_SPLITS=5 timeout 60 $BO --filter mla > $O/bo_mla5.log 2>&1; t "bo mla splits5 rc=$?"; grep -E "^backend|FAIL" $O/bo_mla5.log | head -6
PAGEDATTN_CUDA_MLA_COPY=tma timeout 60 $BO --filter mla > $O/bo_mlatma.log 2>&1; t "bo mla tma at block 16 too rc=$?"; grep -E "^backend|FAIL" $O/bo_mlatma.log | head -6
PAGEDATTN_CUDA_MLA_COPY=cp.async timeout 60 $BO --filter mla > $O/bo_mlacp.log 2>&1; t "bo mla cp.async rc=$?"; grep -E "^backend|FAIL" $O/bo_mlacp.log | head -6
PAGEDATTN_CUDA_MLA=redundant timeout 60 $BO --filter mla > $O/bo_mlars.log 2>&1; t "bo mla redundant rc=$?"; grep -E "^backend|FAIL" $O/bo_mlars.log | head -6
PAGEDATTN_CUDA_MLA=redundant PAGEDATTN_CUDA_SPLITS=5 timeout 60 $BO --filter mla > $O/bo_mlars5.log 2>&1; t "bo mla redundant splits5 rc=$?"; grep -E "^backend|FAIL" $O/bo_mlars5.log | head -6
PAGEDATTN_CUDA_MLA=seesaw timeout 60 $BO --filter mla > $O/bo_mlass.log 2>&1; t "bo mla seesaw (16-bit caches; fp8 rows unsupported) rc=$?"; grep -E "^backend|FAIL" $O/bo_mlass.log | head -6
PAGEDATTN_CUDA_MLA=seesaw PAGEDATTN_CUDA_SPLITS=5 timeout 60 $BO --filter mla > $O/bo_mlass5.log 2>&1; t "bo mla seesaw splits5 rc=$?"; grep -E "^backend|FAIL" $O/bo_mlass5.log | head -6
PAGEDATTN_CUDA_MLA=swap-ab timeout 60 $BO --filter mla > $O/bo_mlasw.log 2>&1; t "bo mla swap-ab (576-column outputs unsupported) rc=$?"; grep -E "^backend|FAIL" $O/bo_mlasw.log | head -6
PAGEDATTN_CUDA_MLA=swap-ab-32 timeout 60 $BO --filter mla > $O/bo_mlasw32.log 2>&1; t "bo mla swap-ab-32 (576-column outputs unsupported) rc=$?"; grep -E "^backend|FAIL" $O/bo_mlasw32.log | head -6
PAGEDATTN_CUDA_MLA_MERGE=kernel timeout 60 $BO --filter mla > $O/bo_mlamk.log 2>&1; t "bo mla splits merged by the combine kernel rc=$?"; grep -E "^backend|FAIL" $O/bo_mlamk.log | head -6
PAGEDATTN_CUDA_MLA=split-s timeout 60 $BO --filter mla > $O/bo_mlasp.log 2>&1; t "bo mla split-s (auto's steps of <= 32 rows go to swap AB) rc=$?"; grep -E "^backend|FAIL" $O/bo_mlasp.log | head -6
PAGEDATTN_CUDA_PREFILL=all PAGEDATTN_CUDA_PREFILL_KERNEL=portable timeout 100 $BO > $O/bo_port.log 2>&1; t "bo portable prefill rc=$?"; grep -E "^backend|FAIL" $O/bo_port.log | head -6
left 420 && { timeout 60 $BO > $O/bo_auto.log 2>&1; t "bo auto rc=$?"; grep -E "^backend|FAIL" $O/bo_auto.log | head -8; }
left 480 && { PAGEDATTN_CUDA_PREFILL=all timeout 60 compute-sanitizer --tool memcheck --error-exitcode 99 $BO --filter dtypes > $O/san.log 2>&1; t "san rc=$?"; tail -2 $O/san.log; }
left 530 && { timeout 50 compute-sanitizer --tool memcheck --error-exitcode 99 $BO --filter mla > $O/san_mla.log 2>&1; t "san mla rc=$?"; tail -2 $O/san_mla.log; }
