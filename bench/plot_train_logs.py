"""Overlay the training logs (``train_log.jsonl``) of several stage runs, one panel per metric: two pretrains
that differ in one param, side by side on the same steps (e.g. the GPU recipe's hybrid and its capacity branch).

    python bench/plot_train_logs.py --out docs/img/gpu-recipe-capacity.png \\
        --log "capacity 1.25=rec/pretrain/train_log.jsonl" --log "capacity 2.0=rec/pretrain_capacity_2/train_log.jsonl" \\
        --metrics loss,drop_rate,copy_accuracy

A metric a log does not have is left out of that panel; a log with none of the metrics is an error (a wrong path or
metric name should not give an empty plot). Prints the last value of each metric per log.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def read_series(path: Path, metrics: list[str]) -> dict[str, list[tuple[int, float]]]:
    """{metric: [(step, value), ...]} from a train_log.jsonl (rows without ``step`` or the metric are skipped;
    non-finite values too)."""
    out: dict[str, list[tuple[int, float]]] = {m: [] for m in metrics}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({e})") from None
            if "step" not in row:
                continue
            for m in metrics:
                v = row.get(m)
                if isinstance(v, (int, float)) and math.isfinite(v):
                    out[m].append((int(row["step"]), float(v)))
    return out


def parse_log_arg(arg: str) -> tuple[str, Path]:
    label, sep, path = arg.partition("=")
    if not sep or not label or not path:
        raise argparse.ArgumentTypeError(f"--log {arg!r}: use LABEL=PATH")
    return label, Path(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", action="append", type=parse_log_arg, required=True, help="LABEL=path/train_log.jsonl")
    ap.add_argument("--metrics", default="loss,drop_rate,copy_accuracy", help="comma-separated train_log fields")
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    ap.add_argument("--title", default="")
    a = ap.parse_args(argv)
    metrics = [m for m in a.metrics.split(",") if m]
    series = {}
    for label, path in a.log:
        s = read_series(path, metrics)
        if not any(s.values()):
            raise SystemExit(f"{path}: no step has any of {', '.join(metrics)}")
        series[label] = s
        print(f"{label}: " + ", ".join(f"{m} {v[-1][1]:.4g} at step {v[-1][0]}" for m, v in s.items() if v))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.4), squeeze=False)
    for ax, m in zip(axes[0], metrics, strict=True):
        for label, s in series.items():
            if s[m]:
                steps, vals = zip(*s[m], strict=True)
                ax.plot(steps, vals, label=label, lw=1.4)
        ax.set_title(m)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    if a.title:
        fig.suptitle(a.title)
    fig.tight_layout()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
