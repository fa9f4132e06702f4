#!/usr/bin/env bash
# Every test on a fresh machine: install the pinned dependencies, build Release (compiling the
# CUDA code when nvcc is found) and run all tests; then build with AddressSanitizer and UBSan
# (CUDA off) and run the tests again there.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
./scripts/setup.sh
start=$(date +%s)
cmake --preset release
cmake --build --preset release
ctest --preset release -j2
cmake --preset asan
cmake --build --preset asan
ctest --preset asan -j2
echo "test.sh: all tests passed in $(( $(date +%s) - start )) s"
