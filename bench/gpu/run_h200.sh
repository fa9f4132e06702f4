#!/usr/bin/env bash
# One command that checks and times the cuda backend on the H200 machine, writing files under
# $OUT (summary.txt, results.json, decode.png, prefill.json, prefill.png, dcp.json, and
# logs.tar.gz with every log: backend_ops*.log, cuda_tests.log, parallel_tests.log,
# nccl_tests.log, sanitizer.log, bench.log, prefill.log, dcp.log) and printing a short table
# last.
#
# The binaries are built HERE (the H200 image lacks CLI11 / nlohmann-json / libdlpack) with
#     cmake --preset cuda-h200 [-DNCCL_ROOT=<nvidia-nccl wheel's nvidia/nccl>]
#     cmake --build --preset cuda-h200
# and carried with the call: carry = build/cuda-h200/tests/backend_ops,
# build/cuda-h200/tests/pagedattn_cuda_tests, build/cuda-h200/bench/gpu/bench_decode,
# build/cuda-h200/bench/gpu/bench_prefill, and (built when NCCL was found)
# build/cuda-h200/tests/pagedattn_nccl_tests, build/cuda-h200/bench/gpu/bench_dcp; then
#     bash bench/gpu/run_h200.sh
# They link cudart statically and need only libc/libstdc++ and the driver there; the two NCCL
# binaries also load libnccl.so.2, which this script finds in NCCL_LIB_DIR, the python3's
# nvidia-nccl wheel (PyTorch's) or the system's. Each binary is about 23 MB (every kernel): more
# than two or three exceed the carry limit, so carry them as one archive (about 4x smaller),
#     tar czf build/carry/h200-bins.tar.gz build/cuda-h200/tests/{backend_ops,pagedattn_cuda_tests,pagedattn_nccl_tests} \
#         build/cuda-h200/bench/gpu/{bench_decode,bench_prefill,bench_dcp}
# carry = build/carry, and run `tar xzf build/carry/h200-bins.tar.gz && bash bench/gpu/run_h200.sh`.
#
# Parts can be skipped: SKIP_BACKEND_OPS=1 SKIP_TESTS=1 SKIP_PARALLEL=1 SKIP_NCCL=1
# SKIP_SANITIZER=1 SKIP_BENCH=1 SKIP_PEERS=1 SKIP_PREFILL_BENCH=1 SKIP_DCP_BENCH=1;
# BENCH_QUICK=1 runs a small benchmark matrix. Each part has a time limit so that the whole run
# stays under ~9 minutes of device time (ONLY=parallel runs the parallelism parts alone: the
# simulated ranks, the NCCL test and bench_dcp).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-$PWD/build/h200-out}"
BUILD="${PAGEDATTN_BUILD:-build/cuda-h200}"
mkdir -p "$OUT"
SCRATCH="$(mktemp -d)"
summary="$OUT/summary.txt"
: >"$summary"
say() { echo "$*" | tee -a "$summary"; }
start=$(date +%s)
elapsed() { echo "$(( $(date +%s) - start )) s"; }

backend_ops="$BUILD/tests/backend_ops"
cuda_tests="$BUILD/tests/pagedattn_cuda_tests"
bench="$BUILD/bench/gpu/bench_decode"
bench_prefill="$BUILD/bench/gpu/bench_prefill"
nccl_tests="$BUILD/tests/pagedattn_nccl_tests"
bench_dcp="$BUILD/bench/gpu/bench_dcp"
if [ "${ONLY:-}" = parallel ]; then
  SKIP_BACKEND_OPS=1 SKIP_TESTS=1 SKIP_SANITIZER=1 SKIP_BENCH=1 SKIP_PREFILL_BENCH=1
fi
for b in "$backend_ops" "$cuda_tests" "$bench" "$bench_prefill"; do
  [ -x "$b" ] || say "missing $b (build with the cuda-h200 preset here and carry it)"
done
# libnccl.so.2 for the NCCL binaries: NCCL_LIB_DIR, else the python3's nvidia-nccl wheel (PyTorch's),
# else the system's (ldconfig).
nccl_lib="${NCCL_LIB_DIR:-}"
if [ -z "$nccl_lib" ]; then
  wheel="$(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null)"
  [ -n "$wheel" ] && [ -e "$wheel/lib/libnccl.so.2" ] && nccl_lib="$wheel/lib"
fi
if [ -z "$nccl_lib" ]; then
  sys_nccl="$(ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2 / {print $NF; exit}')"
  [ -n "$sys_nccl" ] && nccl_lib="$(dirname "$sys_nccl")"
fi
nccl_why=""
if [ ! -x "$nccl_tests" ] || [ ! -x "$bench_dcp" ]; then
  nccl_why="pagedattn_nccl_tests / bench_dcp not carried (built only where CMake found NCCL)"
elif [ -z "$nccl_lib" ] || [ ! -e "$nccl_lib/libnccl.so.2" ]; then
  nccl_why="no libnccl.so.2 (no nvidia-nccl wheel for python3; set NCCL_LIB_DIR)"
elif ! nvidia-smi -L >/dev/null 2>&1; then
  nccl_why="no GPU (nvidia-smi -L failed)"
fi
with_nccl() { LD_LIBRARY_PATH="$nccl_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$@"; }

say "== device"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv,noheader 2>&1 | tee -a "$summary"
clocks_before="$(nvidia-smi --query-gpu=clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null)"

status=0
# ---- 1. every backend_ops case on the cuda backend (float64 reference, cache bytes) ----------
if [ "${SKIP_BACKEND_OPS:-0}" != 1 ]; then
  say "== backend_ops test --device cuda --backend cuda  ($(elapsed))"
  timeout 240 "$backend_ops" test --device cuda --backend cuda >"$OUT/backend_ops.log" 2>&1
  rc=$?
  grep -E "^backend |FAIL" "$OUT/backend_ops.log" | head -20 | tee -a "$summary"
  say "backend_ops rc=$rc"
  [ $rc -eq 0 ] || status=1
  # Every case again with every row on the prefill kernel (decode shapes included).
  say "== backend_ops, PAGEDATTN_CUDA_PREFILL=all  ($(elapsed))"
  PAGEDATTN_CUDA_PREFILL=all timeout 240 "$backend_ops" test --device cuda --backend cuda \
    >"$OUT/backend_ops_prefill_all.log" 2>&1
  rc=$?
  grep -E "^backend |FAIL" "$OUT/backend_ops_prefill_all.log" | head -20 | tee -a "$summary"
  say "backend_ops (prefill all) rc=$rc"
  [ $rc -eq 0 ] || status=1
  # And through the portable (mma.sync) prefill kernel, which Hopper otherwise does not run.
  say "== backend_ops, PAGEDATTN_CUDA_PREFILL=all, PAGEDATTN_CUDA_PREFILL_KERNEL=portable  ($(elapsed))"
  PAGEDATTN_CUDA_PREFILL=all PAGEDATTN_CUDA_PREFILL_KERNEL=portable timeout 240 "$backend_ops" \
    test --device cuda --backend cuda >"$OUT/backend_ops_portable.log" 2>&1
  rc=$?
  grep -E "^backend |FAIL" "$OUT/backend_ops_portable.log" | head -20 | tee -a "$summary"
  say "backend_ops (portable prefill) rc=$rc"
  [ $rc -eq 0 ] || status=1
  # The decode kernel's two copy paths, each forced for every shape (auto mixes them).
  for copy in bulk cp.async; do
    say "== backend_ops, PAGEDATTN_CUDA_DECODE_COPY=$copy  ($(elapsed))"
    PAGEDATTN_CUDA_DECODE_COPY=$copy timeout 240 "$backend_ops" test --device cuda --backend cuda \
      >"$SCRATCH/backend_ops_$copy.log" 2>&1
    rc=$?
    grep -E "^backend |FAIL" "$SCRATCH/backend_ops_$copy.log" | head -20 | tee -a "$summary"
    say "backend_ops (decode copy $copy) rc=$rc"
    [ $rc -eq 0 ] || status=1
  done
fi

# ---- 2. the GoogleTest binary (splits, graphs, checked mode, merge, amax) --------------------
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  say "== pagedattn_cuda_tests  ($(elapsed))"
  timeout 240 "$cuda_tests" --gtest_brief=1 --gtest_filter='-CudaParallel*:CudaMergeRanks*' \
    >"$OUT/cuda_tests.log" 2>&1
  rc=$?
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|FAILED TEST" "$OUT/cuda_tests.log" | head -30 |
    tee -a "$summary"
  say "pagedattn_cuda_tests rc=$rc"
  [ $rc -eq 0 ] || status=1
fi

# ---- 2b. parallelism on one GPU without a transport: merge_ranks, 2/3/4 simulated ranks ------
if [ "${SKIP_PARALLEL:-0}" != 1 ]; then
  say "== pagedattn_cuda_tests CudaMergeRanks* CudaParallel* (simulated ranks)  ($(elapsed))"
  timeout 240 "$cuda_tests" --gtest_filter='CudaMergeRanks*:CudaParallel*' \
    >"$OUT/parallel_tests.log" 2>&1
  rc=$?
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|FAILED TEST|^simulated ranks|^  refused" \
    "$OUT/parallel_tests.log" | head -30 | tee -a "$summary"
  say "simulated ranks rc=$rc"
  [ $rc -eq 0 ] || status=1
fi

# ---- 2c. TP and DCP over NCCL, one process per GPU (world = the visible GPUs, up to 8) --------
if [ "${SKIP_NCCL:-0}" != 1 ]; then
  say "== pagedattn_nccl_tests  ($(elapsed))"
  if [ -n "$nccl_why" ]; then
    say "skipped: $nccl_why"
  else
    with_nccl timeout 300 "$nccl_tests" --timeout 290 >"$OUT/nccl_tests.log" 2>&1
    rc=$?
    grep -E "^nccl_parallel|passed|FAIL|refused [0-9]|fork_ranks|error" "$OUT/nccl_tests.log" |
      head -30 | tee -a "$summary"
    if [ $rc -eq 77 ]; then
      say "pagedattn_nccl_tests skipped (no GPU visible to it)"
    else
      say "pagedattn_nccl_tests rc=$rc"
      [ $rc -eq 0 ] || status=1
    fi
  fi
fi

# ---- 3. compute-sanitizer on a reduced matrix ------------------------------------------------
if [ "${SKIP_SANITIZER:-0}" != 1 ]; then
  say "== compute-sanitizer  ($(elapsed))"
  san="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
  : >"$OUT/sanitizer.log"
  run_san() {  # tool, time limit, filter
    echo "---- $1 --filter '$3'" >>"$OUT/sanitizer.log"
    timeout "$2" "$san" --tool "$1" --error-exitcode 99 "$backend_ops" test --device cuda \
      --backend cuda --filter "$3" >>"$OUT/sanitizer.log" 2>&1
    local rc=$?
    say "sanitizer $1 '$3' (decode copy ${PAGEDATTN_CUDA_DECODE_COPY:-auto}): rc=$rc $(grep -c 'ERROR SUMMARY: 0 errors' "$OUT/sanitizer.log") clean summaries so far"
    [ $rc -eq 0 ] || status=1
  }
  run_san memcheck 150 "dtypes"
  PAGEDATTN_CUDA_DECODE_COPY=bulk run_san memcheck 150 "dtypes"
  PAGEDATTN_CUDA_DECODE_COPY=cp.async run_san memcheck 150 "layout"
  run_san memcheck 60 "layout"
  run_san memcheck 60 "everything"
  run_san racecheck 120 "layout"
  run_san synccheck 60 "block_size"
  timeout 120 "$san" --tool memcheck --error-exitcode 99 "$cuda_tests" \
    --gtest_filter='CudaMerge*:CudaAmax*:CudaChecked*' >>"$OUT/sanitizer.log" 2>&1
  rc=$?
  say "sanitizer memcheck cuda_tests (merge, amax, checked): rc=$rc"
  [ $rc -eq 0 ] || status=1
  # Damaged steps in checked mode (tests/cuda/test_cuda_input_fuzz.cpp): refused or harmless.
  timeout 300 "$san" --tool memcheck --error-exitcode 99 "$cuda_tests" \
    --gtest_filter='CudaInputFuzz*' >>"$OUT/sanitizer.log" 2>&1
  rc=$?
  say "sanitizer memcheck cuda_tests (input fuzz, checked mode): rc=$rc"
  [ $rc -eq 0 ] || status=1
fi

# ---- 4. benchmark: ours (paged) and the torch peers (contiguous) -----------------------------
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  say "== bench  ($(elapsed))"
  quick=()
  [ "${BENCH_QUICK:-0}" = 1 ] && quick=(--quick)
  timeout 200 "$bench" --out "$SCRATCH/ours.json" "${quick[@]}" >"$OUT/bench.log" 2>&1
  say "bench_decode rc=$?"
  peers=()
  if [ "${SKIP_PEERS:-0}" != 1 ]; then
    PYTHONUNBUFFERED=1 timeout 200 python3 bench/gpu/peers.py --out "$SCRATCH/peers.json" \
      "${quick[@]}" >>"$OUT/bench.log" 2>&1
    say "peers rc=$?"
    [ -s "$SCRATCH/peers.json" ] && peers=(--peers "$SCRATCH/peers.json")
  fi
  clocks_after="$(nvidia-smi --query-gpu=clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null)"
  if [ -s "$SCRATCH/ours.json" ]; then
    python3 bench/gpu/report.py --ours "$SCRATCH/ours.json" "${peers[@]}" \
      --json "$OUT/results.json" --png "$OUT/decode.png" \
      --clocks "sm,mem before: $clocks_before; after: $clocks_after" >"$SCRATCH/table.txt" 2>&1
    cat "$SCRATCH/table.txt" >>"$summary"
  else
    say "no benchmark results (see bench.log)"
    tail -5 "$OUT/bench.log"
  fi
fi

# ---- 5. prefill benchmark: ours (paged, shuffled blocks) and torch SDPA (contiguous) ---------
if [ "${SKIP_PREFILL_BENCH:-0}" != 1 ]; then
  say "== bench prefill  ($(elapsed))"
  quick=()
  [ "${BENCH_QUICK:-0}" = 1 ] && quick=(--quick)
  timeout 200 "$bench_prefill" --out "$SCRATCH/prefill_ours.json" "${quick[@]}" \
    >"$OUT/prefill.log" 2>&1
  say "bench_prefill rc=$?"
  echo "---- portable (mma.sync) prefill kernel, quick matrix" >>"$OUT/prefill.log"
  PAGEDATTN_CUDA_PREFILL_KERNEL=portable timeout 100 "$bench_prefill" --quick \
    --out "$SCRATCH/prefill_portable.json" >>"$OUT/prefill.log" 2>&1
  peers=()
  if [ "${SKIP_PEERS:-0}" != 1 ]; then
    PYTHONUNBUFFERED=1 timeout 200 python3 bench/gpu/peers_prefill.py \
      --out "$SCRATCH/prefill_peers.json" "${quick[@]}" >>"$OUT/prefill.log" 2>&1
    say "peers_prefill rc=$?"
    [ -s "$SCRATCH/prefill_peers.json" ] && peers=(--peers "$SCRATCH/prefill_peers.json")
  fi
  if [ -s "$SCRATCH/prefill_ours.json" ]; then
    python3 bench/gpu/report_prefill.py --ours "$SCRATCH/prefill_ours.json" "${peers[@]}" \
      --json "$OUT/prefill.json" --png "$OUT/prefill.png" \
      --meta "$(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null)" \
      >"$SCRATCH/prefill_table.txt" 2>&1
    cat "$SCRATCH/prefill_table.txt" >>"$summary"
  else
    say "no prefill results (see prefill.log)"
  fi
fi

# ---- 6. DCP decode over NCCL on 1, 2, 4, 8 GPUs (those visible; the rest listed as not run) --
if [ "${SKIP_DCP_BENCH:-0}" != 1 ]; then
  say "== bench_dcp  ($(elapsed))"
  if [ -n "$nccl_why" ]; then
    say "skipped: $nccl_why"
  else
    quick=()
    [ "${BENCH_QUICK:-0}" = 1 ] && quick=(--quick)
    with_nccl timeout 240 "$bench_dcp" --worlds 1,2,4,8 --out "$OUT/dcp.json" "${quick[@]}" \
      >"$OUT/dcp.log" 2>&1
    rc=$?
    sed -n '/^point /,$p' "$OUT/dcp.log" | tee -a "$summary"
    grep -E "not run|failed" "$OUT/dcp.log" | tee -a "$summary"
    say "bench_dcp rc=$rc"
    [ $rc -eq 0 ] || status=1
  fi
fi

say "== done in $(elapsed), status $status"
# The device tool brings back a few files per call: the logs travel as one archive.
(cd "$OUT" && tar -czf logs.tar.gz --remove-files ./*.log 2>/dev/null)
[ -s "$SCRATCH/table.txt" ] && cat "$SCRATCH/table.txt"
[ -s "$SCRATCH/prefill_table.txt" ] && cat "$SCRATCH/prefill_table.txt"
rm -rf "$SCRATCH"
exit $status
