#!/usr/bin/env bash
# Measures the cpu backend on this machine (read bandwidth, decode, prefill) and overwrites
# bench/results/cpu-cpu.json (one results file per family and card; the JSON records the CPU,
# the commit and the date). Run it on an otherwise idle machine: the figures are wall-clock
# medians. Extra arguments go to `pagedattn bench` (e.g. --quick).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
build="${BUILD_DIR:-build/release}"
[ -x "$build/tools/cli/pagedattn" ] || { echo "build first: cmake --preset release && cmake --build --preset release" >&2; exit 1; }
out="bench/results/cpu-cpu.json"
"$build/tools/cli/pagedattn" bench --commit "$(git rev-parse HEAD)" --out "$out" "$@"
echo "wrote $out"
