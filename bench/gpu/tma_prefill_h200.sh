#!/usr/bin/env bash
# The Hopper prefill kernel's TMA tiles on the H200, in one device call: correctness
# (backend_ops with every row on the prefill kernel, with PAGEDATTN_CUDA_PREFILL_COPY=tma and
# with the default cp.async copies; the tma cases on the auto route; memcheck over them), then
# bench_prefill twice in the same call (the default cp.async copies, and a subset with =tma) and
# torch SDPA's cuDNN / flash backends beside them (peers_prefill.py), merged by
# report_prefill.py.
#
#   carry = build/carry (build/carry/h200-bins.tar.gz with tests/backend_ops and
#   bench/gpu/bench_prefill of the cuda-h200 build); then
#   bash bench/gpu/tma_prefill_h200.sh        # files under $OUT
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
tar xzf build/carry/h200-bins.tar.gz
B=build/cuda-h200
O="${OUT:-$PWD/build/h200-tma}"
mkdir -p "$O"
S=$(date +%s)
t() { echo "[$(($(date +%s) - S))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
BO="$B/tests/backend_ops test --device cuda --backend cuda"
PAGEDATTN_CUDA_PREFILL=all PAGEDATTN_CUDA_PREFILL_COPY=tma timeout 120 $BO > "$O/bo_all.log" 2>&1
t "backend_ops, every row on the prefill kernel (TMA where possible) rc=$?"
grep -E "^backend|FAIL" "$O/bo_all.log" | head -12
PAGEDATTN_CUDA_PREFILL=all timeout 60 $BO --filter tma > "$O/bo_tma_cp.log" 2>&1
t "backend_ops --filter tma, prefill kernel, cp.async copies rc=$?"
grep -E "^backend|FAIL" "$O/bo_tma_cp.log" | head -6
PAGEDATTN_CUDA_PREFILL_COPY=tma timeout 60 $BO --filter tma > "$O/bo_tma_auto.log" 2>&1
t "backend_ops --filter tma, auto route rc=$?"
grep -E "^backend|FAIL" "$O/bo_tma_auto.log" | head -6
PAGEDATTN_CUDA_PREFILL=all PAGEDATTN_CUDA_PREFILL_COPY=tma timeout 120 compute-sanitizer --tool memcheck --error-exitcode 99 \
  $BO --filter tma > "$O/san_tma.log" 2>&1
t "memcheck --filter tma (prefill kernel, TMA) rc=$?"
tail -2 "$O/san_tma.log"
PAGEDATTN_CUDA_PREFILL=all timeout 120 compute-sanitizer --tool memcheck --error-exitcode 99 \
  $BO --filter tma > "$O/san_cp.log" 2>&1
t "memcheck --filter tma (prefill kernel, cp.async) rc=$?"
tail -2 "$O/san_cp.log"
timeout 150 "$B/bench/gpu/bench_prefill" --out "$O/ours.json" > "$O/bench.log" 2>&1
t "bench_prefill (cp.async) rc=$?"
only="q4096 h32/8 d128 auto,q16384 h32/8 d128 auto,q4096 h32/8 d64,q16384 h32/8 d64"
only="$only,q16384 h32/8 d256,ctx32768 q1024,vit-mha"
PAGEDATTN_CUDA_PREFILL_COPY=tma timeout 100 "$B/bench/gpu/bench_prefill" \
  --out "$O/ours_tma.json" --only "$only" > "$O/bench_tma.log" 2>&1
t "bench_prefill (TMA) rc=$?"
PYTHONUNBUFFERED=1 timeout 150 python3 bench/gpu/peers_prefill.py --out "$O/peers.json" \
  > "$O/peers.log" 2>&1
t "peers_prefill rc=$?"
python3 bench/gpu/report_prefill.py --ours "$O/ours.json" --peers "$O/peers.json" \
  --json "$O/prefill.json" --png "$O/prefill.png" \
  --meta "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)" | tee "$O/table.txt"
echo "== TMA copies (same call)"
python3 - "$O/ours.json" "$O/ours_tma.json" <<'PY' | tee -a "$O/table.txt"
import json, sys
cp = {r["label"]: r for r in json.load(open(sys.argv[1]))["results"]}
tma = {r["label"]: r for r in json.load(open(sys.argv[2]))["results"]}
for k, r in cp.items():
    if "tflops" in r and "tflops" in tma.get(k, {}):
        print(f"{k:56s} cp.async {r['tflops']:7.1f}  tma {tma[k]['tflops']:7.1f}  x {tma[k]['tflops'] / r['tflops']:5.2f}")
PY
# The device tool brings back a few files per call: everything else travels as one archive.
mkdir -p "$O/logs" && mv "$O"/*.log "$O"/ours*.json "$O"/peers.json "$O/logs/" 2>/dev/null
tar czf "$O/logs.tar.gz" -C "$O" logs && rm -rf "$O/logs"
t "done"
