#!/usr/bin/env bash
# Measures the cpu backend on this machine (read bandwidth, decode, prefill) and writes
# bench/results/<date>-cpu-<machine>.json. Run it on an otherwise idle machine: the figures
# are wall-clock medians. Extra arguments go to `pagedattn bench` (e.g. --quick).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
build="${BUILD_DIR:-build/release}"
[ -x "$build/tools/cli/pagedattn" ] || { echo "build first: cmake --preset release && cmake --build --preset release" >&2; exit 1; }
machine="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | tr -cs 'A-Za-z0-9' '-' | sed 's/^-//;s/-$//')-$(nproc)c"
out="bench/results/$(date -u +%Y-%m-%d)-cpu-${machine}.json"
"$build/tools/cli/pagedattn" bench --commit "$(git rev-parse HEAD)" --out "$out" "$@"
echo "wrote $out"
