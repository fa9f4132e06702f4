#!/usr/bin/env bash
# Correctness on a GPU machine, from binaries built here and carried (bench/gpu/pack.sh): the
# CUDA unit tests, the GPU route matrix (`ctest -L gpu`: backend_ops once per route of cuda
# options) and compute-sanitizer; run.sh's tests and sanitizer parts, without the benchmarks.
#
#   tar xzf build/carry/gpu-bins.tar.gz && OUT=... bash bench/gpu/validate.sh
#
# Writes $OUT/summary.txt and $OUT/logs.tar.gz.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PARTS="${PARTS:-tests sanitizer}" exec bash bench/gpu/run.sh
