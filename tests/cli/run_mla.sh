#!/usr/bin/env bash
# `pagedattn run --preset deepseek-v3`: the serving simulation through MLAAttention layers
# (DeepSeek-V3's sizes, scaled down), checked against the float64 reference; the text report
# names the layer kind and the scale-down; the JSON report says the same and that every check
# passed; options MLA has no use for are refused with a message naming them.
# Usage: run_mla.sh PATH/TO/pagedattn
set -euo pipefail
pagedattn=${1:?usage: run_mla.sh PATH/TO/pagedattn}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

fail() { echo "FAIL: $*" >&2; exit 1; }

if ! "$pagedattn" run --preset deepseek-v3 --no-bandwidth -q --num-requests 6 > "$work/text" \
    2> "$work/err"; then
  cat "$work/text" "$work/err" >&2
  fail "the deepseek-v3 run exited non-zero"
fi
grep -q 'MLAAttention layers, 16 heads, kv_lora_rank 512 + qk_rope 64' "$work/text" ||
  fail "no MLA model line"
grep -q 'scaled down .* of the model.s 61 layers' "$work/text" || fail "no scale-down line"
grep -q 'verification .*all passed' "$work/text" || fail "verification did not pass"
echo "ok: text report"

"$pagedattn" run --preset deepseek-v3 --no-bandwidth -q --json --num-requests 3 \
  --kv-cache-dtype fp8 > "$work/json" || fail "the fp8 json run exited non-zero"
grep -q '"layer": "MLAAttention"' "$work/json" || fail "json: no layer kind"
grep -q '"kv_lora_rank": 512' "$work/json" || fail "json: no MLA sizes"
grep -q '"passed": true' "$work/json" || fail "json: verification did not pass"
echo "ok: fp8 json report"

if "$pagedattn" run --preset deepseek-v3 -q --kv-cache-layout HND > /dev/null 2> "$work/err"; then
  fail "HND was accepted"
fi
grep -q 'kv-cache-layout HND does not apply to preset deepseek-v3' "$work/err" ||
  fail "HND refusal: $(cat "$work/err")"
echo "ok: refusals"
