#!/usr/bin/env bash
# Every test on a fresh machine: install the pinned dependencies, build Release (compiling the
# CUDA code when nvcc is found) and run all tests; then build with AddressSanitizer and UBSan
# (CUDA off) and run the tests again there; then build the Python package and run its tests.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# Every build of this script goes through ccache when it is installed (scripts/deps-apt.txt), in
# one cache under build/: the Python extension is configured like the release build (CUDA when
# nvcc is found), so its library objects come from the cache instead of a second compile.
use_ccache() {
  if command -v ccache >/dev/null 2>&1; then
    export CCACHE_DIR="${CCACHE_DIR:-$PWD/build/ccache}" CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=1
    export CMAKE_CXX_COMPILER_LAUNCHER=ccache CMAKE_CUDA_COMPILER_LAUNCHER=ccache
  fi
}

# The CUDA code is compiled for two of the default's four architectures: each code path once
# (the portable kernels as sm_80 code and PTX, the Hopper ones as sm_90a); sm_86 and sm_89 are
# the same sources for other targets, and the default's cold build is timed in docs/testing.md.
# Both the release build and the Python package take it (their objects are shared by ccache).
cuda_archs="80;90a"

# The Python package (`./scripts/test.sh --python-only` runs just this part): pinned build and
# test dependencies from PyPI in a venv under build/, the extension built (-j2) with
# `pip install .`, then pytest (the torch / CUDA tests skip without torch and a GPU).
if [ "${1:-}" = "--python-only" ]; then
  use_ccache
  venv=build/py-venv
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check \
    nanobind==3.1.0 scikit-build-core==1.1.2 numpy==2.4.6 pytest==9.2.0
  CMAKE_ARGS="-DPAGEDATTN_CUDA_ARCHS=$cuda_archs${CMAKE_ARGS:+ $CMAKE_ARGS}" \
    CMAKE_BUILD_PARALLEL_LEVEL=2 "$venv/bin/python" -m pip install -q --disable-pip-version-check \
    --no-build-isolation .
  OMP_NUM_THREADS=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/python
  exit 0
fi

./scripts/setup.sh
use_ccache
start=$(date +%s)
# NCCL for pagedattn_nccl (the multi-GPU exchanges; compiled, never run here: no GPU). Not a
# Debian package: when the CUDA code is compiled, the pinned nvidia-nccl-cu13 wheel goes into
# the venv under build/ (its nvidia/nccl holds include/nccl.h and lib/libnccl.so.2). Measured on
# the 2-core CI machine: about 4 s and 344 MB (the venv's 26 MB aside). PAGEDATTN_NCCL=0 skips it
# (pagedattn_nccl and its tests are then not built).
nccl_args=()
if { command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; } &&
   [ "${PAGEDATTN_NCCL:-1}" != 0 ]; then
  venv=build/py-venv
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir \
    nvidia-nccl-cu13==2.32.3
  nccl_root="$("$venv/bin/python" -c 'import nvidia.nccl as n; print(list(n.__path__)[0])')"
  nccl_args=(-DNCCL_ROOT="$nccl_root")
fi
cmake --preset release "${nccl_args[@]}" -DPAGEDATTN_CUDA_ARCHS="$cuda_archs"
cmake --build --preset release
ctest --preset release -j2
cmake --preset asan
cmake --build --preset asan
ctest --preset asan -j2
./scripts/test.sh --python-only
echo "test.sh: all tests passed in $(( $(date +%s) - start )) s"
