#!/usr/bin/env bash
# Nsight Compute profile of the Hopper prefill kernel on the H200 machine, for
# docs/kernel_notes.md: the full section set of one prefill_sm90_kernel launch (bf16, causal,
# GQA 32/8, by default head size 128 at 4k tokens), with the warp stall reasons and the busiest
# pipes printed, the report and its per-SASS-instruction source page archived.
#
#   OUT=... bash bench/gpu/profile_prefill_h200.sh ["<bench_prefill --only filter>"]
#
# Writes $OUT/prefill_profile.txt (the printed lines) and $OUT/prefill_profile.tar.gz.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-$PWD/build/h200-profile}"
BUILD="${PAGEDATTN_BUILD:-build/cuda-h200}"
only="${1:-q4096 h32/8 d128 auto}"
mkdir -p "$OUT"
W="$(mktemp -d)"
ncu="$(command -v ncu || echo /usr/local/cuda/bin/ncu)"
log="$OUT/prefill_profile.txt"
echo "== ncu full prefill_sm90_kernel ($only)" | tee "$log"
timeout 150 "$ncu" --kernel-name regex:prefill_sm90_kernel --launch-skip 3 --launch-count 1 \
  --set full --import-source no -f -o "$W/prefill" \
  "$BUILD/bench/gpu/bench_prefill" --out /dev/null --only "$only" >"$W/run.log" 2>&1
echo "ncu rc=$?" | tee -a "$log"
"$ncu" -i "$W/prefill.ncu-rep" --page details --print-units base >"$W/details.txt" 2>&1
"$ncu" -i "$W/prefill.ncu-rep" --page raw --csv >"$W/raw.csv" 2>&1
"$ncu" -i "$W/prefill.ncu-rep" --page source --csv --print-source sass >"$W/source.csv" 2>&1 || true
grep -E "Duration|Issue Slots Busy|Eligible Warps|No Eligible|Registers Per|Warp Cycles Per Issued|Compute \(SM\) Throughput|Memory Throughput|L2 Hit|Local|spill|is the highest|pipe|Stall|stall" \
  "$W/details.txt" | head -40 | tee -a "$log"
# Warp states: the stall reasons by share of the cycles between issues.
python3 - "$W/raw.csv" <<'PY' | tee -a "$log"
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5]
if len(rows) < 3:
    print("no raw rows"); sys.exit()
hdr, data = rows[0], rows[2]
out = []
for h, v in zip(hdr, data):
    if (h.startswith("smsp__average_warp_latency_issue_stalled_") or
            h.startswith("smsp__average_warps_issue_stalled_")) and h.endswith("_per_issue_active.ratio"):
        try:
            out.append((float(v.replace(",", "")), h))
        except ValueError:
            pass
    if h.startswith("sm__pipe_") and h.endswith("pct_of_peak_sustained_active"):
        try:
            out.append((float(v.replace(",", "")), h))
        except ValueError:
            pass
for v, h in sorted(out, reverse=True)[:24]:
    print(f"{v:10.3f}  {h}")
PY
tar -czf "$OUT/prefill_profile.tar.gz" -C "$W" .
