#!/usr/bin/env bash
# The pretrain stage's step, this tree beside the tree before the redesign (f091f71), on one 4-GPU host in one call
# (issue 34, item 1). bench/bench_pretrain_gpu.py in one process per GPU, so that every shape finishes inside one
# call (one process measuring three shapes ran out of a 300 s call in its compiles):
#
#   round 1   GPU 0: this tree 2048x8    GPU 1: f091f71 2048x8    GPU 2: this tree 8192x2   GPU 3: this tree 32768x1
#   round 2   GPU 0: f091f71 2048x8      GPU 1: this tree 2048x8  GPU 2: this tree profile  GPU 3: f091f71 profile
#
# Round 2 swaps the two trees' GPUs, so a difference between the cards shows as a difference between the rounds,
# not as the trees' ratio. Each run is stopped at DEADLINE_S (560) after the start; a round-2 run not started by
# DEADLINE_S - 200 is skipped. Every run's JSON and log go into $OUT/step-speed.tar.gz and its tables to stdout.
#
#   bash bench/pack_gpu_dag.sh      # then the old tree's code alone (the whole tree puts the carry over 64 MiB):
#   git archive f091f71 bench model kernels pretrain pipeline pyproject.toml \
#       $(git ls-tree --name-only f091f71 data/ | grep '\.py$') | xz -9 > .whl-dag/pack/tree-f091f71.tar.xz
#   bash bench/step_speed_gpu.sh          # on the device: carry .whl-dag/pack
#
# Env: SITE (/tmp/site; unpacked from ARCHIVE unless it exists), ARCHIVE (.whl-dag/pack/site.tar.xz), OLD_TREE
# (.whl-dag/pack/tree-f091f71.tar.xz), OLD_DIR (/tmp/tree-f091f71), STEPS (6), PYTHON (python3), OUT, DEADLINE_S,
# NGPU (4), SHAPES_ONLY=1 (round 1 only), DRY_RUN=1 (plan and archive without running anything: the CPU test).
set -uo pipefail
cd "$(dirname "$0")/.."
SITE=${SITE:-/tmp/site}
ARCHIVE=${ARCHIVE:-.whl-dag/pack/site.tar.xz}
OLD_TREE=${OLD_TREE:-.whl-dag/pack/tree-f091f71.tar.xz}
PYTHON=${PYTHON:-python3}
OUT=$(realpath -m "${OUT:-/tmp/step-speed-out}")  # absolute: the runs cd into each tree
STEPS=${STEPS:-6}
DEADLINE_S=${DEADLINE_S:-560}
NGPU=${NGPU:-4}
START=$SECONDS
RUNS=$OUT/runs  # archived into $OUT/step-speed.tar.gz at the end
OLD=${OLD_DIR:-/tmp/tree-f091f71}  # where the old tree is unpacked (kept for the next call)
mkdir -p "$RUNS"

if [ ! -d "$SITE" ]; then
    [ -f "$ARCHIVE" ] || { echo "step_speed_gpu: no $ARCHIVE: run bench/pack_gpu_dag.sh and carry .whl-dag/pack" >&2; exit 2; }
    mkdir -p "$SITE" && tar -C "$SITE" -xJf "$ARCHIVE" || { echo "step_speed_gpu: unpacking $ARCHIVE failed" >&2; exit 2; }
fi
if [ ! -d "$OLD" ]; then
    [ -f "$OLD_TREE" ] || { echo "step_speed_gpu: no $OLD_TREE (the header says how to make it)" >&2; exit 2; }
    rm -rf "$OLD.part" && mkdir -p "$OLD.part" && tar -C "$OLD.part" -xJf "$OLD_TREE" && mv "$OLD.part" "$OLD" \
        || { echo "step_speed_gpu: unpacking $OLD_TREE failed" >&2; exit 2; }
fi
NEW=$PWD
if [ -z "${DRY_RUN:-}" ]; then
    have=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
    [ "$have" -ge "$NGPU" ] || { echo "step_speed_gpu: $NGPU GPUs wanted, $have listed (NGPU=...)" >&2; exit 2; }
    nvidia-smi -L >"$RUNS/gpus.txt"
fi

# bench NAME GPU TREE_DIR ARGS...: one bench_pretrain_gpu.py process on one GPU, its own output folder, stopped at
# the deadline
bench() {
    local name=$1 gpu=$2 tree=$3 left
    shift 3
    left=$((DEADLINE_S - (SECONDS - START)))
    if ((left < 60)); then
        echo "step_speed_gpu: $name skipped: under 60 s to the ${DEADLINE_S} s deadline" | tee "$RUNS/$name.log"
        return 0
    fi
    echo "step_speed_gpu: $name on GPU $gpu ($tree, ${left} s left): bench_pretrain_gpu.py $*"
    if [ -n "${DRY_RUN:-}" ]; then
        echo "dry run" >"$RUNS/$name.log"
        return 0
    fi
    (cd "$tree" && CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH="$SITE:$tree" OMP_NUM_THREADS=4 timeout "$left" \
        "$PYTHON" bench/bench_pretrain_gpu.py --out "$RUNS/$name" "$@") >"$RUNS/$name.log" 2>&1
    echo "step_speed_gpu: $name ended (rc $?) at $((SECONDS - START)) s"
}

common=(--sections step --steps "$STEPS" --compile)
bench new-2048x8-r1 0 "$NEW" "${common[@]}" --shapes 2048x8 &
bench old-2048x8-r1 1 "$OLD" "${common[@]}" --shapes 2048x8 &
bench new-8192x2 2 "$NEW" "${common[@]}" --shapes 8192x2 &
bench new-32768x1 3 "$NEW" "${common[@]}" --shapes 32768x1 &
wait
if [ -z "${SHAPES_ONLY:-}" ] && (((SECONDS - START) < DEADLINE_S - 200)); then
    bench old-2048x8-r2 0 "$OLD" "${common[@]}" --shapes 2048x8 &
    bench new-2048x8-r2 1 "$NEW" "${common[@]}" --shapes 2048x8 &
    bench new-profile 2 "$NEW" --sections profile --compile &
    bench old-profile 3 "$OLD" --sections profile --compile &
    wait
fi

# the tables: every run's markdown rows and the profiles' first lines
for log in "$RUNS"/*.log; do
    echo
    echo "== $(basename "$log" .log)"
    grep -E '^\| |^step wall|skipped|Error|error:' "$log" | grep -v '^| --' | head -n 20
done
tar -C "$RUNS" -czf "$OUT/step-speed.tar.gz" . && rm -rf "$RUNS"
echo "step_speed_gpu: done at $((SECONDS - START)) s; logs and JSON in $OUT/step-speed.tar.gz"
