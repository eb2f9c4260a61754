"""The sample corpus builder (``data/sample_corpus/build_corpus.py`` and its ``corpus_*.py`` modules) downloads
Debian, npm and PyPI packages, so CI never runs it; the built ``.jsonl.gz`` files are committed. These checks keep
its code runnable: every name it uses is defined or imported (pyflakes' rules through ruff), and the script starts."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1] / "data" / "sample_corpus"
MODULES = sorted(HERE.glob("*.py"))


def test_the_builder_is_split_into_modules_of_at_most_700_lines() -> None:
    names = {p.name for p in MODULES}
    assert {"build_corpus.py", "corpus_text.py", "corpus_fetch.py", "corpus_collect.py"} <= names
    assert all(len(p.read_text().splitlines()) <= 700 for p in MODULES)


@pytest.mark.skipif(shutil.which("ruff") is None and not (Path(sys.executable).parent / "ruff").exists(),
                    reason="ruff is a dev dependency (scripts/install.sh installs it)")
def test_every_name_the_builder_uses_is_defined_or_imported() -> None:
    ruff = Path(sys.executable).parent / "ruff"
    r = subprocess.run([str(ruff) if ruff.exists() else "ruff", "check", "--isolated", "--select", "F",
                        *map(str, MODULES)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_builder_starts_and_documents_its_options() -> None:
    r = subprocess.run([sys.executable, str(HERE / "build_corpus.py"), "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--workdir" in r.stdout and "--keep" in r.stdout
