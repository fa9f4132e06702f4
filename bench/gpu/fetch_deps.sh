#!/usr/bin/env bash
# Unpacks the Debian packages the build needs and the GPU image lacks (CLI11, nlohmann-json,
# DLPack, GoogleTest, Highway) into .deps/ (ignored: add /.deps/ to .git/info/exclude), to carry
# to the GPU machine: bench/gpu/device_build.sh builds the Python package there from them, and
# the carried binaries load libhwy.so.1 from them. Versions: scripts/deps-apt.txt.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
pin() { grep "^$1=" "$PWD/scripts/deps-apt.txt" | cut -d= -f2; }
tmp="$(mktemp -d)"
pkgs=( "nlohmann-json3-dev=$(pin nlohmann-json3-dev)" \
  "libdlpack-dev=$(pin libdlpack-dev)" "libcli11-dev=$(pin libcli11-dev)" \
  "libgtest-dev=$(pin libgtest-dev)" "libgmock-dev=$(pin libgmock-dev)" \
  "libhwy-dev=$(pin libhwy-dev)" "libhwy1=$(pin libhwy-dev)")
(cd "$tmp" && apt-get download "${pkgs[@]}")
rm -rf .deps && mkdir -p .deps
for f in "$tmp"/*.deb; do dpkg -x "$f" .deps; done
rm -rf "$tmp"
du -sh .deps
