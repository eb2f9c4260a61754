#!/usr/bin/env bash
# One call on one H100 (the device tool's nvidia-h100-x1; carry .whl-dag/pack) for issue 24's "one MoE": the library's
# MoE layer (model/moe.py) and training step side by side with the stage's (pretrain/moe.py on DeepSpeed) and
# transformers' MiniMax, then a check that generation (whose prefill and large-batch decode now go through the same
# sorted dispatch) still matches and keeps its speed. Everything lands in $OUT; each part has its own timeout.
#
#   bash bench/gpu_one_moe.sh                  Env: MOE_S (200), STEP_S (300), GEN_S (150), DECODE_S (200),
#                                                    PARTS (moe,step,gen,decode)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/one-moe-out}
SITE=${SITE:-/tmp/site}
PARTS=${PARTS:-moe,step,gen,decode}
mkdir -p "$OUT"
T0=$(date +%s)
say() { echo "[gpu_one_moe $(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/run.log"; }
if [ ! -f "$SITE/.unpacked" ]; then  # deepspeed and friends: the GPU image lacks them (bench/pack_gpu_dag.sh)
    rm -rf "$SITE" && mkdir -p "$SITE" && tar -C "$SITE" -xJf .whl-dag/pack/site.tar.xz && touch "$SITE/.unpacked" \
        || { say "unpacking .whl-dag/pack/site.tar.xz failed (carry .whl-dag/pack)"; exit 2; }
fi
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
say "unpacked; $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"
part() { case ",$PARTS," in *",$1,"*) return 0;; esac; return 1; }
if part moe; then
    timeout "${MOE_S:-200}" python3 bench/bench_pretrain_gpu.py --sections moe --compile --out "$OUT/moe" \
        >"$OUT/moe.log" 2>&1
    say "moe exit $?"; tail -n 16 "$OUT/moe.log"
fi
if part step; then
    timeout "${STEP_S:-300}" python3 bench/bench_pretrain_gpu.py --sections step --compile --shapes 2048x8,8192x2 \
        --out "$OUT/step" >"$OUT/step.log" 2>&1
    say "step exit $?"; tail -n 12 "$OUT/step.log"
fi
if part gen; then
    timeout "${GEN_S:-150}" python3 bench/check_generation_gpu.py --big-rows 200 >"$OUT/gen.log" 2>&1
    say "check_generation exit $?"; tail -n 8 "$OUT/gen.log"
fi
if part decode; then
    timeout "${DECODE_S:-200}" python3 bench/bench_decode_gpu.py --sections table --no-hf \
        --workloads 32x256+256,256x128+512,1x4096+256 >"$OUT/decode.log" 2>&1
    say "decode exit $?"; tail -n 12 "$OUT/decode.log"
fi
say "done"
