#!/usr/bin/env bash
# Times the decode, prefill and MLA benchmarks of several builds of the library in one device
# call, the builds interleaved round by round, and tabulates each build's best time per point
# against the first build's (bench/gpu/ab_table.py). This is the check that a change meant to
# keep behaviour and speed (a refactor, a file move) left every kernel as fast as before.
#
#   OUT=... bash bench/gpu/ab_builds.sh base=build/ab/base new=build/cuda-sm90
#
# Each path holds bench/gpu/bench_{decode,prefill,mla} of one build (a build of another commit:
# its GPU binaries copied under build/ab/<name>/). BENCHES (default "decode prefill mla") picks
# the benchmarks, ROUNDS (default 2) the rounds, QUICK=1 their small matrices. Writes
# $OUT/ab.txt (the table, with every build's time per round) and $OUT/ab_raw.tar.gz (the JSON of
# every run).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-$PWD/build/gpu-ab}"
RAW="$(mktemp -d)"
mkdir -p "$OUT"
BENCHES="${BENCHES:-decode prefill mla}"
ROUNDS="${ROUNDS:-2}"
quick=()
[ "${QUICK:-0}" = 1 ] && quick=(--quick)
S=$(date +%s)
t() { echo "[$(($(date +%s) - S))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
names=()
for spec in "$@"; do
  name="${spec%%=*}" dir="${spec#*=}"
  names+=("$name")
  declare "dir_$name=$dir"
done
# Odd rounds run the builds in the order given, even rounds in reverse: a long run warms the card
# and the build that always runs second would pay for it.
for round in $(seq 1 "$ROUNDS"); do
  order=("${names[@]}")
  if [ $((round % 2)) = 0 ]; then
    order=()
    for ((i = ${#names[@]} - 1; i >= 0; i--)); do order+=("${names[$i]}"); done
  fi
  for bench in $BENCHES; do
    for name in "${order[@]}"; do
      dir_var="dir_$name"
      bin="${!dir_var}/bench/gpu/bench_$bench"
      if [ ! -x "$bin" ]; then
        t "missing $bin"
        continue
      fi
      timeout 300 "$bin" --out "$RAW/$bench-$name-$round.json" "${quick[@]}" \
        >"$RAW/$bench-$name-$round.log" 2>&1
      t "round $round $bench $name rc=$?"
    done
  done
done
python3 bench/gpu/ab_table.py "$RAW" "${names[@]}" | tee "$OUT/ab.txt"
tar czf "$OUT/ab_raw.tar.gz" -C "$RAW" .
