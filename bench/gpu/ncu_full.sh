#!/usr/bin/env bash
# One kernel launch under Nsight Compute's full section set, for the profile_*.sh scripts:
# the 4th launch whose name matches KERNEL, the report's details, raw and per-SASS-instruction
# pages exported to WORKDIR/NAME.*, the key details lines and ncu_stalls.py's tables (stall
# reasons, busiest pipes, stall samples by opcode and instruction) appended to LOG.
#
#   bash bench/gpu/ncu_full.sh KERNEL NAME WORKDIR LOG command [args...]
set -uo pipefail
[ $# -ge 5 ] || { sed -n 2,7p "$0"; exit 2; }
kernel=$1 name=$2 W=$3 log=$4
shift 4
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ncu="$(command -v ncu || echo /usr/local/cuda/bin/ncu)"
timeout 150 "$ncu" --kernel-name "regex:$kernel" --launch-skip 3 --launch-count 1 \
  --set full --import-source no -f -o "$W/$name" "$@" >"$W/$name.run.log" 2>&1
echo "ncu rc=$?" | tee -a "$log"
"$ncu" -i "$W/$name.ncu-rep" --page details --print-units base >"$W/$name.details.txt" 2>&1
"$ncu" -i "$W/$name.ncu-rep" --page raw --csv >"$W/$name.raw.csv" 2>&1
"$ncu" -i "$W/$name.ncu-rep" --page source --csv --print-source sass >"$W/$name.source.csv" 2>&1
grep -E "Duration|SM Frequency|Issue Slots Busy|Eligible Warps|No Eligible|Registers Per|Warp Cycles Per Issued|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|L2 Hit|Local|spill|Bank|L1 Wavefronts Shared Excessive|ALU is|is the highest" \
  "$W/$name.details.txt" | head -36 | tee -a "$log"
python3 "$here/ncu_stalls.py" "$W/$name.raw.csv" "$W/$name.source.csv" | tee -a "$log"
