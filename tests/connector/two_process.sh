#!/usr/bin/env bash
# Disaggregated prefill across processes of the pagedattn command: `run --role prefill
# --connector ...` in one process saves the prompts' KV, `run --role decode` in another loads
# it, and the decode process's attention outputs equal a single-process run's: each run writes
# a digest of every token-producing output row of every layer (--digest) and the files must be
# byte-identical (the ref backend's rows do not depend on the batch, so any difference is a
# wrong K/V). Then the failures: corrupted entries, a prefill process killed in the middle of a
# save (by the test hook and by kill -9 at a random moment), and, with Redis, a server restarted
# while the decode process runs. Each must leave the outputs unchanged and show in the report's
# counts. The Redis part starts its own redis-server on a free loopback port.
# Usage: two_process.sh <pagedattn binary>
set -euo pipefail
pagedattn="$1"
work="$(mktemp -d)"
redis_pid=""
cleanup() {
  if [ -n "$redis_pid" ]; then kill -9 "$redis_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

fail() { echo "two_process: FAIL: $*" >&2; exit 1; }
# The integer value of "key" in a report (pretty-printed JSON, one key per line).
field() { grep -o "\"$1\": [0-9]*" "$2" | head -1 | awk '{print $2}'; }
expect() {  # expect <report> <key> <op> <value>
  local got; got="$(field "$2" "$1")"
  [ -n "$got" ] || fail "$1 has no $2"
  [ "$got" "$3" "$4" ] || fail "$1: $2 = $got, expected $3 $4"
}
same_outputs() {  # same_outputs <reference digest> <digest>
  cmp -s "$1" "$2" || { diff "$1" "$2" | head -5 >&2; fail "$2 differs from $1"; }
}
entries() { find "$1" -name '*.safetensors' 2>/dev/null | wc -l; }

common=(run --preset tiny --backend ref --no-bandwidth --quiet --json --verify-every 2)
pa() { "$pagedattn" "${common[@]}" "$@"; }

# --- one process, the reference ------------------------------------------------------------
pa --num-requests 24 --digest "$work/single.digest" > "$work/single.json"
pa --num-requests 64 --digest "$work/single64.digest" > "$work/single64.json"

# --- storage: prefill in one process, decode in another ------------------------------------
store="storage:$work/store"
pa --num-requests 24 --connector "$store" --role prefill > "$work/prefill.json"
expect "$work/prefill.json" saved_blocks -gt 0
expect "$work/prefill.json" save_errors -eq 0
pa --num-requests 24 --connector "$store" --role decode --digest "$work/decode.digest" \
  > "$work/decode.json"
same_outputs "$work/single.digest" "$work/decode.digest"
expect "$work/decode.json" hit_blocks -gt 0
expect "$work/decode.json" rejected_blocks -eq 0
expect "$work/decode.json" failed_checks -eq 0
echo "two_process: storage: decode matches ($(field hit_blocks "$work/decode.json") blocks loaded)"

# --- corrupted entries: truncated, torn, another block's entry ------------------------------
mapfile -t files < <(find "$work/store" -name '*.safetensors' | sort)
[ "${#files[@]}" -ge 8 ] || fail "only ${#files[@]} entries"
truncate -s 1000 "${files[0]}"
size=$(stat -c %s "${files[2]}")
printf '\x55' | dd of="${files[2]}" bs=1 seek=$((size - 30)) conv=notrunc status=none
cp "${files[5]}" "${files[4]}"
pa --num-requests 24 --connector "$store" --role decode --digest "$work/decode2.digest" \
  > "$work/decode2.json"
same_outputs "$work/single.digest" "$work/decode2.digest"
expect "$work/decode2.json" rejected_blocks -eq 3
expect "$work/decode2.json" load_error_requests -gt 0
echo "two_process: storage: 3 corrupted entries rejected and recomputed"

# --- the prefill process dies in the middle of writing its 5th entry ------------------------
set +e
pa --num-requests 24 --connector "storage:$work/store2?fault=crash-during-write:5&io_threads=1" \
  --role prefill > /dev/null 2>&1
status=$?
set -e
[ "$status" -eq 137 ] || fail "the crashing prefill exited with $status, expected 137 (SIGKILL)"
[ "$(entries "$work/store2")" -eq 4 ] || fail "$(entries "$work/store2") entries after the crash"
[ "$(find "$work/store2" -name '*.tmp.*' | wc -l)" -eq 1 ] || fail "no half-written file"
pa --num-requests 24 --connector "storage:$work/store2" --role decode \
  --digest "$work/decode3.digest" > "$work/decode3.json"
same_outputs "$work/single.digest" "$work/decode3.digest"
expect "$work/decode3.json" rejected_blocks -eq 0
expect "$work/decode3.json" hit_blocks -gt 0
echo "two_process: storage: prefill killed mid-write; decode matches"

# --- kill -9 at a random moment of a longer prefill -----------------------------------------
# (the binary itself, not the pa function: $! must be the process that writes)
"$pagedattn" "${common[@]}" --num-requests 64 --connector "storage:$work/store3" --role prefill \
  > /dev/null 2>&1 &
prefill_pid=$!
for _ in $(seq 1 500); do
  [ "$(entries "$work/store3")" -ge $((10 + RANDOM % 40)) ] && break
  sleep 0.01
done
kill -9 "$prefill_pid" 2>/dev/null && killed=yes || killed=no
wait "$prefill_pid" 2>/dev/null || true
pa --num-requests 64 --connector "storage:$work/store3" --role decode \
  --digest "$work/decode4.digest" > "$work/decode4.json"
same_outputs "$work/single64.digest" "$work/decode4.digest"
expect "$work/decode4.json" rejected_blocks -eq 0
echo "two_process: storage: prefill killed at random (killed: $killed," \
  "$(entries "$work/store3") entries); decode matches"

# --- Redis ------------------------------------------------------------------------------------
if ! command -v redis-server > /dev/null; then
  echo "two_process: SKIP the Redis part: redis-server is not installed (scripts/setup.sh" \
    "installs it)"
  echo "two_process: storage parts passed"
  exit 0
fi
port=""
for _ in $(seq 1 50); do
  candidate=$((20000 + RANDOM % 40000))
  if ! (exec 3<> "/dev/tcp/127.0.0.1/$candidate") 2> /dev/null; then port=$candidate; break; fi
done
[ -n "$port" ] || fail "no free port"
mkdir -p "$work/redis"
start_redis() {
  redis-server --port "$port" --bind 127.0.0.1 --dir "$work/redis" --save "" \
    --appendonly yes --logfile "$work/redis/log" &
  redis_pid=$!
  for _ in $(seq 1 200); do
    redis-cli -p "$port" ping 2> /dev/null | grep -q PONG && return 0
    sleep 0.05
  done
  fail "redis-server did not start on port $port"
}
start_redis
redis="redis://127.0.0.1:$port?retry_ms=0"
pa --num-requests 64 --connector "$redis" --role prefill > "$work/rprefill.json"
expect "$work/rprefill.json" saved_blocks -gt 0
pa --num-requests 64 --connector "$redis" --role decode --digest "$work/rdecode.digest" \
  > "$work/rdecode.json"
same_outputs "$work/single64.digest" "$work/rdecode.digest"
expect "$work/rdecode.json" hit_blocks -gt 0
echo "two_process: redis: decode matches ($(field hit_blocks "$work/rdecode.json") blocks loaded)"

# Restart the server while a decode process runs: freeze the decode process once it is
# connected, kill the server, start it again (its append-only file keeps the entries), thaw.
"$pagedattn" "${common[@]}" --num-requests 64 --connector "$redis" --role decode \
  --digest "$work/rdecode2.digest" > "$work/rdecode2.json" &
decode_pid=$!
for _ in $(seq 1 400); do
  clients=$(redis-cli -p "$port" info clients | awk -F: '/^connected_clients/ {print $2+0}')
  [ "${clients:-0}" -ge 2 ] && break
  sleep 0.005
done
kill -STOP "$decode_pid" 2>/dev/null && frozen=yes || frozen=no
kill -9 "$redis_pid"; wait "$redis_pid" 2>/dev/null || true
kill -CONT "$decode_pid" 2>/dev/null || true
sleep 0.2  # the decode process runs on with no server: lookups miss, loads fail
start_redis
wait "$decode_pid" || fail "the decode process failed across the restart"
same_outputs "$work/single64.digest" "$work/rdecode2.digest"
[ "$frozen" = yes ] || fail "the decode process ended before the restart (make it longer)"
echo "two_process: redis: restarted mid-run; decode matches (hits" \
  "$(field hit_blocks "$work/rdecode2.json"), lookups without a server" \
  "$(field lookup_errors "$work/rdecode2.json"), unreachable loads" \
  "$(field unavailable_blocks "$work/rdecode2.json"), request steps redone" \
  "$(field load_error_requests "$work/rdecode2.json"))"
redis-cli -p "$port" shutdown nosave > /dev/null 2>&1 || true
wait "$redis_pid" 2>/dev/null || true
redis_pid=""
echo "two_process: all passed"
