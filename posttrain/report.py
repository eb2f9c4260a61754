"""The run records every post-training stage writes the same way: the summary metrics, the loss curve and the
report file (``<stage>_report.json``, with the sandbox containment of the code checks the stage ran).

A record (``StageKind.records``) is hashed and verified but not part of the artifact's digest; no stage reads it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pipeline.artifacts import write_text_atomic
from pipeline.stage import StageContext
from posttrain.sandbox import record_sandbox


def log_finite_summary(ctx: StageContext, summary: dict[str, Any]) -> None:
    """``ctx.log_summary`` of the values that are numbers (a NaN, e.g. the loss of a run that logged none, is left
    out: MLflow would show it as a value)."""
    ctx.log_summary({k: v for k, v in summary.items() if not (isinstance(v, float) and math.isnan(v))})


def write_report(ctx: StageContext, path: Path, report: dict[str, Any], stage: str, *,
                 default: Callable[[Any], Any] | None = None) -> None:
    """The stage's report: its sandbox containment record added (``report["sandbox"]``, also set as MLflow tags),
    written as sorted, indented JSON through the fsynced atomic writer, and logged as an artifact under ``stage``.
    ``default``: json.dumps' converter of values JSON has no type for."""
    report["sandbox"] = record_sandbox(ctx)
    write_text_atomic(path, json.dumps(report, indent=2, sort_keys=True, default=default) + "\n")
    ctx.log_artifact(path, stage)


def loss_figure(losses: Sequence[tuple[int, float]], *, xlabel: str, ylabel: str, title: str, marker: str,
                grid: bool = False) -> Any:
    """The training loss by optimizer step, (step, loss) pairs as the trainer log relay keeps them."""
    import matplotlib  # heavy: matplotlib (a plot at the end of a run)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: matplotlib

    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot([s for s, _ in losses], [v for _, v in losses], marker=marker)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    if grid:
        ax.grid(alpha=0.3)
    return fig
