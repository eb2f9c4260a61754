#!/usr/bin/env bash
# The GPU recipe in one machine lease, one command per call (issue 33). The first call starts
# bench/run_gpu_dag.sh (dags/gpu-recipe.yaml by default) in its own process session, so that the run outlives the
# call: a lent machine kills what a call leaves behind except a new session, and keeps running it while it is held.
# Every call (the first too) then watches the run until WATCH_S seconds after its own start, printing each stage
# that starts or ends and the training stages' last logged step, and ends by writing a snapshot into $OUT:
#
#   results.md       bench/recipe_results.py over the finished stages (stage table with start, seconds and GPU;
#                    GPUs busy when; the copy curriculum's probe curve; NIAH; pass rates; the ablation table)
#   records.tar.gz   bench/gpu_dag_records.py: every finished stage's records (plots: NIAH heat maps, loss and
#                    probe curves, comparison.png), unfinished stages' train logs
#   run.log          the run's console so far (bench/run_gpu_dag.sh's, which also has the package preflight)
#   progress.txt     this call's watch lines
#   summary.txt, report.json, diagnostics.txt   bench/run_gpu_dag.sh's own record, once the run has ended
#   compile-cache.tar.gz   the run's inductor and Triton caches where they fit 15 MB, else bench/warm_compile.py's
#                    (the softmax layers' FlexAttention kernels): copy it to .compile-cache/ here (ignored by
#                    git) and carry that folder next time
#
#   bash bench/gpu_recipe_lease.sh                  # first call (carry .whl-dag/pack): start and watch ~9 min
#   bash bench/gpu_recipe_lease.sh                  # each next call, on the still-warm machine: watch on
#   RESTART=1 bash bench/gpu_recipe_lease.sh        # the run ended on a failure fixed in this call's tree: run it
#                                                   # again on the same artifact root (finished stages cached)
#
# A call made within 30 s of the last one finds the machine warm and the run going. Between calls nothing stops:
# no stage is cut by a call's limit, no checkpoint is reloaded. The run itself is limited by RUN_LIMIT_S (1700 s:
# a machine is held 30 minutes at most).
#
# Env: WATCH_S (540: keep it ~50 s under the call's timeout), RUN_LIMIT_S (1700), LEASE (/tmp/hylight-lease: the
# watcher's own state, outside the run's WORK), WORK (/tmp/hylight-gpu-dag), DAG, HYLIGHT_SET, RUN_ARGS, SITE,
# ARCHIVE, PYTHON: passed on to bench/run_gpu_dag.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
PWD_ROOT=$PWD
T0=$(date +%s)
WATCH_S=${WATCH_S:-540}
LEASE=${LEASE:-/tmp/hylight-lease}
export WORK=${WORK:-/tmp/hylight-gpu-dag}
PYTHON=${PYTHON:-python3}
CALL_OUT=${OUT:-$LEASE/out-call}
RUN_OUT="$LEASE/run-out"   # run_gpu_dag.sh's $OUT: run.log as it goes, its own record at the end
mkdir -p "$LEASE" "$CALL_OUT"
PROGRESS="$CALL_OUT/progress.txt"
: >"$PROGRESS"
say() { echo "[lease +$(( $(date +%s) - T0 ))s] $*" | tee -a "$PROGRESS"; }

running() { [ -f "$LEASE/pid" ] && kill -0 "$(cat "$LEASE/pid")" 2>/dev/null; }

if [ ! -f "$LEASE/pid" ] || { [ -n "${RESTART:-}" ] && ! running; }; then
    mkdir -p "$RUN_OUT"
    # RESTART=1 after the run ended (a fix sent with this call): the same artifact root, finished stages cached
    keep=${RESTART:+1}
    [ -n "$keep" ] && say "restarting the ended run on its artifact root (KEEP_WORK=1)"
    # The run works from a copy of this call's tree, not from the repo root: every later call replaces the repo
    # root with a fresh copy of the working tree, and a stage importing a module while that copy is under way
    # finds it missing (the ninth lease: eval_sft_more, "No module named 'model.sizes'", 16 s before the third
    # call's script began). The package archive stays where the call carried it (read once, at the start).
    TREE="$LEASE/tree"
    rm -rf "$TREE" && mkdir -p "$TREE" \
        && tar -C . --exclude=./.git --exclude=./.venv --exclude=./.whl-dag -cf - . | tar -C "$TREE" -xf - \
        || { say "copying the tree into $TREE failed"; exit 2; }
    say "the run works from a copy of this call's tree: $TREE ($(du -sh "$TREE" | cut -f1))"
    (cd "$TREE" && KEEP_WORK=$keep OUT="$RUN_OUT" RUN_LIMIT_S=${RUN_LIMIT_S:-1700} \
        ARCHIVE="${ARCHIVE:-$PWD_ROOT/.whl-dag/pack/site.tar.xz}" exec setsid nohup bash bench/run_gpu_dag.sh \
        >"$LEASE/run_gpu_dag.out" 2>&1 </dev/null) &
    echo $! >"$LEASE/pid"
    date +%s >"$LEASE/started"
    say "started bench/run_gpu_dag.sh (pid $(cat "$LEASE/pid"), its own session)"
    nvidia-smi -L 2>&1 | tee -a "$PROGRESS"
else
    say "watching the run started $(( $(date +%s) - $(cat "$LEASE/started") ))s ago (pid $(cat "$LEASE/pid"), running: $(running && echo yes || echo no))"
fi

# --- watch: stage lines as they come, the training stages' last step every minute ------------------------------
seen=0
last_steps=0
while :; do
    if [ -f "$RUN_OUT/run.log" ]; then
        n=$(wc -l <"$RUN_OUT/run.log")
        if [ "$n" -gt "$seen" ]; then
            sed -n "$((seen + 1)),${n}p" "$RUN_OUT/run.log" | grep -E '^\[ *[0-9.]+s\] (▶|✓|✗|·|↻)|run_gpu_dag|preflight .*FAILED|in all$|^\[check_flex\] (exit|.*FAIL)' \
                | cut -c1-400 | tee -a "$PROGRESS"
            seen=$n
        fi
    fi
    now=$(date +%s)
    if [ $((now - last_steps)) -ge 60 ]; then
        last_steps=$now
        for f in $(find "$WORK/root" -name train_log.jsonl -mmin -1.5 2>/dev/null); do
            say "$(echo "$f" | sed "s#$WORK/root/##"): $(tail -n 1 "$f" | "$PYTHON" -c 'import json,sys
r = json.loads(sys.stdin.read() or "{}")
print(" ".join(f"{k}={r[k]:.4g}" if isinstance(r[k], float) else f"{k}={r[k]}" for k in ("step", "loss", "tokens_per_second", "drop_rate", "copy_accuracy", "niah_choice_accuracy") if k in r))' 2>/dev/null)"
        done
    fi
    running || { say "the run has ended"; break; }
    [ $((now - T0)) -ge "$WATCH_S" ] && { say "watch ends (WATCH_S=$WATCH_S); the run goes on"; break; }
    sleep 10
done

# --- snapshot into this call's $OUT -------------------------------------------------------------------------
if running; then
    rm -f "$CALL_OUT/report.json"
    "$PYTHON" bench/recipe_results.py --root "$WORK/root" --out "$CALL_OUT/results.md" 2>&1 | tail -3
else
    for f in summary.txt report.json diagnostics.txt results.md; do
        [ -f "$RUN_OUT/$f" ] && cp "$RUN_OUT/$f" "$CALL_OUT/$f"
    done
    [ -f "$CALL_OUT/results.md" ] || "$PYTHON" bench/recipe_results.py --root "$WORK/root" --out "$CALL_OUT/results.md"
fi
"$PYTHON" bench/gpu_dag_records.py --work "$WORK" --out "$CALL_OUT" >/dev/null
# the compile caches, for the next lease to carry (.compile-cache/, bench/run_gpu_dag.sh), where they fit a file: the
# stages' whole caches, else bench/warm_compile.py's own (one pretrain step's kernels; the same layout)
for cache in compile-cache warm-cache; do
    [ -d "$WORK/$cache" ] || continue
    tar -C "$WORK" -czf "$LEASE/compile-cache.tar.gz" --transform "s#^$cache#compile-cache#" "$cache" 2>/dev/null
    size=$(stat -c %s "$LEASE/compile-cache.tar.gz" 2>/dev/null || echo 0)
    if [ "$size" -le 15000000 ]; then
        cp "$LEASE/compile-cache.tar.gz" "$CALL_OUT/" && say "compile caches: $cache, $size bytes, returned"
        break
    fi
    say "compile caches: $cache is $size bytes, over one returned file"
done
[ -f "$RUN_OUT/run.log" ] && tail -c 15000000 "$RUN_OUT/run.log" >"$CALL_OUT/run.log"
[ -f "$RUN_OUT/run.log" ] || cp "$LEASE/run_gpu_dag.out" "$CALL_OUT/run.log" 2>/dev/null
sed -n '/^## Stages/,/^## Pretraining/p' "$CALL_OUT/results.md" 2>/dev/null | head -60
running && exit 0
[ -f "$RUN_OUT/summary.txt" ] && grep -q "exit code 0" "$RUN_OUT/summary.txt"
