# The H200 run this session could not make (the device was never lent): build the cuda-h200
# binaries and bench/gpu exp variants, tar them into build/carry/{h200-bins,exp-bins}.tar.gz,
# then run `bash bench/gpu/first_run_h200.sh` with carry build/carry.
set -u
tar xzf build/carry/h200-bins.tar.gz && tar xzf build/carry/exp-bins.tar.gz
B=build/cuda-h200; O=$OUT; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader; S=$(date +%s); t(){ echo "[$(( $(date +%s)-S ))s] $*"; }
left(){ [ $(( $(date +%s)-S )) -lt "$1" ]; }
BO="$B/tests/backend_ops test --device cuda --backend cuda"
PAGEDATTN_CUDA_PREFILL=all timeout 150 $BO > $O/bo_all.log 2>&1; t "bo prefill=all rc=$?"; grep -E "^backend|FAIL" $O/bo_all.log | head -12
timeout 60 $BO --filter mla > $O/bo_mla.log 2>&1; t "bo mla rc=$?"; grep -E "^backend|FAIL" $O/bo_mla.log | head -6
PAGEDATTN_CUDA_SPLITS=5 timeout 60 $BO --filter mla > $O/bo_mla5.log 2>&1; t "bo mla splits5 rc=$?"; grep -E "^backend|FAIL" $O/bo_mla5.log | head -6
PAGEDATTN_CUDA_MLA=split-s timeout 60 $BO --filter mla > $O/bo_mlass.log 2>&1; t "bo mla split-s rc=$?"; grep -E "^backend|FAIL" $O/bo_mlass.log | head -6
timeout 150 $B/bench/gpu/bench_prefill --out $O/pf.json > $O/pf.log 2>&1; t "pf rc=$?"; cat $O/pf.log
left 330 && { PYTHONUNBUFFERED=1 timeout 170 python3 bench/gpu/peers_prefill.py --out $O/pf_peers.json > $O/pf_peers.log 2>&1; t "peers rc=$?"; python3 bench/gpu/report_prefill.py --ours $O/pf.json --peers $O/pf_peers.json --json $O/prefill.json --png $O/prefill.png --meta "$(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader)" > $O/pf_table.txt 2>&1; cat $O/pf_table.txt; }
left 420 && { timeout 60 $B/bench/gpu/bench_mla --quick --out $O/mla.json > $O/mla.log 2>&1; t "mla rc=$?"; cat $O/mla.log; }
left 450 && { PAGEDATTN_CUDA_MLA=split-s timeout 40 $B/bench/gpu/bench_mla --quick --out $O/mla_ss.json > $O/mla_ss.log 2>&1; t "mla split-s rc=$?"; cat $O/mla_ss.log; }
left 480 && { timeout 60 $BO > $O/bo_auto.log 2>&1; t "bo auto rc=$?"; grep -E "^backend|FAIL" $O/bo_auto.log | head -8; }
left 510 && { PAGEDATTN_CUDA_PREFILL=all timeout 60 compute-sanitizer --tool memcheck --error-exitcode 99 $BO --filter dtypes > $O/san.log 2>&1; t "san rc=$?"; tail -2 $O/san.log; }
left 540 && { ONLY='q16384 h32/8 d128 auto' OUT=$O timeout 50 bash bench/gpu/sweep_prefill_h200.sh base=$B pp=build/exp-pp r240=build/exp-r240 > /dev/null 2>&1; t sweep; cat $O/sweep.txt; }
cd $O && tar czf logs.tar.gz *.log *.txt 2>/dev/null; ls
