#!/usr/bin/env bash
# Why does gpu-300m not learn to copy? (issue 33) The copy task of bench/copy_toy.py in variants that change one
# thing each, one variant per GPU at a time, on a lent machine in one call. On 2 x H200 / 1 x H100 the recipe's pure
# copy window (700 steps) and the issue's own probe task (750 steps on one H100, bf16) left the loss at ln V, where
# the issue reports copy accuracy 1.000 at step 700; the same script copies on the CPU at small sizes
# (BENCHMARKS.md). The variants separate the GPU path, the scale, the vocabulary, the MoE's token drop and bf16:
#
#   toy-v256            the CPU toy's own model and task on the GPU (d 128, 8 layers, 256 ids): copies by ~150
#                       steps on the CPU; if not here, the GPU path is at fault
#   300m-v256           gpu-300m on the probe's rows (32 x (256 + 256)), 256 ids
#   300m-v8k            the same at 8,192 ids (the issue's table: 0.995 at step 560)
#   300m-v32k-dropless  32,768 ids with the MoE dropless (every copy run so far dropped 40%+ of its slots)
#   300m-v32k-fp32      32,768 ids without bf16 autocast
#   300m-v32k-long      32,768 ids, 1,500 steps
#   300m-v32k-zipf      32,768 ids drawn with p ~ 1/rank (as words are; the recipe's copy_draw: unigram draws as the
#                       text does); its copy accuracy is measured on Zipf-drawn spans too
#
#   bash bench/copy_probe_gpu.sh                      # carry .whl-dag/pack; logs and summary.md in $OUT
#   VARIANTS="toy-v256 300m-v8k" bash bench/copy_probe_gpu.sh
#
# GPU g runs variants g, g + NGPU, ... in turn. On 4 GPUs the seven take about 9 minutes (gpu-300m: ~175 s for 750
# steps on an H100 in bf16; fp32 and the 1,500-step run longer); on fewer GPUs name fewer VARIANTS per call.
#
# Env: VARIANTS (names above, space separated; default all), NGPU (the GPUs to use; default all nvidia-smi lists),
# DEVICE (cuda; cpu runs them one at a time, for a check on a CPU), MORE_ARGS (appended to every variant's
# arguments, e.g. "--steps 2" for that check), SITE (/tmp/site), ARCHIVE (.whl-dag/pack/site.tar.xz), SITE_READY=1
# ($SITE holds the packages, or this machine's Python has them: nothing unpacked), PYTHON (python3), OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
SITE=${SITE:-/tmp/site}
ARCHIVE=${ARCHIVE:-.whl-dag/pack/site.tar.xz}
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/copy-probe-out}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
PROBE="--size gpu-300m --span 256 --seq-len 513 --rows 32 --lr 5e-4"
declare -A ARGS=(
    [toy-v256]="--vocab 256 --steps 400"
    [300m-v256]="$PROBE --vocab 256 --steps 800"
    [300m-v8k]="$PROBE --vocab 8192 --steps 800"
    [300m-v32k-dropless]="$PROBE --vocab 32768 --steps 800 --dropless"
    [300m-v32k-fp32]="$PROBE --vocab 32768 --steps 800 --fp32"
    [300m-v32k-long]="$PROBE --vocab 32768 --steps 1500"
    [300m-v32k-zipf]="$PROBE --vocab 32768 --steps 800 --zipf"
)
ORDER=(toy-v256 300m-v8k 300m-v32k-dropless 300m-v32k-zipf 300m-v32k-fp32 300m-v256 300m-v32k-long)
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

# GPU g runs variants g, g + NGPU, g + 2 NGPU, ... one after another; the GPUs run at once
run_on() {
    local g=$1 j v
    for ((j = g; j < ${#WANT[@]}; j += NGPU)); do
        v=${WANT[$j]}
        echo "copy_probe_gpu: $v on GPU $g: copy_toy.py ${ARGS[$v]} ${MORE_ARGS:-}"
        # shellcheck disable=SC2086  # the variant's arguments are words
        CUDA_VISIBLE_DEVICES=$g OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} "$PYTHON" bench/copy_toy.py --device "$DEVICE" \
            ${ARGS[$v]} ${MORE_ARGS:-} >"$OUT/$v.log" 2>"$OUT/$v.err"
        echo "copy_probe_gpu: $v ended: $(tail -n 1 "$OUT/$v.log" 2>/dev/null)"
    done
}
pids=()
for ((g = 0; g < NGPU; g++)); do run_on "$g" & pids+=($!); done
for p in "${pids[@]}"; do wait "$p"; done

# the summary: per variant, the first report at copy accuracy >= 0.5 and the last report
"$PYTHON" - "$OUT" "${WANT[@]}" <<'EOF' | tee "$OUT/summary.md"
import json, sys
from pathlib import Path
out, names = Path(sys.argv[1]), sys.argv[2:]
print("| variant | steps run | first step at copy accuracy >= 0.5 | last loss | last copy accuracy | ln V | seconds |")
print("|---|---:|---:|---:|---:|---:|---:|")
for name in names:
    rows = []
    for line in (out / f"{name}.log").read_text().splitlines() if (out / f"{name}.log").exists() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    if not rows:
        err = (out / f"{name}.err").read_text().strip().splitlines()[-1:] if (out / f"{name}.err").exists() else []
        print(f"| {name} | failed: {err[0][:120] if err else 'no output'} | | | | | |")
        continue
    first = next((r["step"] for r in rows if r["copy_accuracy"] >= 0.5), "none")
    last = rows[-1]
    print(f"| {name} | {last['step']} | {first} | {last['loss']} | {last['copy_accuracy']} | {last['ln_v']} | "
          f"{last['seconds']} |")
EOF
