#!/usr/bin/env bash
# Times the same prefill points with several builds of bench_prefill side by side in one device
# call (a tuning sweep: builds of different commits, or the same binary under different cuda
# options), interleaved twice so that clock drift shows up as a spread rather than as a
# difference between variants.
#
#   ONLY='causal-d128' bash bench/gpu/sweep_prefill.sh base=build/ab/base new=build/cuda-sm90
#
# A spec name=dir@name=value[@name=value...] runs that build with those cuda options (`pagedattn
# backends` lists them; e.g. cp=build/cuda-sm90@prefill_copy=cp.async).
#
# Writes $OUT/sweep.txt (name, label, us, TFLOP/s per line; sweep_table.py tabulates it) and
# prints it.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-$PWD/build/gpu-out}"
mkdir -p "$OUT"
only=()
[ -n "${ONLY:-}" ] && only=(--only "$ONLY")
: >"$OUT/sweep.txt"
for round in 1 2; do
  for spec in "$@"; do
    name="${spec%%=*}" dir="${spec#*=}" opts=()
    if [[ "$dir" == *@* ]]; then
      IFS=@ read -ra items <<<"${dir#*@}"
      for item in "${items[@]}"; do opts+=(--cuda-option "$item"); done
      dir="${dir%%@*}"
    fi
    bin="$dir/bench/gpu/bench_prefill"
    if [ ! -x "$bin" ]; then
      echo "$name: missing $bin" | tee -a "$OUT/sweep.txt"
      continue
    fi
    timeout 120 "$bin" "${only[@]}" "${opts[@]}" --out "$OUT/sweep_${name}_$round.json" 2>&1 |
      grep -E "TFLOP/s|skipped|error" | sed "s/^/$name r$round  /" | tee -a "$OUT/sweep.txt"
  done
done
