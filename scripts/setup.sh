#!/usr/bin/env bash
# Installs the pinned Debian packages listed in scripts/deps-apt.txt (skipping those already
# installed at that version). Safe to run repeatedly; needs root or sudo.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
upstream() { local v="${1#*:}"; echo "${v%-*}"; }   # 1:14.0.6-12 -> 14.0.6

wanted=()
while IFS= read -r line; do
  line="${line%%#*}"; line="${line// /}"
  [ -n "$line" ] || continue
  pkg="${line%%=*}"; ver="${line#*=}"
  have="$(dpkg-query -W -f='${Status} ${Version}' "$pkg" 2>/dev/null || true)"
  [ "$have" = "install ok installed $ver" ] || wanted+=("$pkg=$ver")
done < "$here/deps-apt.txt"

if [ "${#wanted[@]}" -gt 0 ]; then
  echo "setup: installing ${wanted[*]}"
  export DEBIAN_FRONTEND=noninteractive
  as_root apt-get update -qq
  resolved=()
  for spec in "${wanted[@]}"; do
    pkg="${spec%%=*}"; ver="${spec#*=}"
    cand="$(apt-cache policy "$pkg" | awk '/Candidate:/ {print $2}')"
    if apt-cache madison "$pkg" | awk -F'|' '{gsub(/ /,"",$2); print $2}' | grep -qxF "$ver"; then
      resolved+=("$pkg=$ver")
    elif [ -n "$cand" ] && [ "$(upstream "$cand")" = "$(upstream "$ver")" ]; then
      # A Debian point release replaced the packaging revision; same upstream version.
      echo "setup: warning: $pkg $ver is gone from the archive; using $cand (same upstream)" >&2
      resolved+=("$pkg=$cand")
    else
      echo "setup: error: $pkg $ver is not available (candidate: ${cand:-none})" >&2
      exit 1
    fi
  done
  as_root apt-get install -y -qq --no-install-recommends "${resolved[@]}" >/dev/null
fi

# Python: scripts/test.sh builds the package in a venv, which needs venv/ensurepip and the
# Python headers. Debian's python3 has them through python3-venv and python3-dev (pinned like
# the packages above); a python3 of its own (pyenv, conda) brings them itself.
if ! python3 - <<'PY' 2>/dev/null
import ensurepip, os, sysconfig, venv  # noqa: F401
assert os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
PY
then
  echo "setup: installing python3-venv and python3-dev for the Python package"
  export DEBIAN_FRONTEND=noninteractive
  as_root apt-get update -qq
  as_root apt-get install -y -qq --no-install-recommends python3-venv=3.11.2-1+b1 \
    python3-dev=3.11.2-1+b1 >/dev/null
fi

if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "setup: CUDA toolkit found; CUDA code will be compiled"
else
  echo "setup: no CUDA toolkit (nvcc); building CPU-only"
fi
