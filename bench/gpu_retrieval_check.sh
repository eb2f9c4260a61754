#!/usr/bin/env bash
# Issue 22's first GPU call: which retrieval data makes gpu-300m copy within a pretraining run's tokens?
#
#   bash bench/gpu_retrieval_check.sh        (on the lent GPU machine; carry .whl-dag/pack)
#
# 1. the gpu-recipe's data stages (bench/run_gpu_dag.sh with --stage mix: ingest .. mix and the tokenizer) in the
#    artifact root that a later `KEEP_WORK=1 bash bench/run_gpu_dag.sh` resumes (they are then cache hits);
# 2. the mixture packed into $SEQ-token rows (pretrain/packed_data.py, as the pretrain stage packs it);
# 3. bench/retrieval_data_check.py for each config of STREAM_A and STREAM_B (';'-separated "label args..."), the two
#    streams side by side on the one GPU, each config in turn, every config stopped at the call's deadline.
# $OUT gets: check.jsonl (one final JSON line per finished config), check.log (every probe line, labelled),
# dag_summary.txt (the data stages). Configs already in $WORK/check.jsonl are skipped (a next call resumes).
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
WORK=${WORK:-/tmp/hylight-gpu-dag}
OUT=${OUT:-$WORK/out}
SEQ=${SEQ:-2048}
LIMIT_S=${LIMIT_S:-560}
COMMON=${COMMON:---size gpu-300m --seq-len $SEQ --rows 16 --micro-rows 4 --lr 8e-4 --steps 240 --probe-every 40}
MIX="repeat,repeat,continue,lookup,multi_lookup"
STREAM_A=${STREAM_A:-"rr --kinds random_repeat;rep_ans25 --kinds repeat --text-share 0.25 --answers-only"}
STREAM_B=${STREAM_B:-"mix_ans50 --kinds $MIX --text-share 0.5 --answers-only;mix_all50 --kinds $MIX --text-share 0.5"}
mkdir -p "$OUT" "$WORK"

if [ ! -f "$WORK/data.ok" ]; then
    KEEP_WORK=1 RUN_ARGS="--stage mix" RUN_LIMIT_S=300 OUT="$WORK/dagout" bash bench/run_gpu_dag.sh >/dev/null 2>&1
    cp "$WORK/dagout/summary.txt" "$OUT/dag_summary.txt" 2>/dev/null
fi
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=4
if [ ! -f "$WORK/data.ok" ]; then
    python3 - "$WORK" "$SEQ" <<'EOF' || { echo "packing failed" | tee -a "$OUT/check.log"; exit 2; }
import json, sys, time
from pathlib import Path
from pretrain.packed_data import build_packed_dataset
work, seq = Path(sys.argv[1]), int(sys.argv[2])
stages = json.loads((work / "report.json").read_text())["stages"]
art = {k: stages[k]["artifact"] for k in ("mix", "quality", "tokenizer")}
t = time.time()
info = build_packed_dataset(art["mix"], art["quality"], art["tokenizer"], work / "packed", seq_len=seq, seed=0,
                            eval_documents=64)
(work / "data.ok").write_text(json.dumps({"tokenizer": art["tokenizer"], "data": str(work / "packed")}))
print(f"packed {info.train.rows} train rows, {info.eval.rows} eval rows of {seq} in {time.time() - t:.0f} s")
EOF
fi
TOK=$(python3 -c "import json,sys; print(json.load(open('$WORK/data.ok'))['tokenizer'])")
echo "[check $(( $(date +%s) - T0 ))s] data ready; tokenizer $TOK" | tee -a "$OUT/check.log"
touch "$WORK/check.jsonl"

stream() {
    IFS=';' read -ra cfgs <<<"$1"
    for c in "${cfgs[@]}"; do
        label=${c%% *}; args=${c#* }
        grep -q "\"label\": \"$label\"" "$WORK/check.jsonl" && continue
        left=$(( LIMIT_S - ($(date +%s) - T0) ))
        [ "$left" -lt 60 ] && { echo "[check] $label: no time left" >>"$OUT/check.log"; continue; }
        echo "[check $(( $(date +%s) - T0 ))s] $label: $args" >>"$OUT/check.log"
        # shellcheck disable=SC2086
        timeout -s INT -k 10 "$left" python3 bench/retrieval_data_check.py --tokenizer "$TOK" --data "$WORK/packed" \
            $COMMON $args --label "$label" --out "$WORK/check.jsonl" 2>&1 | grep -v '^{"label".*"history"' \
            | sed "s/^/[$label] /" >>"$OUT/check.log"
    done
}
stream "$STREAM_A" &
stream "$STREAM_B" &
wait
cp "$WORK/check.jsonl" "$OUT/check.jsonl"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >>"$OUT/check.log" 2>&1
echo "[check $(( $(date +%s) - T0 ))s] done" | tee -a "$OUT/check.log"
python3 - "$OUT/check.jsonl" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    f = r["final"]
    print(f"{r['label']:>10}: step {f['step']} loss {f['loss']:.3f} answer_acc {f['answer_accuracy']:.3f} copy(seen) "
          f"{f['copy_accuracy']:.3f} copy(vocab) {f['copy_accuracy_vocab']:.3f} niah_choice {f['niah_choice_accuracy']:.2f} "
          f"margin {f['niah_answer_margin']:+.2f} ({f['seconds']} s)")
EOF
tail -n 40 "$OUT/check.log"
