#!/usr/bin/env bash
# Nsight Compute profile of the MLA decode kernel on the H200 machine, for docs/kernel_notes.md
# "mla decode": the full section set of one mla_kernel launch per bench_mla point, the warp
# stall reasons and busiest pipes, and the SASS instructions with the most stall samples (by
# instruction and by opcode), so the per-tile chain can be read off the profile.
#
#   OUT=... bash bench/gpu/profile_mla_h200.sh ["<bench_mla --only filter>" ...]
#
# Default points: 128 heads x 1 token at b64 c4096 (compute-bound) and 16 heads x 1 at b64
# c8192 (memory-bound). Writes $OUT/mla_profile.txt and $OUT/mla_profile.tar.gz.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-$PWD/build/h200-profile}"
BUILD="${PAGEDATTN_BUILD:-build/cuda-h200}"
mkdir -p "$OUT"
W="$(mktemp -d)"
ncu="$(command -v ncu || echo /usr/local/cuda/bin/ncu)"
log="$OUT/mla_profile.txt"
: >"$log"
[ $# -gt 0 ] || set -- "h128q1 b64 ctx4096 " "h16q1 b64 ctx8192 "
n=0
for only in "$@"; do
  n=$((n + 1))
  echo "== ncu full mla_kernel ($only)" | tee -a "$log"
  timeout 150 "$ncu" --kernel-name regex:mla_kernel --launch-skip 3 --launch-count 1 \
    --set full --import-source no -f -o "$W/mla$n" \
    "$BUILD/bench/gpu/bench_mla" --out /dev/null --only "$only" >"$W/run$n.log" 2>&1
  echo "ncu rc=$?" | tee -a "$log"
  "$ncu" -i "$W/mla$n.ncu-rep" --page details --print-units base >"$W/details$n.txt" 2>&1
  "$ncu" -i "$W/mla$n.ncu-rep" --page raw --csv >"$W/raw$n.csv" 2>&1
  "$ncu" -i "$W/mla$n.ncu-rep" --page source --csv --print-source sass >"$W/source$n.csv" 2>&1 || true
  grep -E "Duration|SM Frequency|Issue Slots Busy|Eligible Warps|No Eligible|Registers Per|Warp Cycles Per Issued|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|L2 Hit|Shared Memory|Bank|is the highest" \
    "$W/details$n.txt" | head -30 | tee -a "$log"
  python3 - "$W/raw$n.csv" "$W/source$n.csv" <<'PY' | tee -a "$log"
import csv, re, sys
from collections import defaultdict
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5]
if len(rows) >= 3:
    hdr, data = rows[0], rows[2]
    out = []
    for h, v in zip(hdr, data):
        keep = ((h.startswith("smsp__average_warp_latency_issue_stalled_") or
                 h.startswith("smsp__average_warps_issue_stalled_")) and
                h.endswith("_per_issue_active.ratio")) or (
                    h.startswith("sm__pipe_") and h.endswith("pct_of_peak_sustained_active"))
        if keep:
            try:
                out.append((float(v.replace(",", "")), h))
            except ValueError:
                pass
    for v, h in sorted(out, reverse=True)[:24]:
        print(f"{v:10.3f}  {h}")
# SASS: the instructions with the most stall samples, and the samples by opcode.
try:
    src = list(csv.reader(open(sys.argv[2])))
except OSError:
    sys.exit()
hi = next((i for i, r in enumerate(src) if any("Source" == c.strip() for c in r)), None)
if hi is None:
    print("no SASS table"); sys.exit()
hdr = src[hi]
col = {h.strip(): i for i, h in enumerate(hdr)}
s_col = next((i for h, i in col.items() if h.startswith("Warp Stall Sampling (All")), None)
if s_col is None:
    print("no stall column"); sys.exit()
def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0
ins = []
for r in src[hi + 1:]:
    if len(r) <= s_col:
        continue
    ins.append((num(r[s_col]), r[col.get("Address", 0)], r[col["Source"]].strip()))
total = sum(s for s, _, _ in ins) or 1.0
by_op = defaultdict(float)
for s, _, text in ins:
    op = re.sub(r"^@!?U?P\w+\s+", "", text).split(" ")[0]
    by_op[op] += s
print(f"-- stall samples by opcode (total {total:.0f})")
for op, s in sorted(by_op.items(), key=lambda x: -x[1])[:16]:
    print(f"{100 * s / total:6.1f}%  {op}")
print("-- top instructions")
for s, a, text in sorted(ins, reverse=True)[:30]:
    print(f"{100 * s / total:6.1f}%  {a}  {text[:90]}")
PY
done
tar -czf "$OUT/mla_profile.tar.gz" -C "$W" .
