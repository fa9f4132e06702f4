#!/usr/bin/env bash
# A change to the Hopper prefill kernel, checked and timed in one device call: backend_ops with
# every row on the prefill kernel (both copy paths) and memcheck over a subset, then the changed
# build interleaved with the builds it is compared against on the points that matter
# (sweep_prefill_h200.sh), the full bench_prefill beside torch SDPA's cuDNN / flash
# (peers_prefill.py, report_prefill.py) and an ncu profile of d128 16k.
#
#   carry = build/carry (h200-bins.tar.gz: build/cuda-h200/{tests/backend_ops,
#   bench/gpu/bench_prefill} of the change, and each compared build's bench/gpu/bench_prefill
#   under build/ab/<name>/); then
#   OUT=... bash bench/gpu/ab_prefill_h200.sh base=build/ab/base cp=build/cuda-h200@VAR=value
# (arguments: sweep_prefill_h200.sh specs beside new=build/cuda-h200)
#
# STEPS (default "check sweep bench ncu") picks the parts to run.
#
# Writes $OUT/table.txt, $OUT/sweep.txt, $OUT/prefill.{json,png}, $OUT/prefill_profile.*,
# $OUT/logs.tar.gz.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
tar xzf build/carry/h200-bins.tar.gz
B=build/cuda-h200
O="${OUT:-$PWD/build/h200-ab}"
mkdir -p "$O"
S=$(date +%s)
t() { echo "[$(($(date +%s) - S))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
BO="$B/tests/backend_ops test --device cuda --backend cuda"
STEPS=" ${STEPS:-check sweep bench ncu} "
step() { [[ "$STEPS" == *" $1 "* ]]; }
if step check; then
# Every row on the prefill kernel, each copy path named (the default is one of them), then one
# CTA per work tile, then through one persistent CTA per launch (every work tile of a launch
# walked by the same CTA: the rings, Q's buffers and the turns carried over), on both copy
# paths and with turns in some work tiles only (those of 2 K/V tiles or more), and with the
# work tiles walked in groups of 3 (request, KV head) pairs (a smaller last group; one CTA per
# work tile and on the portable kernel too), by the static snake instead of the counter, and by
# two or three CTAs drawing from the counter (the dynamic walk runs where K/V come by TMA: the
# tma copy path); then the auto route with the defaults.
for run in "cp.async PAGEDATTN_CUDA_PREFILL_COPY=cp.async" "tma PAGEDATTN_CUDA_PREFILL_COPY=tma" \
  "per-tile PAGEDATTN_CUDA_PREFILL_PERSISTENT=off" \
  "static PAGEDATTN_CUDA_PREFILL_WALK=static" \
  "persist2 PAGEDATTN_CUDA_PREFILL_PERSISTENT=2" \
  "persist3-group3 PAGEDATTN_CUDA_PREFILL_PERSISTENT=3 PAGEDATTN_CUDA_PREFILL_PAIR_GROUP=3" \
  "persist1 PAGEDATTN_CUDA_PREFILL_PERSISTENT=1" \
  "persist1-cp PAGEDATTN_CUDA_PREFILL_PERSISTENT=1 PAGEDATTN_CUDA_PREFILL_COPY=cp.async" \
  "persist1-pp2 PAGEDATTN_CUDA_PREFILL_PERSISTENT=1 PAGEDATTN_CUDA_PINGPONG_MIN_TILES=2" \
  "group3 PAGEDATTN_CUDA_PREFILL_PAIR_GROUP=3" \
  "group3-per-tile PAGEDATTN_CUDA_PREFILL_PAIR_GROUP=3 PAGEDATTN_CUDA_PREFILL_PERSISTENT=off" \
  "group3-portable PAGEDATTN_CUDA_PREFILL_PAIR_GROUP=3 PAGEDATTN_CUDA_PREFILL_KERNEL=portable"; do
  # shellcheck disable=SC2086  # the run's variables, one word each
  PAGEDATTN_CUDA_PREFILL=all timeout 120 env ${run#* } $BO > "$O/bo_${run%% *}.log" 2>&1
  t "backend_ops, every row on the prefill kernel, ${run#* } rc=$?"
  grep -E "^backend.*passed|FAIL" "$O/bo_${run%% *}.log" | head -12
done
timeout 120 $BO > "$O/bo_auto.log" 2>&1
t "backend_ops, auto route rc=$?"
grep -E "^backend.*passed|FAIL" "$O/bo_auto.log" | head -12
# memcheck: every row on the prefill kernel with the defaults (TMA, turns in every work tile, a
# persistent grid), through one persistent CTA per launch, and the cp.async path over the tma
# cases.
for run in "default PAGEDATTN_CUDA_PREFILL_COPY=tma --filter d=128" \
  "persist1 PAGEDATTN_CUDA_PREFILL_PERSISTENT=1 --filter d=128" \
  "cp.async PAGEDATTN_CUDA_PREFILL_COPY=cp.async --filter ${SAN_FILTER:-tma}"; do
  read -r name vars <<<"$run"
  # shellcheck disable=SC2086  # the run's variable and filter, one word each
  PAGEDATTN_CUDA_PREFILL=all timeout 150 env ${vars%% --*} compute-sanitizer --tool memcheck \
    --error-exitcode 99 $BO --${vars#* --} > "$O/san_$name.log" 2>&1
  t "memcheck ${vars} (prefill kernel) rc=$?"
  tail -2 "$O/san_$name.log"
done
fi
if step sweep; then
ONLY="${ONLY:-ctx0 q4096 h32/8 d128 fp8,ctx0 q16384 h32/8 d128 fp8,q1024 h32/8 d128 auto,q4096 h32/8 d128 auto,q16384 h32/8 d128 auto,q4096 h32/8 d64,q16384 h32/8 d64,q4096 h32/8 d256,q16384 h32/8 d256,ctx8192 q1024,ctx32768 q1024,vit-mha}" \
  OUT="$O" timeout 500 bash bench/gpu/sweep_prefill_h200.sh "new=$B" "$@" > /dev/null 2>&1
t "sweep rc=$?"
python3 bench/gpu/sweep_table.py "$O/sweep.txt" | tee "$O/sweep_table.txt"
fi
if step bench; then
timeout 150 "$B/bench/gpu/bench_prefill" --out "$O/ours.json" > "$O/bench.log" 2>&1
t "bench_prefill rc=$?"
PYTHONUNBUFFERED=1 timeout 150 python3 bench/gpu/peers_prefill.py --out "$O/peers.json" \
  > "$O/peers.log" 2>&1
t "peers_prefill rc=$?"
python3 bench/gpu/report_prefill.py --ours "$O/ours.json" --peers "$O/peers.json" \
  --json "$O/prefill.json" --png "$O/prefill.png" \
  --meta "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)" > "$O/table.txt"
cat "$O/table.txt"
fi
if step ncu; then
OUT="$O" bash bench/gpu/profile_prefill_h200.sh "${PROFILE:-causal-d128 b1 ctx0 q16384 h32/8 d128 auto}" \
  > /dev/null 2>&1
t "ncu rc=$?"
cat "$O/prefill_profile.txt"
fi
# The device tool brings back a few files per call: the logs travel as one archive.
mkdir -p "$O/logs" && mv "$O"/*.log "$O"/ours*.json "$O"/peers.json "$O"/sweep_*.json "$O/logs/" 2>/dev/null
tar czf "$O/logs.tar.gz" -C "$O" logs && rm -rf "$O/logs"
t "done"
