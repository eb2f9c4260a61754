#!/usr/bin/env bash
# One call on a 2-GPU host (the device tool's nvidia-h200-x2) that records three GPU results of issues 9 and 11:
#   1. long-context inference of gpu-300m on GPU 1 (bench_longctx_inference.py), while
#      the 1-GPU pretrain baseline trains on GPU 0 (run_pretrain_gpus.py --runs 1gpu);
#   2. then expert parallelism over both GPUs, with and without the global router (--runs 2gpu,2gpu-local);
#   3. then LASP+ sequence parallelism: 1 vs 2 GPUs equality, bytes per step, longest sequence (bench_lasp_gpu.py).
# The GPU image lacks deepspeed (carry .whl). Everything lands in $OUT. Env: TOKENS (1000000), LENGTHS
# (131072,524288,1048576), PROBES (131072,262144,524288), ONE_S (240), TWO_S (300), LONGCTX_S (330), LASP_S (150).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/two-gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/dev/null 2>&1 || echo "pip install of .whl failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$OUT/gpus.txt"
T0=$(date +%s)
( CUDA_VISIBLE_DEVICES=1 OUT="$OUT" timeout "${LONGCTX_S:-330}" python3 bench/bench_longctx_inference.py --device cuda \
    --size gpu-300m --lengths "${LENGTHS:-131072,524288,1048576}" --patterns hybrid,all-softmax \
    >"$OUT/longctx.log" 2>&1; echo "longctx exit $? after $(( $(date +%s) - T0 ))s" >>"$OUT/longctx.log" ) &
LC=$!
CUDA_VISIBLE_DEVICES=0 timeout "${ONE_S:-240}" python3 bench/run_pretrain_gpus.py --runs 1gpu --tokens "${TOKENS:-1000000}" \
    --log-every 2 --out "$OUT/pretrain" >"$OUT/pretrain_1gpu.log" 2>&1
echo "1gpu exit $? at $(( $(date +%s) - T0 ))s" | tee -a "$OUT/pretrain_1gpu.log"
wait $LC
echo "longctx done at $(( $(date +%s) - T0 ))s"; tail -n 12 "$OUT/longctx.log"
timeout "${TWO_S:-300}" python3 bench/run_pretrain_gpus.py --runs 2gpu,2gpu-local --tokens "${TOKENS:-1000000}" --log-every 2 \
    --out "$OUT/pretrain" >"$OUT/pretrain_2gpu.log" 2>&1
echo "2gpu exit $? at $(( $(date +%s) - T0 ))s" | tee -a "$OUT/pretrain_2gpu.log"
tail -n 25 "$OUT/pretrain_1gpu.log" "$OUT/pretrain_2gpu.log"
timeout "${LASP_S:-150}" python3 bench/bench_lasp_gpu.py --device cuda --size gpu-300m --steps 2 \
    --probe-lens "${PROBES:-131072,262144,524288}" --timeout 120 >"$OUT/lasp.log" 2>&1
echo "lasp exit $? at $(( $(date +%s) - T0 ))s" | tee -a "$OUT/lasp.log"
tail -n 30 "$OUT/lasp.log"
