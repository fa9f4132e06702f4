#!/usr/bin/env bash
# Times the same prefill points with several builds of bench_prefill side by side in one device
# call (a tuning sweep: each build compiled with different experiment macros, or the same
# binary under run-time switches), interleaved twice so that clock drift shows up as a spread
# rather than as a difference between variants.
#
#   ONLY='causal-d128' bash bench/gpu/sweep_prefill_h200.sh base=build/ab/base new=build/cuda-h200
#
# A spec name=dir@VAR=value[@VAR=value...] runs that build with those environment variables set
# (e.g. cp=build/cuda-h200@PAGEDATTN_CUDA_PREFILL_COPY=cp.async).
#
# Writes $OUT/sweep.txt (name, label, us, TFLOP/s per line) and prints it.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-$PWD/build/h200-out}"
mkdir -p "$OUT"
only=()
[ -n "${ONLY:-}" ] && only=(--only "$ONLY")
: >"$OUT/sweep.txt"
for round in 1 2; do
  for spec in "$@"; do
    name="${spec%%=*}" dir="${spec#*=}" setenv=()
    if [[ "$dir" == *@* ]]; then
      IFS=@ read -ra vars <<<"${dir#*@}"
      setenv=(env "${vars[@]}")
      dir="${dir%%@*}"
    fi
    bin="$dir/bench/gpu/bench_prefill"
    if [ ! -x "$bin" ]; then
      echo "$name: missing $bin" | tee -a "$OUT/sweep.txt"
      continue
    fi
    timeout 120 "${setenv[@]}" "$bin" "${only[@]}" --out "$OUT/sweep_${name}_$round.json" 2>&1 |
      grep -E "TFLOP/s|skipped|error" | sed "s/^/$name r$round  /" | tee -a "$OUT/sweep.txt"
  done
done
