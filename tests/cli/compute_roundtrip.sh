#!/usr/bin/env bash
# `pagedattn make-case` then `pagedattn compute --check` over a few feature mixes, and
# `pagedattn compute` on malformed files: non-zero exit and a message naming the problem.
# Usage: compute_roundtrip.sh PATH/TO/pagedattn
set -euo pipefail
pagedattn=${1:?usage: compute_roundtrip.sh PATH/TO/pagedattn}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

fail() { echo "FAIL: $*" >&2; exit 1; }

check_case() {  # name, make-case flags...
  local name=$1; shift
  "$pagedattn" make-case "$work/$name.safetensors" "$@" > "$work/$name.make.log"
  if ! "$pagedattn" compute "$work/$name.safetensors" --check --lse \
      --out "$work/$name.out.safetensors" > "$work/$name.log" 2>&1; then
    cat "$work/$name.log" >&2
    fail "$name: compute --check exited non-zero"
  fi
  grep -q '^PASS$' "$work/$name.log" || fail "$name: no PASS line"
  [ -s "$work/$name.out.safetensors" ] || fail "$name: no output file"
  echo "ok: $name"
}

check_case decoder --seed 1
check_case mixed_fp8 --seed 2 --requests 0:0,13:1,32:16,0:9 --kv-cache-dtype fp8_e4m3 \
  --k-scale 0.5 --v-scale 2 --pad-tokens 4 --block-size 8
check_case features --seed 3 --dtype float16 --sliding-window 6 --soft-cap 20 --alibi --sinks \
  --kv-cache-dtype fp8_e5m2 --num-heads 8 --num-kv-heads 1
check_case encoder_only --seed 4 --attn-type encoder_only --requests 0:9,0:3 --sliding-window 3 \
  --dtype float32
check_case cross --seed 5 --attn-type encoder_decoder --requests 30:1,12:2
check_case cross_decode --seed 6 --attn-type encoder_decoder --requests 30:1 --no-cross-kv

# The backend can be named, on the command line or through the environment.
"$pagedattn" compute "$work/decoder.safetensors" --backend ref > /dev/null || fail "--backend ref"
PAGEDATTN_BACKEND=ref "$pagedattn" compute "$work/decoder.safetensors" > /dev/null \
  || fail "PAGEDATTN_BACKEND=ref"
if "$pagedattn" compute "$work/decoder.safetensors" --backend nosuch > "$work/nosuch.log" 2>&1; then
  fail "--backend nosuch succeeded"
fi
grep -q "'nosuch' is not a registered backend" "$work/nosuch.log" || fail "unknown backend message"

expect_error() {  # file, expected message fragment
  local rc=0
  "$pagedattn" compute "$1" --check > "$work/err.log" 2>&1 || rc=$?
  [ "$rc" -ne 0 ] || fail "compute $1 exited 0"
  grep -qF -- "$2" "$work/err.log" || { cat "$work/err.log" >&2; fail "no '$2' for $1"; }
  echo "ok: rejects $(basename "$1") (exit $rc)"
}

printf 'abc' > "$work/short.safetensors"
expect_error "$work/short.safetensors" "file has 3 bytes"
printf '\x07\x00\x00\x00\x00\x00\x00\x00[1,2,3]' > "$work/array.safetensors"
expect_error "$work/array.safetensors" "header must be a JSON object"
head -c 200 "$work/decoder.safetensors" > "$work/truncated.safetensors"
expect_error "$work/truncated.safetensors" "truncated.safetensors: safetensors:"
printf '\x02\x00\x00\x00\x00\x00\x00\x00{}' > "$work/empty.safetensors"
expect_error "$work/empty.safetensors" "metadata field 'num_heads' is missing"
expect_error "$work/does_not_exist.safetensors" "cannot open"
echo "all ok"
