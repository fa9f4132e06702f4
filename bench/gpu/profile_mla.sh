#!/usr/bin/env bash
# Nsight Compute profile of the MLA decode kernel on a GPU machine, for docs/kernels/mla.md:
# the full section set of one mla_kernel launch per bench_mla point, the warp
# stall reasons and busiest pipes, and the SASS instructions with the most stall samples (by
# instruction and by opcode), so the per-tile chain can be read off the profile.
#
#   OUT=... bash bench/gpu/profile_mla.sh ["<bench_mla --only filter>" ...]
#
# Default points: 128 heads x 1 token at b64 c4096 (compute-bound) and 16 heads x 1 at b64
# c8192 (memory-bound). Writes $OUT/mla_profile.txt and $OUT/mla_profile.tar.gz.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-$PWD/build/gpu-profile}"
source bench/gpu/common.sh
mkdir -p "$OUT"
W="$(mktemp -d)"
log="$OUT/mla_profile.txt"
: >"$log"
[ $# -gt 0 ] || set -- "h128q1 b64 ctx4096 " "h16q1 b64 ctx8192 "
n=0
for only in "$@"; do
  n=$((n + 1))
  echo "== ncu full mla_kernel ($only)" | tee -a "$log"
  bash bench/gpu/ncu_full.sh mla_kernel "mla$n" "$W" "$log" \
    "$BUILD/bench/gpu/bench_mla" --out /dev/null --only "$only"
done
tar -czf "$OUT/mla_profile.tar.gz" -C "$W" .
