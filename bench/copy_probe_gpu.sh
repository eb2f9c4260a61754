#!/usr/bin/env bash
# Why does gpu-300m not learn to copy? (issue 33) The copy task of bench/copy_toy.py in variants that change one
# thing each, one variant per GPU at a time, on a lent machine in one call. On 2 x H200 / 1 x H100 the recipe's pure
# copy window (700 steps) and the issue's own probe task (750 steps on one H100, bf16) left the loss at ln V, where
# the issue reports copy accuracy 1.000 at step 700; the same script copies on the CPU at small sizes
# (BENCHMARKS.md). The variants separate the GPU path, the scale, the vocabulary, the MoE's token drop and bf16:
#
#   300m-v32k-long      the issue's probe itself (32,768 ids, uniform), 1,500 steps: its first 800 are the
#                       baseline the other variants change one thing of
#   300m-v8k            8,192 ids (the issue's table: 0.995 at step 560)
#   300m-v32k-softmax   all 16 layers softmax: if this copies and the hybrid does not, the lightning layers hold
#                       it back
#   300m-v32k-tied      the output head tied to the embedding: copying needs no learnt map from 32K embeddings
#                       back to their logits
#   300m-v32k-headinit  untied, but the output head starts as a copy of the embedding (an init the recipe could use
#                       and keep the released architecture's untied head)
#   300m-v32k-small     ids from the first 8,192 for the first 400 steps, then from all 32,768 (a curriculum the
#                       recipe could use), measured on all 32,768 throughout
#   300m-v32k-dropless  the MoE dropless (every copy run so far dropped 40%+ of its slots)
#   300m-v32k-zipf      ids drawn with p ~ 1/rank (as words are; the recipe's copy_draw: unigram draws as the
#                       text does); its copy accuracy is measured on Zipf-drawn spans too
#   toy-v256            the CPU toy's own model and task on the GPU (d 128, 8 layers, 256 ids): copies by ~150
#                       steps on the CPU; if not here, the GPU path is at fault
#   300m-v256           gpu-300m on the probe's rows (32 x (256 + 256)), 256 ids
#   300m-v32k-fp32      32,768 ids without bf16 autocast
#
# Spans of varying length (--span-min; issue 33, 2026-11-27): every variant above copies spans of one length, which
# a model can do by attending a fixed distance back. The recipe's copy rows (spans of 32-256, each sample its own
# document) can only be copied by an induction head (find the current id earlier, take the one after it), and on
# the CPU a model that copied fixed spans perfectly was worse than chance on varying ones (BENCHMARKS.md). These
# variants measure when gpu-300m learns that, each pair its own document as in the recipe (--packed), 1,500 steps:
#
#   var-v32k            spans of 32-256 ids, 32,768 ids, the model's own (Xavier) head
#   var-v32k-embed      the same with the head started as the embedding
#   var-v32k-fixed      the first 300 steps' spans all 256 (fixed-distance copying first), then 32-256
#   var-v8k             8,192 ids
#   var-v32k-softmax    all 16 layers softmax
#   var-v32k-short      spans of 8-64 ids (shorter, more pairs a row), scored also on 32-256
#   var-v32k-lr1e-3     peak LR 1e-3
#   toy-v4k-var         the CPU toy (d 128, 8 layers), 4,096 ids, spans of 16-48
#
# and three in the stage's own layout (bench/copy_rows.py: [BOS] R MARK R [EOS] samples packed into 8 rows of 2,048,
# the loss on the repeat alone, as data/retrieval.copy_sample now makes them; with the EOS a target too, short spans
# in this layout learnt nothing in 900 steps on the CPU):
#
#   stage-rows          spans of 32-256, the head from the embedding: the recipe's copy window as the rows are now
#                       (the EOS no target; the two leases' rows had it and taught nothing by 700)
#   stage-rows-xavier   the same with the model's own head (on the CPU: no copying in 400 steps)
#   stage-rows-short    spans of 8-64, scored also on 32-256
#
#   bash bench/copy_probe_gpu.sh     # carry .whl-dag/pack; summary.md and the logs (copy-probe-logs.tar.gz) in $OUT
#   VARIANTS="toy-v256 300m-v8k" bash bench/copy_probe_gpu.sh
#
# The variants wait in one queue, in ORDER (below; most telling first); each GPU takes the next when it is free.
# gpu-300m ran 750 steps in ~175 s on an H100 in bf16, so 4 GPUs get through about ten in DEADLINE_S (540 s):
# a variant not started by then is skipped, and one still running is stopped there (its log keeps a report every
# 50 steps). On fewer GPUs, name fewer VARIANTS per call.
#
# Env: VARIANTS (names above, space separated; default all), NGPU (the GPUs to use; default all nvidia-smi lists),
# DEVICE (cuda; cpu runs them one at a time, for a check on a CPU), MORE_ARGS (appended to every variant's
# arguments, e.g. "--steps 2" for that check), SITE (/tmp/site), ARCHIVE (.whl-dag/pack/site.tar.xz), SITE_READY=1
# ($SITE holds the packages, or this machine's Python has them: nothing unpacked), PYTHON (python3), OUT,
# DEADLINE_S (540: seconds after the start at which every variant stops).
set -uo pipefail
cd "$(dirname "$0")/.."
SITE=${SITE:-/tmp/site}
ARCHIVE=${ARCHIVE:-.whl-dag/pack/site.tar.xz}
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/copy-probe-out}
DEVICE=${DEVICE:-cuda}
DEADLINE_S=${DEADLINE_S:-540}
START=$SECONDS
LOGS=$OUT/logs  # archived into $OUT/copy-probe-logs.tar.gz at the end
mkdir -p "$OUT" "$LOGS"
PROBE="--size gpu-300m --span 256 --seq-len 513 --rows 32 --lr 5e-4"
VAR="$PROBE --span-min 32 --packed --steps 1500"
ROWS="--size gpu-300m --vocab 32768 --L 2048 --rows 8 --lr 5e-4 --steps 1500"
declare -A ARGS=(
    [300m-v32k-long]="$PROBE --vocab 32768 --steps 1500"
    [300m-v8k]="$PROBE --vocab 8192 --steps 800"
    [300m-v32k-softmax]="$PROBE --vocab 32768 --steps 800 --pattern all-softmax"
    [300m-v32k-tied]="$PROBE --vocab 32768 --steps 800 --tied"
    [300m-v32k-headinit]="$PROBE --vocab 32768 --steps 800 --head-init embed"
    [300m-v32k-small]="$PROBE --vocab 32768 --steps 800 --small 8192 --small-steps 400"
    [300m-v32k-dropless]="$PROBE --vocab 32768 --steps 800 --dropless"
    [300m-v32k-zipf]="$PROBE --vocab 32768 --steps 800 --zipf"
    [toy-v256]="--vocab 256 --steps 400"
    [300m-v256]="$PROBE --vocab 256 --steps 800"
    [300m-v32k-fp32]="$PROBE --vocab 32768 --steps 800 --fp32"
    [var-v32k]="$VAR --vocab 32768"
    [var-v32k-embed]="$VAR --vocab 32768 --head-init embed"
    [var-v32k-fixed]="$VAR --vocab 32768 --fixed-steps 300"
    [var-v8k]="$VAR --vocab 8192"
    [var-v32k-softmax]="$VAR --vocab 32768 --pattern all-softmax"
    [var-v32k-short]="--size gpu-300m --span 64 --span-min 8 --seq-len 513 --rows 32 --lr 5e-4 --packed --steps 1500 --vocab 32768 --eval-span 32 256"
    [var-v32k-lr1e-3]="--size gpu-300m --span 256 --span-min 32 --seq-len 513 --rows 32 --lr 1e-3 --packed --steps 1500 --vocab 32768"
    [toy-v4k-var]="--vocab 4096 --span 48 --span-min 16 --seq-len 256 --rows 8 --packed --steps 1500"
    [stage-rows]="$ROWS --lo 32 --hi 256"
    [stage-rows-xavier]="$ROWS --lo 32 --hi 256 --head-init xavier"
    [stage-rows-short]="$ROWS --lo 8 --hi 64 --eval-lo 32 --eval-hi 256"
)
declare -A SCRIPT=([stage-rows]=bench/copy_rows.py [stage-rows-xavier]=bench/copy_rows.py
                   [stage-rows-short]=bench/copy_rows.py)  # else copy_toy.py
ORDER=(stage-rows stage-rows-xavier var-v32k-embed var-v32k stage-rows-short var-v32k-short var-v8k var-v32k-softmax
       var-v32k-fixed var-v32k-lr1e-3 toy-v4k-var
       300m-v32k-long 300m-v32k-tied 300m-v32k-headinit 300m-v8k 300m-v32k-softmax 300m-v32k-small 300m-v32k-dropless
       300m-v32k-zipf toy-v256 300m-v256 300m-v32k-fp32)
read -ra WANT <<<"${VARIANTS:-${ORDER[*]}}"
for v in "${WANT[@]}"; do
    [ -n "${ARGS[$v]:-}" ] || { echo "copy_probe_gpu: unknown variant $v (known: ${ORDER[*]})" >&2; exit 2; }
done

if [ -z "${SITE_READY:-}" ]; then
    [ -f "$ARCHIVE" ] || { echo "copy_probe_gpu: no $ARCHIVE: run bench/pack_gpu_dag.sh and carry .whl-dag/pack" >&2; exit 2; }
    if [ ! -d "$SITE" ]; then
        mkdir -p "$SITE" && tar -C "$SITE" -xJf "$ARCHIVE" || { echo "copy_probe_gpu: unpacking failed" >&2; exit 2; }
    fi
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ "$DEVICE" = cuda ]; then
    NGPU=${NGPU:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
    nvidia-smi -L >"$OUT/gpus.txt" 2>&1
else
    NGPU=1
fi
[ "${NGPU:-0}" -ge 1 ] || { echo "copy_probe_gpu: no GPU listed (DEVICE=cpu runs on the CPU)" >&2; exit 2; }
echo "copy_probe_gpu: ${#WANT[@]} variant(s) on $NGPU $DEVICE device(s): ${WANT[*]}"

# one queue: each device takes the next variant (a counter under a lock) until none is left or the deadline passes
echo 0 >"$LOGS/.next"
next_variant() {
    local j
    exec 9>"$LOGS/.lock"
    flock 9
    j=$(cat "$LOGS/.next")
    echo $((j + 1)) >"$LOGS/.next"
    flock -u 9
    echo "$j"
}
run_on() {
    local g=$1 j v left
    while true; do
        j=$(next_variant)
        ((j < ${#WANT[@]})) || return 0
        v=${WANT[$j]}
        left=$((DEADLINE_S - (SECONDS - START)))
        if ((left < 30)); then
            echo "copy_probe_gpu: $v skipped: the ${DEADLINE_S} s deadline" | tee "$LOGS/$v.err"
            continue
        fi
        script=${SCRIPT[$v]:-bench/copy_toy.py}
        echo "copy_probe_gpu: $v on device $g (${left} s left): $(basename "$script") ${ARGS[$v]} ${MORE_ARGS:-}"
        # shellcheck disable=SC2086  # the variant's arguments are words
        CUDA_VISIBLE_DEVICES=$g OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} timeout "$left" "$PYTHON" "$script" \
            --device "$DEVICE" ${ARGS[$v]} ${MORE_ARGS:-} >"$LOGS/$v.log" 2>"$LOGS/$v.err"
        rc=$?
        ((rc == 124)) && echo "copy_probe_gpu: stopped at the ${DEADLINE_S} s deadline" >>"$LOGS/$v.err"
        echo "copy_probe_gpu: $v ended (rc $rc): $(tail -n 1 "$LOGS/$v.log" 2>/dev/null)"
    done
}
pids=()
for ((g = 0; g < NGPU; g++)); do run_on "$g" & pids+=($!); done
for p in "${pids[@]}"; do wait "$p"; done
rm -f "$LOGS/.next" "$LOGS/.lock"

# the summary: per variant, the first report at copy accuracy >= 0.5, the last report and the accuracy every 100
# steps; then the logs go into one archive ($OUT brings back 8 files)
"$PYTHON" - "$LOGS" "${WANT[@]}" <<'EOF' | tee "$OUT/summary.md"
import json, sys
from pathlib import Path
logs, names = Path(sys.argv[1]), sys.argv[2:]
curves = {}
print("| variant | steps run | first step at copy accuracy >= 0.5 | last loss | last copy accuracy | ln V | seconds |")
print("|---|---:|---:|---:|---:|---:|---:|")
for name in names:
    rows = []
    for line in (logs / f"{name}.log").read_text().splitlines() if (logs / f"{name}.log").exists() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    err = (logs / f"{name}.err").read_text().strip().splitlines() if (logs / f"{name}.err").exists() else []
    if not rows:
        what = "skipped" if any("skipped" in e for e in err) else "failed"
        print(f"| {name} | {what}: {err[-1][:120] if err else 'no output'} | | | | | |")
        continue
    first = next((r["step"] for r in rows if r["copy_accuracy"] >= 0.5), "none")
    last = rows[-1]
    stopped = " (stopped at the deadline)" if any("deadline" in e for e in err) else ""
    print(f"| {name} | {last['step']}{stopped} | {first} | {last['loss']} | {last['copy_accuracy']} | "
          f"{last['ln_v']} | {last['seconds']} |")
    curves[name] = {r["step"]: r["copy_accuracy"] for r in rows if r["step"] % 100 == 0}
steps = sorted({s for c in curves.values() for s in c})
if steps:
    print()
    print("copy accuracy by step:")
    print()
    print("| variant | " + " | ".join(str(s) for s in steps) + " |")
    print("|---|" + "---:|" * len(steps))
    for name, c in curves.items():
        print(f"| {name} | " + " | ".join(str(c.get(s, "")) for s in steps) + " |")
EOF
tar -C "$LOGS" -czf "$OUT/copy-probe-logs.tar.gz" . && rm -rf "$LOGS"
