#!/usr/bin/env bash
# Fails when a C++/CUDA source is not formatted by clang-format 14 with the repo's .clang-format.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mapfile -t files < <(find include src tools tests bench python -type f \
  \( -name '*.h' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' \) 2>/dev/null | sort)
clang-format-14 --dry-run --Werror "${files[@]}"
echo "format: ${#files[@]} files clean"
