#!/usr/bin/env bash
# Packs what the GPU scripts need from a cuda-sm90 build into one archive to carry to a GPU
# machine (the GPU image lacks CLI11 / nlohmann-json / libdlpack, so nothing is built there):
# the binaries, the build's ctest files (for `ctest --test-dir build/cuda-sm90 -L gpu`; run.sh
# rewrites their paths there) and the commit they were built from.
#
#   cmake --preset cuda-sm90 [-DNCCL_ROOT=<nvidia-nccl wheel's nvidia/nccl>]
#   cmake --build --preset cuda-sm90          # target gpu_binaries
#   bash bench/gpu/pack.sh                    # -> build/carry/gpu-bins.tar.gz
#
# then, on the GPU machine (carry = build/carry):
#   tar xzf build/carry/gpu-bins.tar.gz && bash bench/gpu/run.sh
#
# The binaries link cudart statically and need only libc/libstdc++ and the driver there; the two
# NCCL ones (built where CMake found NCCL) also load libnccl.so.2, which run.sh finds.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source bench/gpu/common.sh
out="${1:-build/carry/gpu-bins.tar.gz}"
commit="$(git rev-parse --short HEAD)"
git diff --quiet HEAD -- src include || commit="$commit+changes"
echo "$commit" >"$BUILD/COMMIT"
files=("$BUILD/COMMIT")
for b in tests/backend_ops tests/pagedattn_cuda_tests tests/pagedattn_nccl_tests \
  bench/gpu/bench_decode bench/gpu/bench_prefill bench/gpu/bench_mla bench/gpu/bench_dcp; do
  if [ -x "$BUILD/$b" ]; then
    files+=("$BUILD/$b")
  else
    echo "pack.sh: no $BUILD/$b (not built)" >&2
  fi
done
while IFS= read -r f; do files+=("$f"); done < <(find "$BUILD" \( -name CTestTestfile.cmake \
  -o -name '*_tests.cmake' -o -name '*_include.cmake' \) -not -path '*/_deps/*')
mkdir -p "$(dirname "$out")"
tar czf "$out" "${files[@]}"
ls -la "$out"
