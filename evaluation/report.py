"""What the ``eval`` stage makes of its measurements: the summary metrics (the names ``compare`` and MLflow read),
the plots, and strict JSON for ``report.json`` / ``timing.json`` (and the compare stage's comparison).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.artifacts import write_text_atomic
from pipeline.stage import StageContext, metric_key


def summary_metrics(trained: int, niah: dict[str, Any], copy: dict[str, Any] | None, mr: dict[str, Any],
                    loss: dict[str, Any], mc: dict[str, Any], passes: dict[str, Any] | None) -> dict[str, float]:
    """The stage's summary, in the order it is logged: the headline numbers at the trained length ``trained`` (T)
    and 2T, the copy probe, the multiple-choice means, the pass rate, then every length and every task."""
    T = trained
    summary: dict[str, float] = {
        "niah_accuracy": niah["accuracy_by_length"][T], "niah_accuracy_2x": niah["accuracy_by_length"][2 * T],
        "multi_round_niah_recall": mr["recall_by_length"][T],
        "multi_round_niah_recall_2x": mr["recall_by_length"][2 * T],
        "niah_choice_accuracy": niah["choice_accuracy_by_length"][T],
        "niah_choice_accuracy_2x": niah["choice_accuracy_by_length"][2 * T],
        "niah_answer_margin": niah["margin_by_length"][T], "niah_answer_margin_2x": niah["margin_by_length"][2 * T],
        "niah_prefix_digits": niah["prefix_digits_by_length"][T],
        "niah_prefix_digits_2x": niah["prefix_digits_by_length"][2 * T],
    }
    if "number_start_prob_by_length" in niah:
        summary |= {"niah_number_start_prob": niah["number_start_prob_by_length"][T],
                    "niah_number_start_prob_2x": niah["number_start_prob_by_length"][2 * T]}
    if "chat_accuracy_by_length" in niah:  # niah_chat
        summary |= {"niah_chat_accuracy": niah["chat_accuracy_by_length"][T],
                    "niah_chat_accuracy_2x": niah["chat_accuracy_by_length"][2 * T]}
    if copy is not None:
        summary |= {"copy_accuracy": copy["accuracy"], "copy_loss_gain": copy["loss_gain"]}
    if mc:
        summary["mc_acc_norm"] = float(np.mean([r["acc_norm"] for r in mc.values()]))
        summary["mc_log_acc_norm2"] = float(np.mean([r["log_acc_norm2"] for r in mc.values()]))
    if passes is not None:
        summary |= passes["metrics"]
    summary |= {f"eval_loss_at_{L}": v for L, v in loss["loss_at"].items()}
    summary |= {f"niah_accuracy_at_{L}": v for L, v in niah["accuracy_by_length"].items()}
    summary |= {f"multi_round_niah_recall_at_{L}": v for L, v in mr["recall_by_length"].items()}
    for name, r in mc.items():
        key = metric_key(name)
        summary |= {f"mc_acc.{key}": r["acc"], f"mc_acc_norm.{key}": r["acc_norm"],
                    f"mc_log_acc_norm2.{key}": r["log_acc_norm2"], f"mc_items.{key}": r["items"]}
        if math.isfinite(r["power"]["min_items"]):
            summary[f"mc_min_items.{key}"] = r["power"]["min_items"]
        if math.isfinite(r["power"]["detectable_gain"]):
            summary[f"mc_mde.{key}"] = r["power"]["detectable_gain"]
    return summary


def plot_results(ctx: StageContext, niah: dict[str, Any], mr: dict[str, Any], loss: dict[str, Any],
                 trained: int) -> None:
    """``plots/niah.png`` (NIAH accuracy and multi-round recall by length x depth) and ``plots/loss_by_position.png``."""
    import matplotlib  # heavy: matplotlib (plots at the end of a run)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: matplotlib

    fig, ax = plt.subplots(1, 2, figsize=(11, 0.45 * len(niah["depths"]) + 2.6))
    for a, grid, depths, lengths, title in (
            (ax[0], niah["accuracy"], niah["depths"], niah["lengths"], "NIAH accuracy"),
            (ax[1], mr["recall_by_depth"], mr["depths"], mr["lengths"], "multi-round NIAH recall")):
        im = a.imshow(np.asarray(grid), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        a.set_xticks(range(len(lengths)), [f"{L}" + (" (T)" if L == trained else "") for L in lengths])
        a.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        a.set_xlabel("context length (tokens)")
        a.set_ylabel("needle depth")
        a.set_title(title)
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                a.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
        fig.colorbar(im, ax=a)
    ctx.log_figure(fig, "niah.png")

    fig, a = plt.subplots(figsize=(7, 3.8))
    xs, ys = zip(*loss["curve"], strict=True)
    a.plot(xs, ys, marker=".")
    a.axvline(trained, color="C3", ls="--", label=f"trained length {trained}")
    a.set_xlabel("position (tokens)")
    a.set_ylabel("next-token loss (nats)")
    a.set_title(f"loss by position ({loss['windows']} held-out windows)")
    a.legend()
    ctx.log_figure(fig, "loss_by_position.png")


def write_strict_json(path: Path, obj: Any) -> None:
    """Strict JSON (an infinite 'items needed' becomes null), written under a temporary name and renamed."""
    write_text_atomic(path, json.dumps(_finite(obj), indent=2, allow_nan=False) + "\n")


def _finite(o: Any) -> Any:
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_finite(v) for v in o]
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return o
