#!/usr/bin/env bash
# A variant of a few kernel instances for an A/B run on the H200 without a second full build:
# each named instance recompiled with extra defines (experiment macros such as
# PAGEDATTN_SM90_STAGES_D64 or PAGEDATTN_SM90_FP8_AHEAD), swapped into a copy of the build's
# libpagedattn.a, and the binaries in TARGETS (default bench_prefill and backend_ops) relinked
# against it into build/ab/NAME/.
#
#   bash bench/gpu/build_variant.sh d64s4 "-DPAGEDATTN_SM90_STAGES_D64=4" prefill_sm90_bf16_same_d64.cu
#
# The build (PAGEDATTN_BUILD, default build/cuda-h200) must be up to date with the sources; each
# instance's ptxas report (registers, spills) is left beside its object in $WORK/NAME. One
# instance takes about a minute on the 2-core host; carry build/ab/NAME with the call and time
# it with sweep_prefill_h200.sh (NAME=build/ab/NAME).
set -euo pipefail
[ $# -ge 3 ] || { sed -n 2,12p "$0"; exit 2; }
name=$1 defines=$2
shift 2
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="$root/${PAGEDATTN_BUILD:-build/cuda-h200}"
work="${WORK:-$root/build/variants}/$name"
out="$root/build/ab/$name"
rm -rf "$work"
mkdir -p "$work" "$out/tests" "$out/bench/gpu"
cp "$build/src/libpagedattn.a" "$work/libpagedattn.a"
cd "$build"
for src in "$@"; do
  cmd="$(python3 - "$src" <<'PY'
import json, sys
hits = [e["command"] for e in json.load(open("compile_commands.json"))
        if e["file"].endswith("/" + sys.argv[1])]
if len(hits) != 1:
    sys.exit(f"{sys.argv[1]}: {len(hits)} entries in compile_commands.json")
print(hits[0])
PY
)"
  # The archive holds members by their object's file name: the variant keeps that name.
  obj="$work/$src.o"
  cmd="${cmd/ -x cu / $defines -Xptxas=-v -x cu }"
  eval "${cmd% -o *} -o $obj" >"$obj.ptxas" 2>&1 || { tail -20 "$obj.ptxas"; exit 1; }
  grep -E "registers|spill" "$obj.ptxas" | sort | uniq -c
  (cd "$work" && ar r libpagedattn.a "$src.o")
done
targets="${TARGETS:-bench/gpu/bench_prefill tests/backend_ops}"
for target in $targets; do
  link="$(ninja -t commands "$target" | tail -1)"
  link="${link//src\/libpagedattn.a/$work/libpagedattn.a}"
  rest="${link##* -o }"
  eval "${link% -o *} -o $out/$target ${rest#* }"
  strip "$out/$target"
done
for target in $targets; do ls -la "$out/$target"; done
