#!/usr/bin/env bash
# Nsight Compute profiles of the decode path on a GPU machine, for docs/kernels/decode.md:
#  1. the fp8 and bf16 decode kernels (full section set, per-SASS-instruction samples);
#  2. every kernel of one decode step at real clocks (--clock-control none): the decode kernel,
#     the split combine, their durations and DRAM throughput, to split a step's time into the
#     kernels and the gaps between them;
#  3. the same metrics for our MHA point and cuDNN's kernel on the same shape.
# Writes $OUT/summary.txt and $OUT/profile.tar.gz (the .ncu-rep files, the details pages and
# the source CSVs). Binaries are built here with the cuda-sm90 preset and carried (pack.sh).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-$PWD/build/gpu-profile}"
source bench/gpu/common.sh
bench="$BUILD/bench/gpu/bench_decode"
mkdir -p "$OUT"
W="$(mktemp -d)"
summary="$OUT/summary.txt"
ncu="$(command -v ncu || echo /usr/local/cuda/bin/ncu)"
say() { echo "$*" | tee -a "$summary"; }

# 1. name, --only filter: full sections on the 4th decode_kernel launch (ncu_full.sh).
profile_full() {
  local name="$1" only="$2"
  say "== ncu full $name ($only)"
  bash bench/gpu/ncu_full.sh decode_kernel "ncu_$name" "$W" "$summary" \
    "$bench" --out /dev/null --only "$only"
}

# 2./3. Every kernel of some launches at real clocks: name, then the command.
METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,sm__throughput.avg.pct_of_peak_sustained_elapsed
profile_times() {
  local name="$1" skip="$2" count="$3"
  shift 3
  say "== ncu times $name (launches $skip..$((skip + count - 1)), real clocks)"
  timeout 150 "$ncu" --clock-control none --cache-control none --metrics "$METRICS" \
    --launch-skip "$skip" --launch-count "$count" --csv --page raw "$@" \
    >"$W/times_$name.csv" 2>"$W/times_${name}_err.log"
  say "ncu rc=$?"
  python3 - "$W/times_$name.csv" <<'EOF' | tee -a "$summary"
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5]
if len(rows) < 3:
    print("no rows"); sys.exit()
hdr = rows[0]; data = rows[2:]
ix = {h: i for i, h in enumerate(hdr)}
def f(r, k):
    try: return float(r[ix[k]].replace(",", ""))
    except Exception: return float("nan")
for r in data:
    name = r[ix["Kernel Name"]][:60]
    ns = f(r, "gpu__time_duration.sum"); rd = f(r, "dram__bytes_read.sum")
    print(f"{name:60s} {ns/1e3:9.2f} us  read {rd/1e6:9.1f} MB  {rd/ns:7.0f} GB/s  dram {f(r,'dram__throughput.avg.pct_of_peak_sustained_elapsed'):5.1f}%  L2 hit {f(r,'lts__t_sector_hit_rate.pct'):5.1f}%  sm {f(r,'sm__throughput.avg.pct_of_peak_sustained_elapsed'):5.1f}%")
EOF
}

say "== $(nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader)"
profile_full fp8_b16_c8192 "fp8-e4m3 b16 ctx8192"
profile_times b16_c4096 40 8 "$bench" --out /dev/null --only "gqa32/8-d128 b16 ctx4096"
profile_times b16_c8192 40 8 "$bench" --out /dev/null --only "gqa32/8-d128 b16 ctx8192"
profile_times fp8_b16_c8192 40 8 "$bench" --out /dev/null --only "fp8-e4m3 b16 ctx8192"
profile_times mha_b64_c4096 40 4 "$bench" --out /dev/null --only "mha32/32 b64 ctx4096"
profile_times cudnn_mha_b64_c4096 40 6 python3 bench/gpu/peers.py --out /dev/null \
  --only "mha32/32 b64 ctx4096 q1 cudnn"
profile_times cudnn_b16_c4096 40 6 python3 bench/gpu/peers.py --out /dev/null \
  --only "gqa32/8-d128 b16 ctx4096 q1 cudnn"
tar -czf "$OUT/profile.tar.gz" -C "$W" .
say "== done"
