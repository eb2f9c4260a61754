#!/usr/bin/env bash
# A/B of the pretrain stage's training step before and after the MoE unification (issue 24), same machine, one
# call: the old tree ($OLD_TREE, a `git archive` of the commit before, carried) and this one, each timing its step
# at 2048 x 8 (bench_pretrain_gpu.py --sections step --compile; ORDER, e.g. "old new old new"), then the generation
# check. Carry .whl-dag/pack and the old tree. Env: OLD_TREE (.ab_old), SHAPES (2048x8), STEP_S (200), GEN_S (150)
# The old tree, made here (ignored by git through .git/info/exclude; the carry limit is 64 MiB with the pack):
#   mkdir .ab_old && git archive 5c40cb0 model pretrain kernels pipeline data posttrain evaluation bench pyproject.toml \
#       | tar -x -C .ab_old && rm -rf .ab_old/data/sample_corpus
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/moe-ab-out}
SITE=${SITE:-/tmp/site}
OLD_TREE=${OLD_TREE:-.ab_old}
mkdir -p "$OUT"
T0=$(date +%s)
say() { echo "[gpu_moe_ab $(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/run.log"; }
if [ ! -f "$SITE/.unpacked" ]; then
    rm -rf "$SITE" && mkdir -p "$SITE" && tar -C "$SITE" -xJf .whl-dag/pack/site.tar.xz && touch "$SITE/.unpacked" \
        || { say "unpacking .whl-dag/pack/site.tar.xz failed"; exit 2; }
fi
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
say "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"
for side in ${ORDER:-old new}; do
    tree=$PWD; [ "$side" = old ] && tree=$PWD/$OLD_TREE
    ( cd "$tree" && PYTHONPATH=$SITE:$tree timeout "${STEP_S:-200}" python3 bench/bench_pretrain_gpu.py --sections step \
        --compile --shapes "${SHAPES:-2048x8}" --out "$OUT/$side" ) >>"$OUT/step_$side.log" 2>&1
    say "step ($side) exit $?"; grep -E '^\| [0-9]' "$OUT/step_$side.log" | tail -n 3
done
if [ "${GEN_S:-150}" != 0 ]; then
    PYTHONPATH=$SITE:$PWD timeout "${GEN_S:-150}" python3 bench/check_generation_gpu.py --big-rows 200 >"$OUT/gen.log" 2>&1
    say "check_generation exit $?"; tail -n 8 "$OUT/gen.log"
fi
say done
