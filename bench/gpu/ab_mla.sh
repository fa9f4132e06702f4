#!/usr/bin/env bash
# A change to the MLA decode kernel, checked and timed in one device call: for every build
# given, backend_ops --filter mla on the MLA routes (the default route, two, five and seven
# forced splits, cp.async copies, each consumer forced; the float64 reference with poisoned
# outputs) and compute-sanitizer memcheck, then bench_mla on the points that matter, the builds
# interleaved point by point for ROUNDS rounds, and a table of each build's best time per point
# with its ratio to the first build (and that round's fraction of the copy rate and TFLOP/s).
#
#   OUT=... bash bench/gpu/ab_mla.sh main=build/ab/main new=build/cuda-sm90 [...]
#   OUT=... bash bench/gpu/ab_mla.sh split=build/cuda-sm90 seesaw=build/cuda-sm90@mla_consumer=seesaw
#
# A build's path may carry @name=value suffixes: cuda options (`pagedattn backends` lists them)
# that every run of that build gets, so two variants of one binary compare as two builds;
# @out-cols=576 times bench_mla with --out-cols 576 instead. Each path holds tests/backend_ops
# and bench/gpu/bench_mla (a build of another commit: its cuda-sm90 build's binaries copied
# under build/ab/<name>/). POINTS (bench_mla --only labels, comma separated) and ROUNDS (default
# 2) change the timing part; CHECK=0 skips the checks (about 50 s per build: give the call's
# timeout room for both parts), CHECK=a,b checks only the builds named a and b. Writes
# $OUT/ab_mla.txt and $OUT/ab_mla_logs.tar.gz (few files: the device returns a limited number);
# the table ends with every build's time per round.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-$PWD/build/gpu-ab-mla}"
O="$(mktemp -d)"
mkdir -p "$OUT"
S=$(date +%s)
t() { echo "[$(($(date +%s) - S))s] $*"; }
POINTS="${POINTS:-h16q1 b64 ctx8192 ,h16q1 b128 ctx16384 ,h16q1-fp8 b64 ctx8192 ,h128q1 b64 ctx4096 ,h128q1 b64 ctx8192 ,h16q4 b64 ctx4096 ,bs16 ,long }"
ROUNDS="${ROUNDS:-2}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
names=()
# name=dir[@option=value...] -> name, dir, the build's --cuda-option flags (opts) and
# bench_mla's extra flags (mla_flags).
split_spec() {
  name="${1%%=*}"
  local rest="${1#*=}" item
  dir="${rest%%@*}"
  opts=()
  mla_flags=()
  IFS=@ read -ra items <<<"${rest#"$dir"}"
  for item in "${items[@]}"; do
    [ -n "$item" ] || continue
    if [[ "$item" == out-cols=* ]]; then
      mla_flags+=(--out-cols "${item#out-cols=}")
    else
      opts+=(--cuda-option "$item")
    fi
  done
}
for spec in "$@"; do
  split_spec "$spec"
  names+=("$name")
  case "${CHECK:-1}" in
    0) continue ;;
    1) ;;
    *) [[ ",$CHECK," == *",$name,"* ]] || continue ;;  # a list: check only the builds named
  esac
  BO=("$dir/tests/backend_ops" test --device cuda --backend cuda --filter mla "${opts[@]}")
  # The forced consumers too: auto gives the seesaw only the 128-head cases and swap AB only
  # steps of <= 16 / 32 rows a request (split-S the rest); the seesaw and swap AB refuse
  # 576-column outputs (reported unsupported, not failed).
  # Seven splits: the largest cluster merge area (config.h merge_bytes: 135 KB at 64 rows).
  for run in "default" "splits2 splits=2" "splits5 splits=5" "splits7 splits=7" \
    "cp.async mla_copy=cp.async" "seesaw mla_consumer=seesaw" "split-s mla_consumer=split-s" \
    "swap-ab mla_consumer=swap-ab" "swap-ab-32 mla_consumer=swap-ab-32"; do
    run_opts=()
    [ "$run" = default ] || run_opts=(--cuda-option "${run#* }")
    timeout 120 "${BO[@]}" "${run_opts[@]}" >"$O/bo_${name}_${run%% *}.log" 2>&1
    t "$name backend_ops ${run%% *} rc=$?: $(grep -E '^backend' "$O/bo_${name}_${run%% *}.log")"
    grep -m3 FAIL "$O/bo_${name}_${run%% *}.log"
  done
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 99 "${BO[@]}" >"$O/san_$name.log" 2>&1
  t "$name memcheck rc=$?: $(grep -E '^backend' "$O/san_$name.log"); $(grep 'ERROR SUMMARY' "$O/san_$name.log")"
done
for r in $(seq "$ROUNDS"); do
  IFS=, read -ra pts <<<"$POINTS"
  for pt in "${pts[@]}"; do
    for spec in "$@"; do
      split_spec "$spec"
      timeout 120 "$dir/bench/gpu/bench_mla" --out "$O/mla_${name}_r$r.json" --only "$pt" \
        "${opts[@]}" "${mla_flags[@]}" >"$O/mla_${name}_r${r}_${pt// /_}.log" 2>&1 ||
        t "$name '$pt' rc=$?"
      sed -n '2,$p' "$O/mla_${name}_r${r}_${pt// /_}.log" | sed "s/^/$name r$r: /"
    done
  done
done
python3 - "$O" "${names[@]}" <<'PY' | tee "$OUT/ab_mla.txt"
import glob, re, sys
from collections import defaultdict
out, names = sys.argv[1], sys.argv[2:]
best = defaultdict(dict)  # label -> name -> us
at_best = {}  # (label, name) -> (x copy, TFLOP/s) of the best round
rounds = defaultdict(list)  # (label, name) -> [(round, us)]
pat = re.compile(r"^(.*?)\s+([0-9.]+) us\s+([0-9]+) GB/s\s+([0-9.]+) x copy\s+([0-9.]+) TFLOP/s")
for n in names:
    for f in glob.glob(f"{out}/mla_{n}_r*_*.log"):
        r = int(re.search(rf"mla_{re.escape(n)}_r([0-9]+)_", f).group(1))
        for line in open(f):
            m = pat.match(line)
            if m:
                lab, us = m.group(1).strip(), float(m.group(2))
                if us < best[lab].get(n, 1e30):
                    best[lab][n] = us
                    at_best[(lab, n)] = (float(m.group(4)), float(m.group(5)))
                rounds[(lab, n)].append((r, us))
print(f"{'point':44s}" + "".join(f"{n:>12s}" for n in names) + "".join(
    f"{n + '/' + names[0]:>16s}" for n in names[1:]))
for lab, d in best.items():
    base = d.get(names[0])
    row = "".join(f"{d[n]:10.1f}us" if n in d else f"{'-':>12s}" for n in names)
    ratio = "".join(f"{base / d[n]:15.3f}x" if base and n in d else f"{'-':>16s}"
                    for n in names[1:])
    print(f"{lab:44s}{row}{ratio}")
print("(best of the rounds; ratio = first build's time / this build's: above 1 is faster)")
print("x copy | TFLOP/s at the best round:")
for lab in best:
    print(f"  {lab:44s}" + "".join(
        f"  {n} {at_best[(lab, n)][0]:.2f} | {at_best[(lab, n)][1]:.1f}" for n in names
        if (lab, n) in at_best))
print("per round (us, round 1 first):")
for lab in best:
    for n in names:
        if rounds[(lab, n)]:
            print(f"  {lab:44s} {n:>10s} " + " ".join(f"{us:.1f}" for _, us in sorted(rounds[(lab, n)])))
PY
tar -czf "$OUT/ab_mla_logs.tar.gz" -C "$O" .
