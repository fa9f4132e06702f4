# Sourced by the bench/gpu scripts that run on a GPU machine: the build folder, the card's short
# name, the build's commit, and the relocation of the ctest files of a build made elsewhere.

# The binaries, built with the cuda-sm90 preset on the development machine and carried
# (bench/gpu/pack.sh).
BUILD="${PAGEDATTN_BUILD:-build/cuda-sm90}"

# h100, h200 or other (nvidia-smi's first GPU; other without one): results go to
# bench/results/<family>-<card>.*
gpu_card() {
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" in
    *H100*) echo h100 ;;
    *H200*) echo h200 ;;
    *) echo other ;;
  esac
}

# The commit the binaries were built from (pack.sh writes it beside them), else this tree's.
build_commit() {
  if [ -s "$BUILD/COMMIT" ]; then
    cat "$BUILD/COMMIT"
  else
    git rev-parse --short HEAD 2>/dev/null || echo unknown
  fi
}

# ctest files name the folders the build was configured in; a build carried to another path has
# them rewritten to where it lies now (a no-op where the paths already match).
relocate_build() {
  local top="$BUILD/CTestTestfile.cmake" old
  if [ ! -f "$top" ]; then
    echo "no $top: carry the build's ctest files with the binaries (bench/gpu/pack.sh)" >&2
    return 1
  fi
  old="$(sed -n 's/^# Source directory: //p' "$top")"
  [ -n "$old" ] && [ "$old" != "$PWD" ] || return 0
  find "$BUILD" \( -name CTestTestfile.cmake -o -name '*_tests.cmake' -o -name '*_include.cmake' \) \
    -exec sed -i "s|$old|$PWD|g" {} +
}

# A line on stdout and appended to the script's log ($log, set by the script before it says).
say() { echo "$*" | tee -a "$log"; }
