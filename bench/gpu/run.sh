#!/usr/bin/env bash
# The one script that checks and times the cuda backend on a GPU machine. It detects the card
# (nvidia-smi: h100, h200 or other) and overwrites bench/results/<family>-<card>.{json,txt,png}
# for the families it times, each stamped with the card, the build's commit and the date.
#
# Binaries: built on the development machine and carried (bench/gpu/pack.sh), then
#     tar xzf build/carry/gpu-bins.tar.gz && bash bench/gpu/run.sh
#
# PARTS (default: all of them, in this order; more than one device call's 10 minutes, so split
# them over calls, e.g. PARTS="tests sanitizer" then PARTS="decode prefill mla dcp"):
#   tests      pagedattn_cuda_tests (splits, graphs, checked mode, merges, amax), then the GPU
#              route matrix: `ctest -L gpu`, backend_ops once per route of cuda options
#              (tests/CMakeLists.txt: pagedattn_gpu_route)
#   parallel   merge_ranks and 2/3/4 simulated ranks on one GPU; TP/DCP over NCCL, one process
#              per visible GPU
#   sanitizer  compute-sanitizer (memcheck on several routes, racecheck, synccheck) over
#              reduced matrices, memcheck over the merge / amax / checked-mode / input-fuzz tests
#   decode     bench_decode beside torch's decode peers (peers.py): decode-<card>.*
#   prefill    bench_prefill (and a quick pass of the portable kernel) beside torch SDPA
#              (peers_prefill.py): prefill-<card>.*
#   mla        bench_mla beside the torch MLA peers (peers_mla.py): mla-<card>.*, mla-peers-<card>.json
#   dcp        bench_dcp over NCCL on 1, 2, 4, 8 GPUs (those visible): dcp-<card>.json
# SKIP_PEERS=1 leaves the torch peers out; BENCH_QUICK=1 runs the small benchmark matrices.
#
# Writes $OUT/summary.txt and $OUT/logs.tar.gz (every log); the results under RESULTS (default
# bench/results) and, when OUT is set, also as $OUT/results.tar.gz (paths from the repository
# root: unpack it there), since the device tool brings back few files.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source bench/gpu/common.sh
OUT="${OUT:-$PWD/build/gpu-out}"
RESULTS="${RESULTS:-bench/results}"
PARTS=" ${PARTS:-tests parallel sanitizer decode prefill mla dcp} "
part() { [[ "$PARTS" == *" $1 "* ]]; }
mkdir -p "$OUT" "$RESULTS"
LOGS="$(mktemp -d)"
summary="$OUT/summary.txt"
: >"$summary"
say() { echo "$*" | tee -a "$summary"; }
start=$(date +%s)
elapsed() { echo "$(($(date +%s) - start)) s"; }
written=()  # result files, for results.tar.gz

backend_ops="$BUILD/tests/backend_ops"
cuda_tests="$BUILD/tests/pagedattn_cuda_tests"
bench_decode="$BUILD/bench/gpu/bench_decode"
bench_prefill="$BUILD/bench/gpu/bench_prefill"
bench_mla="$BUILD/bench/gpu/bench_mla"
nccl_tests="$BUILD/tests/pagedattn_nccl_tests"
bench_dcp="$BUILD/bench/gpu/bench_dcp"
for b in "$backend_ops" "$cuda_tests" "$bench_decode" "$bench_prefill" "$bench_mla"; do
  [ -x "$b" ] || say "missing $b (build with the cuda-sm90 preset, pack with bench/gpu/pack.sh)"
done
card="$(gpu_card)"
commit="$(build_commit)"
today="$(date -u +%Y-%m-%d)"
gpu_line="$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
quick=()
[ "${BENCH_QUICK:-0}" = 1 ] && quick=(--quick)

# libnccl.so.2 for the NCCL binaries: NCCL_LIB_DIR, else the python3's nvidia-nccl wheel
# (PyTorch's), else the system's (ldconfig).
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

# A result file's JSON gets the card, the commit and the date first.
stamp_json() {
  python3 - "$1" "$card" "$commit" "$today" <<'PY'
import json, sys
path, card, commit, date = sys.argv[1:]
doc = json.load(open(path))
doc = {"card": card, "commit": commit, "date": date, **{k: v for k, v in doc.items()
                                                          if k not in ("card", "commit", "date")}}
json.dump(doc, open(path, "w"), indent=1)
open(path, "a").write("\n")
PY
}
# The first line of a result table: what, on which card, from which commit, when.
header() {
  echo "# $1 results: card $gpu_line, commit $commit, $today (bench/gpu/run.sh; $2)"
}

say "== device ($card, commit $commit)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv,noheader 2>&1 | tee -a "$summary"
status=0

# ---- tests: the GoogleTest binary, then one backend_ops run per route (ctest -L gpu) ---------
if part tests; then
  say "== pagedattn_cuda_tests  ($(elapsed))"
  timeout 240 "$cuda_tests" --gtest_brief=1 --gtest_filter='-CudaParallel*:CudaMergeRanks*' \
    >"$LOGS/cuda_tests.log" 2>&1
  rc=$?
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|FAILED TEST" "$LOGS/cuda_tests.log" | head -30 |
    tee -a "$summary"
  say "pagedattn_cuda_tests rc=$rc"
  [ $rc -eq 0 ] || status=1
  say "== ctest -L gpu: backend_ops on every route  ($(elapsed))"
  if relocate_build >>"$summary" 2>&1; then
    timeout 500 ctest --test-dir "$BUILD" -L '^gpu$' --output-on-failure --timeout 300 \
      >"$LOGS/routes.log" 2>&1
    rc=$?
    grep -E "Test +#|tests passed|FAILED|Failed" "$LOGS/routes.log" | tee -a "$summary"
    say "ctest gpu routes rc=$rc"
    [ $rc -eq 0 ] || status=1
  else
    status=1
  fi
fi

# ---- parallel: merge_ranks and simulated ranks on one GPU; TP and DCP over NCCL --------------
if part parallel; then
  say "== pagedattn_cuda_tests CudaMergeRanks* CudaParallel* (simulated ranks)  ($(elapsed))"
  timeout 240 "$cuda_tests" --gtest_filter='CudaMergeRanks*:CudaParallel*' \
    >"$LOGS/parallel_tests.log" 2>&1
  rc=$?
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|FAILED TEST|^simulated ranks|^  refused" \
    "$LOGS/parallel_tests.log" | head -30 | tee -a "$summary"
  say "simulated ranks rc=$rc"
  [ $rc -eq 0 ] || status=1
  say "== pagedattn_nccl_tests  ($(elapsed))"
  if [ -n "$nccl_why" ]; then
    say "skipped: $nccl_why"
  else
    with_nccl timeout 300 "$nccl_tests" --timeout 290 >"$LOGS/nccl_tests.log" 2>&1
    rc=$?
    grep -E "^nccl_parallel|passed|FAIL|refused [0-9]|fork_ranks|error" "$LOGS/nccl_tests.log" |
      head -30 | tee -a "$summary"
    if [ $rc -eq 77 ]; then
      say "pagedattn_nccl_tests skipped (no GPU visible to it)"
    else
      say "pagedattn_nccl_tests rc=$rc"
      [ $rc -eq 0 ] || status=1
    fi
  fi
fi

# ---- sanitizer: compute-sanitizer over reduced matrices, on several routes -------------------
if part sanitizer; then
  say "== compute-sanitizer  ($(elapsed))"
  san="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
  log="$LOGS/sanitizer.log"
  : >"$log"
  run_san() {  # tool, time limit, filter, cuda options...
    local tool=$1 limit=$2 filter=$3
    shift 3
    local opts=()
    for o in "$@"; do opts+=(--cuda-option "$o"); done
    echo "---- $tool --filter '$filter' $*" >>"$log"
    timeout "$limit" "$san" --tool "$tool" --error-exitcode 99 "$backend_ops" test --device cuda \
      --backend cuda --filter "$filter" "${opts[@]}" >>"$log" 2>&1
    local rc=$?
    say "sanitizer $tool '$filter' ${*:-(auto)}: rc=$rc"
    [ $rc -eq 0 ] || status=1
  }
  run_san memcheck 150 dtypes
  run_san memcheck 150 dtypes decode_copy=bulk
  run_san memcheck 150 layout decode_copy=cp.async
  run_san memcheck 60 layout
  run_san memcheck 60 everything
  run_san memcheck 90 qquant prefill=all
  run_san memcheck 150 d=128 prefill=all
  run_san memcheck 150 d=128 prefill=all prefill_persistent=1
  run_san memcheck 150 tma prefill=all prefill_copy=cp.async
  run_san memcheck 150 mla
  run_san racecheck 120 layout
  run_san synccheck 60 block_size
  timeout 120 "$san" --tool memcheck --error-exitcode 99 "$cuda_tests" \
    --gtest_filter='CudaMerge*:CudaAmax*:CudaChecked*' >>"$log" 2>&1
  rc=$?
  say "sanitizer memcheck cuda_tests (merge, amax, checked): rc=$rc"
  [ $rc -eq 0 ] || status=1
  # Damaged steps in checked mode (tests/cuda/test_cuda_input_fuzz.cpp): refused or harmless.
  timeout 300 "$san" --tool memcheck --error-exitcode 99 "$cuda_tests" \
    --gtest_filter='CudaInputFuzz*' >>"$log" 2>&1
  rc=$?
  say "sanitizer memcheck cuda_tests (input fuzz, checked mode): rc=$rc"
  [ $rc -eq 0 ] || status=1
  say "$(grep -c 'ERROR SUMMARY: 0 errors' "$log") clean sanitizer summaries"
fi

# ---- decode: ours (paged) and the torch peers (contiguous) -----------------------------------
if part decode; then
  say "== bench_decode  ($(elapsed))"
  clocks_before="$(nvidia-smi --query-gpu=clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null)"
  timeout 200 "$bench_decode" --out "$LOGS/decode_ours.json" "${quick[@]}" \
    >"$LOGS/bench_decode.log" 2>&1
  say "bench_decode rc=$?"
  peers=()
  if [ "${SKIP_PEERS:-0}" != 1 ]; then
    PYTHONUNBUFFERED=1 timeout 200 python3 bench/gpu/peers.py --out "$LOGS/decode_peers.json" \
      "${quick[@]}" >>"$LOGS/bench_decode.log" 2>&1
    say "peers rc=$?"
    [ -s "$LOGS/decode_peers.json" ] && peers=(--peers "$LOGS/decode_peers.json")
  fi
  clocks_after="$(nvidia-smi --query-gpu=clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null)"
  if [ -s "$LOGS/decode_ours.json" ]; then
    f="$RESULTS/decode-$card"
    { header decode "bench_decode beside peers.py"
      python3 bench/gpu/report.py --ours "$LOGS/decode_ours.json" "${peers[@]}" \
        --json "$f.json" --png "$f.png" \
        --clocks "sm,mem before: $clocks_before; after: $clocks_after" 2>&1; } >"$f.txt"
    stamp_json "$f.json"
    written+=("$f.json" "$f.txt" "$f.png")
    tail -n +2 "$f.txt" >>"$summary"
  else
    say "no decode results (see bench_decode.log)"
  fi
fi

# ---- prefill: ours (paged, shuffled blocks) and torch SDPA (contiguous) ----------------------
if part prefill; then
  say "== bench_prefill  ($(elapsed))"
  timeout 200 "$bench_prefill" --out "$LOGS/prefill_ours.json" "${quick[@]}" \
    >"$LOGS/bench_prefill.log" 2>&1
  say "bench_prefill rc=$?"
  echo "---- portable (mma.sync) prefill kernel, quick matrix" >>"$LOGS/bench_prefill.log"
  timeout 100 "$bench_prefill" --quick --cuda-option prefill_kernel=portable \
    --out "$LOGS/prefill_portable.json" >>"$LOGS/bench_prefill.log" 2>&1
  peers=()
  if [ "${SKIP_PEERS:-0}" != 1 ]; then
    PYTHONUNBUFFERED=1 timeout 200 python3 bench/gpu/peers_prefill.py \
      --out "$LOGS/prefill_peers.json" "${quick[@]}" >>"$LOGS/bench_prefill.log" 2>&1
    say "peers_prefill rc=$?"
    [ -s "$LOGS/prefill_peers.json" ] && peers=(--peers "$LOGS/prefill_peers.json")
  fi
  if [ -s "$LOGS/prefill_ours.json" ]; then
    f="$RESULTS/prefill-$card"
    { header prefill "bench_prefill beside peers_prefill.py"
      python3 bench/gpu/report_prefill.py --ours "$LOGS/prefill_ours.json" "${peers[@]}" \
        --json "$f.json" --png "$f.png" --meta "$gpu_line" 2>&1; } >"$f.txt"
    stamp_json "$f.json"
    written+=("$f.json" "$f.txt" "$f.png")
    tail -n +2 "$f.txt" >>"$summary"
  else
    say "no prefill results (see bench_prefill.log)"
  fi
fi

# ---- mla: ours (paged latent cache) and the torch MLA peers (contiguous) ---------------------
if part mla; then
  say "== bench_mla  ($(elapsed))"
  f="$RESULTS/mla-$card"
  timeout 240 "$bench_mla" --out "$f.json" "${quick[@]}" >"$LOGS/bench_mla.log" 2>&1
  rc=$?
  say "bench_mla rc=$rc"
  if [ -s "$f.json" ]; then
    { header "MLA decode" "bench_mla; peers in mla-peers-$card.json"
      cat "$LOGS/bench_mla.log"; } >"$f.txt"
    stamp_json "$f.json"
    written+=("$f.json" "$f.txt")
    tail -n +2 "$f.txt" >>"$summary"
  fi
  if [ "${SKIP_PEERS:-0}" != 1 ]; then
    PYTHONUNBUFFERED=1 timeout 200 python3 bench/gpu/peers_mla.py --out "$RESULTS/mla-peers-$card.json" \
      "${quick[@]}" >"$LOGS/peers_mla.log" 2>&1
    rc=$?
    say "peers_mla rc=$rc"
    if [ -s "$RESULTS/mla-peers-$card.json" ]; then
      stamp_json "$RESULTS/mla-peers-$card.json"
      written+=("$RESULTS/mla-peers-$card.json")
    fi
  fi
fi

# ---- dcp: DCP decode over NCCL on 1, 2, 4, 8 GPUs (those visible; the rest listed as not run) -
if part dcp; then
  say "== bench_dcp  ($(elapsed))"
  if [ -n "$nccl_why" ]; then
    say "skipped: $nccl_why"
  else
    f="$RESULTS/dcp-$card"
    with_nccl timeout 240 "$bench_dcp" --worlds 1,2,4,8 --out "$f.json" "${quick[@]}" \
      >"$LOGS/bench_dcp.log" 2>&1
    rc=$?
    sed -n '/^point /,$p' "$LOGS/bench_dcp.log" | tee -a "$summary"
    grep -E "not run|failed" "$LOGS/bench_dcp.log" | tee -a "$summary"
    say "bench_dcp rc=$rc"
    [ $rc -eq 0 ] || status=1
    if [ -s "$f.json" ]; then
      stamp_json "$f.json"
      written+=("$f.json")
    fi
  fi
fi

say "== done in $(elapsed), status $status"
# The device tool brings back a few files per call: the logs and the results travel as archives.
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" .
if [ ${#written[@]} -gt 0 ] && [ "$(cd "$RESULTS" && pwd)" != "$(cd "$OUT" && pwd)" ]; then
  tar -czf "$OUT/results.tar.gz" "${written[@]}"
  say "results: ${written[*]} (also in $OUT/results.tar.gz)"
fi
rm -rf "$LOGS"
exit $status
