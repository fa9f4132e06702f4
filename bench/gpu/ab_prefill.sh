#!/usr/bin/env bash
# A change to the Hopper prefill kernel, checked and timed in one device call: the prefill
# routes of the GPU route matrix (`ctest -L gpu -R gpu_prefill`: every row on the prefill
# kernel, each copy path, one / two / three persistent CTAs, small pair groups, the static
# walk, the portable kernel) and the auto route, memcheck over a subset, then the changed build
# interleaved with the builds it is compared against on the points that matter
# (sweep_prefill.sh), the full bench_prefill beside torch SDPA's cuDNN / flash
# (peers_prefill.py, report_prefill.py) and an ncu profile of d128 16k.
#
#   carry = build/carry (gpu-bins.tar.gz from bench/gpu/pack.sh, and each compared build's
#   bench/gpu/bench_prefill under build/ab/<name>/); then
#   OUT=... bash bench/gpu/ab_prefill.sh base=build/ab/base cp=build/cuda-sm90@prefill_copy=cp.async
# (arguments: sweep_prefill.sh specs beside new=build/cuda-sm90)
#
# STEPS (default "check sweep bench ncu") picks the parts to run.
#
# Writes $OUT/table.txt, $OUT/sweep.txt, $OUT/prefill.{json,png}, $OUT/prefill_profile.*,
# $OUT/logs.tar.gz.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
tar xzf build/carry/gpu-bins.tar.gz
source bench/gpu/common.sh
B="$BUILD"
O="${OUT:-$PWD/build/gpu-ab}"
mkdir -p "$O"
S=$(date +%s)
t() { echo "[$(($(date +%s) - S))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
BO=("$B/tests/backend_ops" test --device cuda --backend cuda)
STEPS=" ${STEPS:-check sweep bench ncu} "
step() { [[ "$STEPS" == *" $1 "* ]]; }
if step check; then
  relocate_build
  timeout 400 ctest --test-dir "$B" -L '^gpu$' -R '^gpu_(auto|prefill_)' --output-on-failure \
    >"$O/routes.log" 2>&1
  t "ctest prefill routes rc=$?"
  grep -E "Test +#|tests passed|FAILED" "$O/routes.log"
  # memcheck: every row on the prefill kernel with the defaults (TMA, a persistent grid),
  # through one persistent CTA per launch, and the cp.async path over the tma cases.
  for run in "default d=128" "persist1 d=128 prefill_persistent=1" \
    "cp.async ${SAN_FILTER:-tma} prefill_copy=cp.async"; do
    read -r name filter option <<<"$run"
    opts=(--cuda-option prefill=all)
    [ -n "${option:-}" ] && opts+=(--cuda-option "$option")
    timeout 150 compute-sanitizer --tool memcheck --error-exitcode 99 "${BO[@]}" \
      --filter "$filter" "${opts[@]}" >"$O/san_$name.log" 2>&1
    t "memcheck --filter $filter ${opts[*]} rc=$?"
    tail -2 "$O/san_$name.log"
  done
fi
if step sweep; then
ONLY="${ONLY:-ctx0 q4096 h32/8 d128 fp8,ctx0 q16384 h32/8 d128 fp8,q1024 h32/8 d128 auto,q4096 h32/8 d128 auto,q16384 h32/8 d128 auto,q4096 h32/8 d64,q16384 h32/8 d64,q4096 h32/8 d256,q16384 h32/8 d256,ctx8192 q1024,ctx32768 q1024,vit-mha}" \
  OUT="$O" timeout 500 bash bench/gpu/sweep_prefill.sh "new=$B" "$@" > /dev/null 2>&1
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
OUT="$O" bash bench/gpu/profile_prefill.sh "${PROFILE:-causal-d128 b1 ctx0 q16384 h32/8 d128 auto}" \
  > /dev/null 2>&1
t "ncu rc=$?"
cat "$O/prefill_profile.txt"
fi
# The device tool brings back a few files per call: the logs travel as one archive.
mkdir -p "$O/logs" && mv "$O"/*.log "$O"/ours*.json "$O"/peers.json "$O"/sweep_*.json "$O/logs/" 2>/dev/null
tar czf "$O/logs.tar.gz" -C "$O" logs && rm -rf "$O/logs"
t "done"
