#!/usr/bin/env bash
# Nsight Compute profile of the Hopper prefill kernel on a GPU machine, for
# docs/kernels/prefill.md: the full section set of one prefill_sm90_kernel launch (bf16, causal,
# GQA 32/8, by default head size 128 at 4k tokens), with the warp stall reasons and the busiest
# pipes and the SASS instructions with the most stall samples printed (ncu_full.sh), the
# report and its exported pages archived.
#
#   OUT=... bash bench/gpu/profile_prefill.sh ["<bench_prefill --only filter>"]
#
# Writes $OUT/prefill_profile.txt (the printed lines) and $OUT/prefill_profile.tar.gz.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-$PWD/build/gpu-profile}"
source bench/gpu/common.sh
only="${1:-q4096 h32/8 d128 auto}"
mkdir -p "$OUT"
W="$(mktemp -d)"
log="$OUT/prefill_profile.txt"
echo "== ncu full prefill_sm90_kernel ($only)" | tee "$log"
bash bench/gpu/ncu_full.sh prefill_sm90_kernel prefill "$W" "$log" \
  "$BUILD/bench/gpu/bench_prefill" --out /dev/null --only "$only"
tar -czf "$OUT/prefill_profile.tar.gz" -C "$W" .
