#!/usr/bin/env bash
# On the GPU machine: builds the Python package with CUDA into /tmp/site (then
# PYTHONPATH=/tmp/site), from the Debian packages bench/gpu/fetch_deps.sh unpacked into .deps/
# (carried). The GPU image has Python 3.12, nanobind and scikit-build-core but not hiredis, so
# the Redis connector is left out; the CUDA code is built for the Hopper card alone (90a). About
# 85 s with the H100 machine's 16 cores. The C++ binaries travel built (bench/gpu/pack.sh);
# .deps/ also gives them libhwy.so.1 (LD_LIBRARY_PATH below).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
deps="$PWD/.deps/usr"
[ -d "$deps" ] || { echo "device_build.sh: no .deps/ (run bench/gpu/fetch_deps.sh here, carry .deps)"; exit 1; }
export CMAKE_PREFIX_PATH="$deps" CMAKE_ARGS="-DPAGEDATTN_ENABLE_REDIS=OFF -DPAGEDATTN_CUDA_ARCHS=90a"
export CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)"
export LD_LIBRARY_PATH="$deps/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
start=$(date +%s)
python3 -m pip install -q --no-build-isolation --no-deps --no-index --target /tmp/site .
echo "device_build.sh: the Python package (CUDA) built in $(( $(date +%s) - start )) s: /tmp/site"
