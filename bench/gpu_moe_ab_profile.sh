#!/usr/bin/env bash
# Profiles of the pretrain stage's step (bench_pretrain_gpu.py --sections profile --compile, T 2048 x 8) in the old
# tree ($OLD_TREE, carried) and this one, same machine: where the step time went after the MoE unification.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/moe-ab-profile}
SITE=${SITE:-/tmp/site}
OLD_TREE=${OLD_TREE:-.ab_old}
mkdir -p "$OUT"
if [ ! -f "$SITE/.unpacked" ]; then
    rm -rf "$SITE" && mkdir -p "$SITE" && tar -C "$SITE" -xJf .whl-dag/pack/site.tar.xz && touch "$SITE/.unpacked" || exit 2
fi
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
for side in old new; do
    tree=$PWD; [ "$side" = old ] && tree=$PWD/$OLD_TREE
    ( cd "$tree" && PYTHONPATH=$SITE:$tree timeout "${PROF_S:-150}" python3 bench/bench_pretrain_gpu.py --sections profile \
        --compile --out "$OUT/$side" ) >"$OUT/profile_$side.log" 2>&1
    echo "profile ($side) exit $?"; grep -m1 "step wall" "$OUT/profile_$side.log"
done
