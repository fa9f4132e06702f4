#!/usr/bin/env bash
# The main job on a fresh machine: install the pinned dependencies, build (Release; CUDA when
# nvcc is found) and run `pagedattn run` with any arguments given here.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
./scripts/setup.sh
cmake --preset release >/dev/null
cmake --build --preset release
exec ./build/release/tools/cli/pagedattn run "$@"
