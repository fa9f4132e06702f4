#!/usr/bin/env bash
# A change to the Hopper prefill kernel, checked and timed in one device call: backend_ops with
# every row on the prefill kernel (both copy paths) and memcheck over a subset, then the changed
# build interleaved with the builds it is compared against on the points that matter
# (sweep_prefill_h200.sh), the full bench_prefill beside torch SDPA's cuDNN / flash
# (peers_prefill.py, report_prefill.py) and an ncu profile of d128 16k.
#
#   carry = build/carry (h200-bins.tar.gz: build/cuda-h200/{tests/backend_ops,
#   bench/gpu/bench_prefill} of the change, and each compared build's bench/gpu/bench_prefill
#   under build/ab/<name>/); then
#   OUT=... bash bench/gpu/ab_prefill_h200.sh base=build/ab/base pp=build/ab/pp
#
# Writes $OUT/table.txt, $OUT/sweep.txt, $OUT/prefill.{json,png}, $OUT/prefill_profile.*,
# $OUT/logs.tar.gz.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
tar xzf build/carry/h200-bins.tar.gz
B=build/cuda-h200
O="${OUT:-$PWD/build/h200-ab}"
mkdir -p "$O"
S=$(date +%s)
t() { echo "[$(($(date +%s) - S))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
BO="$B/tests/backend_ops test --device cuda --backend cuda"
PAGEDATTN_CUDA_PREFILL=all timeout 120 $BO > "$O/bo_all.log" 2>&1
t "backend_ops, every row on the prefill kernel (cp.async) rc=$?"
grep -E "^backend|FAIL" "$O/bo_all.log" | head -12
PAGEDATTN_CUDA_PREFILL=all PAGEDATTN_CUDA_PREFILL_COPY=tma timeout 120 $BO > "$O/bo_all_tma.log" 2>&1
t "backend_ops, every row on the prefill kernel (TMA where possible) rc=$?"
grep -E "^backend|FAIL" "$O/bo_all_tma.log" | head -12
timeout 120 $BO > "$O/bo_auto.log" 2>&1
t "backend_ops, auto route rc=$?"
grep -E "^backend|FAIL" "$O/bo_auto.log" | head -12
for copy in cp.async tma; do
  PAGEDATTN_CUDA_PREFILL=all PAGEDATTN_CUDA_PREFILL_COPY=$copy timeout 150 compute-sanitizer \
    --tool memcheck --error-exitcode 99 $BO --filter "${SAN_FILTER:-tma}" > "$O/san_$copy.log" 2>&1
  t "memcheck --filter ${SAN_FILTER:-tma} (prefill kernel, $copy) rc=$?"
  tail -2 "$O/san_$copy.log"
done
ONLY="${ONLY:-q1024 h32/8 d128 auto,q4096 h32/8 d128 auto,q16384 h32/8 d128 auto,q4096 h32/8 d64,q16384 h32/8 d64,q16384 h32/8 d256,ctx32768 q1024,vit-mha}" \
  OUT="$O" timeout 400 bash bench/gpu/sweep_prefill_h200.sh "new=$B" "$@" > /dev/null 2>&1
t "sweep rc=$?"
python3 - "$O/sweep.txt" <<'PY' | tee "$O/sweep_table.txt"
import re, sys, collections
best = collections.defaultdict(dict)
for line in open(sys.argv[1]):
    m = re.match(r"(\S+) r\d\s+(.*?)\s+[\d.]+ us\s+([\d.]+) TFLOP/s", line)
    if m:
        name, label, tf = m.group(1), m.group(2).strip(), float(m.group(3))
        best[label].setdefault(name, []).append(tf)
names = sorted({n for v in best.values() for n in v}, key=lambda n: (n != "new", n))
print("best of the two rounds (TFLOP/s); x = new / other")
for label, v in best.items():
    med = {n: sorted(x)[len(x) // 2] for n, x in v.items()}
    cols = "  ".join(f"{n} {med[n]:6.1f}" for n in names if n in med)
    ratios = "  ".join(f"x{n} {med['new'] / med[n]:4.2f}" for n in names if n in med and n != "new" and "new" in med)
    print(f"{label[:60]:60s} {cols}  {ratios}")
PY
timeout 150 "$B/bench/gpu/bench_prefill" --out "$O/ours.json" > "$O/bench.log" 2>&1
t "bench_prefill rc=$?"
PYTHONUNBUFFERED=1 timeout 150 python3 bench/gpu/peers_prefill.py --out "$O/peers.json" \
  > "$O/peers.log" 2>&1
t "peers_prefill rc=$?"
python3 bench/gpu/report_prefill.py --ours "$O/ours.json" --peers "$O/peers.json" \
  --json "$O/prefill.json" --png "$O/prefill.png" \
  --meta "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)" > "$O/table.txt"
cat "$O/table.txt"
OUT="$O" bash bench/gpu/profile_prefill_h200.sh "${PROFILE:-causal-d128 b1 ctx0 q16384 h32/8 d128 auto}" \
  > /dev/null 2>&1
t "ncu rc=$?"
cat "$O/prefill_profile.txt"
# The device tool brings back a few files per call: the logs travel as one archive.
mkdir -p "$O/logs" && mv "$O"/*.log "$O"/ours*.json "$O"/peers.json "$O"/sweep_*.json "$O/logs/" 2>/dev/null
tar czf "$O/logs.tar.gz" -C "$O" logs && rm -rf "$O/logs"
t "done"
