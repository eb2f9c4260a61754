"""bench/plot_train_logs.py: the series it reads from train_log.jsonl files, its refusal of a log with none of the
metrics asked, and the PNG it writes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import plot_train_logs  # noqa: E402  (bench/ is scripts, not a package)


def _log(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    return path


def test_read_series_keeps_steps_with_the_metric_and_skips_the_rest(tmp_path):
    p = _log(tmp_path / "a.jsonl", [{"step": 1, "loss": 9.0}, {"step": 2, "loss": 8.0, "drop_rate": 0.3},
                                     {"eval_loss": 5.0}, {"step": 3, "loss": float("nan")}, {"step": 4, "loss": 7}])
    s = plot_train_logs.read_series(p, ["loss", "drop_rate", "copy_accuracy"])
    assert s == {"loss": [(1, 9.0), (2, 8.0), (4, 7.0)], "drop_rate": [(2, 0.3)], "copy_accuracy": []}


def test_a_broken_line_names_the_file_and_line(tmp_path):
    p = tmp_path / "b.jsonl"
    p.write_text('{"step": 1, "loss": 2}\n{"step": 2,\n')
    with pytest.raises(ValueError, match=r"b\.jsonl:2"):
        plot_train_logs.read_series(p, ["loss"])


def test_main_writes_a_png_and_refuses_a_log_without_the_metrics(tmp_path, capsys):
    a = _log(tmp_path / "a.jsonl", [{"step": s, "loss": 10 - s, "drop_rate": 0.1 * s} for s in range(1, 5)])
    b = _log(tmp_path / "b.jsonl", [{"step": s, "loss": 11 - s} for s in range(1, 5)])
    out = tmp_path / "img" / "cmp.png"
    assert plot_train_logs.main(["--log", f"one={a}", "--log", f"two={b}", "--metrics", "loss,drop_rate",
                                 "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "one: loss 6 at step 4, drop_rate 0.4 at step 4" in printed and "two: loss 7 at step 4" in printed
    with pytest.raises(SystemExit, match="no step has any of copy_accuracy"):
        plot_train_logs.main(["--log", f"one={a}", "--metrics", "copy_accuracy", "--out", str(out)])
    with pytest.raises(SystemExit):
        plot_train_logs.main(["--log", "no-equals-sign", "--out", str(out)])
