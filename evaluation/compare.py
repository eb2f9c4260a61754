"""Stage ``compare``: side-by-side table and plot of several pretrained-and-evaluated variants (artifact ``comparison``).

The attention ablation of §2.2.2.3 / Figure 7 (all-softmax vs all-lightning vs the 7:1 hybrid, same data and token
budget) ends here, but nothing is specific to attention: a variant is one ``pretrain`` checkpoint and the ``eval``
report of it. Inputs: the ``eval_report`` artifacts and the ``checkpoint`` artifacts they evaluated; each report is
matched to its checkpoint through the checkpoint digest in the report's manifest (its cache-key inputs). A variant is
named after its pretrain stage (``stages.<name>`` of the spec).

Fairness: the comparison means something only if the variants differ in the ablated factor alone. The stage refuses
(``allow_unfair: true`` turns the refusal into a loud warning, recorded in the outputs) when the checkpoints were
trained on different inputs (mixture, documents, tokenizer), with pretrain params that differ outside ``varied``
(default: ``model_overrides.attention_pattern``), saw different token counts, or were evaluated with different eval
params or trained lengths.

Output: ``comparison.json`` (every variant's numbers, the fairness findings, the power analysis), ``comparison.md``
(the table), ``plots/comparison.png`` (train loss curves and loss by position side by side, NIAH/MC bars). Each
variant's headline numbers are logged as metrics ``<variant>.<metric>``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field

from evaluation.eval import EVAL_REPORT_TYPE, REPORT_FILE
from evaluation.metrics import min_samples_for_accuracy_difference, min_samples_for_mean_difference
from evaluation.report import write_strict_json
from pipeline.artifacts import write_text_atomic
from pipeline.stage import Artifact, InputSpec, StageContext, StageKind, StageParams, metric_key
from pretrain.stage import CHECKPOINT_TYPE, LOSS_CURVE_FILE

COMPARISON_TYPE = "comparison"
COMPARISON_JSON = "comparison.json"
COMPARISON_MD = "comparison.md"
PLOT_NAME = "comparison.png"

# eval metrics every variant must have (evaluation/eval.py's summary); MC ones are checked per task
REQUIRED_EVAL_METRICS = ("niah_accuracy", "niah_accuracy_2x", "multi_round_niah_recall", "multi_round_niah_recall_2x")
REQUIRED_PRETRAIN_METRICS = ("eval_loss", "tokens")
# pretrain params that change how a run is carried out, not what it learns: they may differ between variants
RUN_MECHANICS = ("lightning_impl", "compile", "checkpoint_every", "log_every", "processes")


class CompareParams(StageParams):
    varied: list[str] = Field(default_factory=lambda: ["model_overrides.attention_pattern"], description=(
        "Pretrain params (dotted, e.g. model_overrides.attention_pattern) the variants are meant to differ in; any "
        "other difference in pretrain params, inputs or tokens makes the comparison unfair."))
    allow_unfair: bool = Field(False, description=(
        "Compare variants that differ in more than `varied` (different data, token budget, eval settings) with a "
        "warning in the log, comparison.md and comparison.json, instead of refusing."))
    alpha: float = Field(0.05, gt=0, lt=1, description="Power analysis: two-sided significance level.")
    power: float = Field(0.8, gt=0, lt=1, description="Power analysis: probability of detecting the observed gap.")


@dataclass
class Variant:
    """One pretrained-and-evaluated model: what the table shows about it."""

    name: str
    pattern: list[str]  # per layer: lightning / softmax
    params_total: int
    params_activated: int
    pretrain: dict[str, Any]  # the checkpoint's manifest (key_material, summary)
    train_curve: list[tuple[int, float]]  # (tokens, train loss) as logged
    report: dict[str, Any]  # the eval stage's report.json
    eval_manifest: dict[str, Any] = field(default_factory=dict)

    @property
    def metrics(self) -> dict[str, float]:
        return self.report["metrics"]

    @property
    def tokens(self) -> int:
        return int(self.pretrain["summary"]["tokens"])


# --- loading ------------------------------------------------------------------------------------------------------
def describe_pattern(pattern: list[str]) -> str:
    """``all-softmax``, ``all-lightning``, or ``hybrid 7:1`` style (lightning:softmax layer counts, §2)."""
    soft = sum(k == "softmax" for k in pattern)
    light = len(pattern) - soft
    if soft == 0:
        return "all-lightning"
    if light == 0:
        return "all-softmax"
    return f"hybrid {light // soft}:1" if light % soft == 0 else f"hybrid {light}:{soft}"


def load_variant(report: Artifact, checkpoint: Artifact) -> Variant:
    """A variant from an eval artifact and the checkpoint artifact it evaluated."""
    from model.accounting import parameter_counts  # heavy: transformers, torch
    from model.configuration import HybridConfig  # heavy: transformers, torch

    where = f"compare: checkpoint {checkpoint.path} (stage {checkpoint.manifest.get('stage', '?')!r})"
    config_file = checkpoint.path / "model" / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{where} has no model/config.json: bind the compare stage to pretrain stages")
    config = HybridConfig.from_pretrained(config_file.parent)
    counts = parameter_counts(config)
    summary = checkpoint.manifest.get("summary", {})
    missing = [m for m in REQUIRED_PRETRAIN_METRICS if m not in summary]
    if missing:
        raise ValueError(f"{where}: its manifest summary lacks {missing}; it was not written by the pretrain stage")
    curve = []
    curve_file = checkpoint.path / LOSS_CURVE_FILE  # payload; train_log.jsonl is a record, not in the digest
    if curve_file.is_file():
        curve = [(int(r["tokens"]), float(r["loss"])) for r in json.loads(curve_file.read_text())["rows"]]
    report_file = report.path / REPORT_FILE
    if not report_file.is_file():
        raise FileNotFoundError(f"compare: eval artifact {report.path} has no {REPORT_FILE}: bind the compare stage to "
                                "eval stages")
    data = json.loads(report_file.read_text())
    missing = [m for m in REQUIRED_EVAL_METRICS if data.get("metrics", {}).get(m) is None]
    T = data.get("trained_length")
    if T is None or data.get("metrics", {}).get(f"eval_loss_at_{T}") is None:
        missing.append(f"eval_loss_at_{T}")
    if missing:
        raise ValueError(f"compare: eval report {report_file} (stage {report.manifest.get('stage', '?')!r}) lacks "
                         f"metrics {missing}: rerun that eval stage with the current code")
    return Variant(name=str(checkpoint.manifest.get("stage", checkpoint.path.name)), pattern=list(config.attention_pattern),
                   params_total=counts.total, params_activated=counts.activated, pretrain=checkpoint.manifest,
                   train_curve=curve, report=data, eval_manifest=report.manifest)


def pair_reports(reports: list[Artifact], checkpoints: list[Artifact]) -> list[tuple[Artifact, Artifact]]:
    """Each checkpoint (in input order) with the one eval report of it, through the digest in the report's cache key."""
    by_digest = {c.digest: c for c in checkpoints}
    paired: dict[str, Artifact] = {}
    for r in reports:
        evaluated = r.manifest.get("key_material", {}).get("inputs", {}).get("checkpoint", [])
        if len(evaluated) != 1:
            raise ValueError(f"compare: eval artifact {r.path} does not record the one checkpoint it evaluated (its "
                             "manifest's key_material.inputs.checkpoint): was it produced by the eval stage?")
        ckpt = by_digest.get(evaluated[0])
        if ckpt is None:
            raise ValueError(f"compare: eval artifact {r.path} (stage {r.manifest.get('stage', '?')!r}) evaluated "
                             f"checkpoint {evaluated[0][:12]}, which is not among the compare stage's checkpoint "
                             "inputs: add that pretrain stage to its needs")
        if ckpt.digest in paired:
            raise ValueError(f"compare: eval artifacts {paired[ckpt.digest].path} and {r.path} both evaluate "
                             f"checkpoint {ckpt.path}: give the compare stage one eval per variant")
        paired[ckpt.digest] = r
    unevaluated = [str(c.path) for c in checkpoints if c.digest not in paired]
    if unevaluated:
        raise ValueError(f"compare: no eval report for checkpoint(s) {unevaluated}: add their eval stages to the "
                         "compare stage's needs")
    if len(checkpoints) < 2:
        raise ValueError(f"compare: {len(checkpoints)} variant(s); a comparison needs at least two")
    return [(paired[c.digest], c) for c in checkpoints]


# --- fairness -----------------------------------------------------------------------------------------------------
def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out |= _flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def fairness_problems(variants: list[Variant], varied: list[str]) -> list[str]:
    """Every way the variants differ besides ``varied`` (empty: a fair comparison). Each names the field and the
    value per variant."""
    problems: list[str] = []

    def differ(what: str, values: dict[str, Any]) -> None:
        if len({json.dumps(v, sort_keys=True, default=str) for v in values.values()}) > 1:
            problems.append(f"{what} differs: " + ", ".join(f"{n}={v!r}" for n, v in values.items()))

    for v in variants:
        if "key_material" not in v.pretrain or "key_material" not in v.eval_manifest:
            problems.append(f"{v.name}: its checkpoint or eval manifest has no key_material (not produced by the "
                            "pipeline), so its data and settings cannot be checked")
    if problems:
        return problems
    km = {v.name: v.pretrain["key_material"] for v in variants}
    for role in sorted({r for k in km.values() for r in k.get("inputs", {})}):
        differ(f"pretrain input {role!r} (artifact digest)", {n: k["inputs"].get(role) for n, k in km.items()})
    flat = {n: _flatten(k.get("params", {})) for n, k in km.items()}
    keys = sorted({p for f in flat.values() for p in f})
    for p in keys:
        if p in varied or p in RUN_MECHANICS or any(p.startswith(f"{x}.") for x in varied):
            continue
        differ(f"pretrain param {p}", {n: f.get(p) for n, f in flat.items()})
    differ("tokens trained on", {v.name: v.tokens for v in variants})
    ekm = {v.name: v.eval_manifest["key_material"] for v in variants}
    differ("eval params", {n: k.get("params") for n, k in ekm.items()})
    for role in ("mixture", "documents"):
        differ(f"eval input {role!r} (artifact digest)", {n: k.get("inputs", {}).get(role) for n, k in ekm.items()})
    differ("trained length", {v.name: v.report.get("trained_length") for v in variants})
    differ("multiple-choice tasks", {v.name: sorted(v.report.get("multiple_choice", {})) for v in variants})
    return problems


# --- the table ----------------------------------------------------------------------------------------------------
def _final_train_loss(v: Variant) -> float:
    return v.train_curve[-1][1] if v.train_curve else float(v.pretrain["summary"].get("loss", math.nan))


def _varied_rows(variants: list[Variant], varied: Sequence[str]) -> list[tuple[str, str, list[Any]]]:
    """A row per varied pretrain param besides the attention pattern (its own rows show it): the param's value per
    variant, from the checkpoint's key material ("—" where a manifest lacks it)."""
    out: list[tuple[str, str, list[Any]]] = []
    for p in varied:
        if p == "model_overrides.attention_pattern":
            continue
        values = [_flatten(v.pretrain.get("key_material", {}).get("params", {})).get(p) for v in variants]
        out.append(("", f"pretrain param `{p}` (varied)", [x if x is None else str(x) for x in values]))
    return out


def rows(variants: list[Variant], varied: Sequence[str] = ()) -> list[tuple[str, str, list[Any]]]:
    """The table, one row per quantity: (metric key, label, value per variant). The metric key names the MLflow metric
    ``<variant>.<key>`` ('' for rows that are not numbers). ``varied``: the params the comparison varies, each a row."""
    T = variants[0].report["trained_length"]
    lengths = sorted({int(L) for v in variants for L in v.report["loss_by_position"]["loss_at"]})
    out: list[tuple[str, str, list[Any]]] = [
        ("", "attention pattern", [describe_pattern(v.pattern) for v in variants]),
        ("", "layers (lightning / softmax)",
         [f"{sum(k == 'lightning' for k in v.pattern)} / {sum(k == 'softmax' for k in v.pattern)}" for v in variants]),
        *_varied_rows(variants, varied),
        ("params_total", "parameters, total", [v.params_total for v in variants]),
        ("params_activated", "parameters, activated", [v.params_activated for v in variants]),
        ("tokens", "tokens trained on", [v.tokens for v in variants]),
        ("train_loss", "final train loss (last logged window)", [_final_train_loss(v) for v in variants]),
        ("eval_loss", "held-out eval loss (pretrain, trained length)",
         [float(v.pretrain["summary"]["eval_loss"]) for v in variants]),
        ("tokens_per_second", "training tokens/s, last logged window (Figure 8's TGS; noisy on a shared CPU)",
         [v.pretrain["summary"].get("tokens_per_second") for v in variants]),
    ]
    prev = 1
    for L in lengths:
        label = f"loss at positions [{prev}, {L})" + (" (beyond trained length)" if L > T else "")
        out.append((f"eval_loss_at_{L}", label, [v.metrics.get(f"eval_loss_at_{L}") for v in variants]))
        prev = L
    out += [
        ("niah_accuracy", f"NIAH accuracy at {T}", [v.metrics["niah_accuracy"] for v in variants]),
        ("niah_accuracy_2x", f"NIAH accuracy at {2 * T}", [v.metrics["niah_accuracy_2x"] for v in variants]),
        ("multi_round_niah_recall", f"multi-round NIAH recall at {T}",
         [v.metrics["multi_round_niah_recall"] for v in variants]),
        ("multi_round_niah_recall_2x", f"multi-round NIAH recall at {2 * T}",
         [v.metrics["multi_round_niah_recall_2x"] for v in variants]),
    ]
    # the retrieval diagnostics (eval reports written before they existed lack them: "—")
    chance = {v.report["niah"].get("choice_chance") for v in variants} - {None}
    chance_note = f", chance {chance.pop():.2f}" if len(chance) == 1 else ""
    for key, label in (("niah_choice_accuracy", f"NIAH forced choice at {T} (needle's number vs others{chance_note})"),
                       ("niah_choice_accuracy_2x", f"NIAH forced choice at {2 * T}"),
                       ("niah_answer_margin", f"NIAH answer margin at {T}, nats (needle's number minus others)"),
                       ("copy_accuracy", "copy probe: second-copy top-1 accuracy (random tokens, repeated)"),
                       ("copy_loss_gain", "copy probe: loss drop from first to second copy, nats")):
        if any(key in v.metrics for v in variants):
            out.append((key, label, [v.metrics.get(key) for v in variants]))
    for task in _mc_tasks(variants, every=False):  # a task some variant lacks (allow_unfair) shows "—" there
        mc = [v.report.get("multiple_choice", {}).get(task) for v in variants]
        items = "/".join(sorted({str(m["items"]) for m in mc if m}))
        key = metric_key(task)
        out += [(f"mc_acc_norm.{key}", f"MC {task}: acc_norm ({items} items)", [m and m["acc_norm"] for m in mc]),
                (f"mc_log_acc_norm2.{key}", f"MC {task}: log acc_norm² (§4.1.3.1)",
                 [m and m["log_acc_norm2"] for m in mc])]
    if _mc_tasks(variants, every=False):
        out += [("mc_acc_norm", "MC mean acc_norm", [v.metrics.get("mc_acc_norm") for v in variants]),
                ("mc_log_acc_norm2", "MC mean log acc_norm²", [v.metrics.get("mc_log_acc_norm2") for v in variants])]
    return out


def _mc_tasks(variants: list[Variant], every: bool) -> list[str]:
    """Multiple-choice task names of every variant (``every``) or of any."""
    sets = [set(v.report.get("multiple_choice", {})) for v in variants]
    return sorted(set.intersection(*sets) if every else set.union(*sets))


def power_analysis(variants: list[Variant], alpha: float, power: float) -> list[dict[str, Any]]:
    """§4.1.3.1's question for each gap observed: how many items would a difference of this size need to be detected
    (two-sided, ``alpha``, ``power``), against how many this eval used. Accuracies (NIAH at T, MC acc_norm) by the
    two-proportion z-test, mean log acc_norm² by the two-sample t-test with the pooled item standard deviation."""
    out: list[dict[str, Any]] = []

    def accuracy_gap(what: str, accs: dict[str, float], used: int) -> None:
        lo, hi = min(accs, key=accs.get), max(accs, key=accs.get)
        gap = accs[hi] - accs[lo]
        need = min_samples_for_accuracy_difference(accs[lo], accs[hi], alpha, power) if gap > 0 else None
        out.append({"what": what, "metric": "accuracy", "low": lo, "high": hi, "gap": gap, "items_used": used,
                    "items_needed": need, "enough": need is not None and used >= need})

    T = variants[0].report["trained_length"]
    trials = [t for t in variants[0].report["niah"]["trials"] if t["length"] == T]
    accuracy_gap(f"NIAH accuracy at {T}", {v.name: v.metrics["niah_accuracy"] for v in variants}, len(trials))
    for task in _mc_tasks(variants, every=True):
        mc = {v.name: v.report["multiple_choice"][task] for v in variants}
        used = min(m["items"] for m in mc.values())
        accuracy_gap(f"MC {task} acc_norm", {n: m["acc_norm"] for n, m in mc.items()}, used)
        means = {n: m["log_acc_norm2"] for n, m in mc.items()}
        lo, hi = min(means, key=means.get), max(means, key=means.get)
        gap = means[hi] - means[lo]
        sd = math.sqrt((mc[lo]["log_acc_norm2_sd"] ** 2 + mc[hi]["log_acc_norm2_sd"] ** 2) / 2)
        need = min_samples_for_mean_difference(gap, sd, alpha, power) if gap > 0 and sd > 0 else None
        out.append({"what": f"MC {task} log acc_norm²", "metric": "mean", "low": lo, "high": hi, "gap": gap,
                    "pooled_sd": sd, "items_used": used, "items_needed": need,
                    "enough": need is not None and used >= need})
    return out


def _cell(v: Any) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 100 else f"{v:,.0f}"  # losses, accuracies; else counts and rates
    return str(v)


def render_markdown(variants: list[Variant], table: list[tuple[str, str, list[Any]]], power: list[dict[str, Any]],
                    problems: list[str], alpha: float, power_level: float) -> str:
    lines = [f"# Ablation (compare): {', '.join(v.name for v in variants)}", ""]
    if problems:
        lines += ["**WARNING: UNFAIR COMPARISON** (allow_unfair: true): the variants differ in more than the ablated "
                  "factor:", ""] + [f"- {p}" for p in problems] + [""]
    lines += ["| | " + " | ".join(v.name for v in variants) + " |",
              "| --- |" + " --- |" * len(variants)]
    lines += [f"| {label} | " + " | ".join(_cell(x) for x in values) + " |" for _, label, values in table]
    lines += ["", f"Power analysis (two-sided α = {alpha:g}, power = {power_level:g}; §4.1.3.1): items a gap of the "
              "observed size needs per model to be detected.", ""]
    for p in power:
        if p["items_needed"] is None:
            lines.append(f"- {p['what']}: no gap between the variants ({_cell(p['gap'])}); {p['items_used']} items")
            continue
        verdict = "enough" if p["enough"] else "not enough: the gap is within noise"
        lines.append(f"- {p['what']}: {p['high']} − {p['low']} = {p['gap']:.4f} needs {p['items_needed']:,} items; "
                     f"this eval has {p['items_used']:,} ({verdict})")
    return "\n".join(lines) + "\n"


def _plot(ctx: StageContext, variants: list[Variant]) -> Path:
    import matplotlib  # heavy: matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: matplotlib
    import numpy as np  # with matplotlib: the comparison's tables need neither

    T = variants[0].report["trained_length"]
    fig, ax = plt.subplots(1, 3, figsize=(17, 4.2))
    for i, v in enumerate(variants):
        pattern = describe_pattern(v.pattern)
        label = v.name if v.name in pattern else f"{v.name} ({pattern})"
        if v.train_curve:
            xs, ys = zip(*v.train_curve, strict=True)
            ax[0].plot(xs, ys, color=f"C{i}", label=label)
        xs, ys = zip(*v.report["loss_by_position"]["curve"], strict=True)
        ax[1].plot(xs, ys, color=f"C{i}", marker=".", label=label)
    ax[0].set(xlabel="tokens", ylabel="train loss (nats/token)", title="training loss (same data, same tokens)")
    ax[1].axvline(T, color="k", ls="--", lw=0.8, label=f"trained length {T}")
    ax[1].set(xlabel="position (tokens)", ylabel="next-token loss (nats)", title="held-out loss by position")
    ax[0].legend(fontsize=8)
    ax[1].legend(fontsize=8)
    bars = [("niah_accuracy", "NIAH"), ("niah_accuracy_2x", "NIAH 2x"), ("multi_round_niah_recall", "MR-NIAH"),
            ("multi_round_niah_recall_2x", "MR-NIAH 2x")]
    bars += [(f"mc_acc_norm.{metric_key(t)}", f"MC {t}") for t in _mc_tasks(variants, every=False)]
    x = np.arange(len(bars))
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        ax[2].bar(x + (i - (len(variants) - 1) / 2) * width, [v.metrics.get(k, 0.0) or 0.0 for k, _ in bars], width,
                  color=f"C{i}", label=v.name)
    choices = variants[0].report.get("params", {}).get("mc_choices")
    if choices and len(bars) > 4:  # chance level of the built multiple-choice tasks
        ax[2].hlines(1 / choices, 3.5, len(bars) - 0.5, colors="k", linestyles=":", label=f"chance (1/{choices})")
    ax[2].set_xticks(x, [label for _, label in bars], rotation=30, ha="right")
    ax[2].set(ylim=(0, 1), ylabel="accuracy / recall / acc_norm", title="retrieval and multiple choice")
    ax[2].legend(fontsize=8)
    return ctx.log_figure(fig, PLOT_NAME)


# --- the stage ----------------------------------------------------------------------------------------------------
def compare(variants: list[Variant], params: CompareParams) -> dict[str, Any]:
    """The comparison of loaded variants: raises on an unfair one unless ``allow_unfair``."""
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"compare: two checkpoints come from pretrain stages of the same name ({names}; a cached "
                         "artifact keeps the name of the stage that first produced it): their columns and metrics would "
                         "collide; give the variants' pretrain stages distinct names")
    problems = fairness_problems(variants, params.varied)
    if problems and not params.allow_unfair:
        raise ValueError("compare: the variants differ in more than " + ", ".join(params.varied) + " — the "
                         "comparison would be unfair:\n  - " + "\n  - ".join(problems) +
                         "\nBind every variant to the same data stages and give them the same pretrain/eval params "
                         "(or set allow_unfair: true on the compare stage to compare anyway, with a warning)")
    table = rows(variants, params.varied)
    power = power_analysis(variants, params.alpha, params.power)
    return {
        "variants": [{"name": v.name, "attention_pattern": v.pattern, "pattern": describe_pattern(v.pattern),
                      "checkpoint": v.pretrain.get("digest"), "eval_report": v.eval_manifest.get("digest"),
                      "metrics": {k: vals[i] for k, _, vals in table if k}} for i, v in enumerate(variants)],
        "table": [{"metric": k, "label": label, "values": dict(zip([v.name for v in variants], vals, strict=True))}
                  for k, label, vals in table],
        "power_analysis": power, "fair": not problems, "fairness_problems": problems,
        "markdown": render_markdown(variants, table, power, problems, params.alpha, params.power),
    }


def run(params: CompareParams, ctx: StageContext) -> None:
    pairs = pair_reports(ctx.input_list("reports"), ctx.input_list("checkpoints"))
    variants = [load_variant(r, c) for r, c in pairs]
    result = compare(variants, params)
    if result["fairness_problems"]:
        for p in result["fairness_problems"]:
            ctx.progress(f"WARNING: UNFAIR COMPARISON: {p}")
        ctx.set_tags({"hylight.unfair_comparison": "true"})
    markdown = result.pop("markdown")
    write_strict_json(ctx.out_dir / COMPARISON_JSON, result)
    write_text_atomic(ctx.out_dir / COMPARISON_MD, markdown)
    _plot(ctx, variants)
    ctx.log_artifact(ctx.out_dir / COMPARISON_JSON, "comparison")
    ctx.log_artifact(ctx.out_dir / COMPARISON_MD, "comparison")
    ctx.log_summary({f"{metric_key(v['name'])}.{k}": float(x) for v in result["variants"]
                     for k, x in v["metrics"].items() if x is not None and math.isfinite(float(x))})
    ctx.set_rows("variants", len(variants))
    ctx.progress("\n" + markdown)


STAGE = StageKind(
    name="compare",
    params=CompareParams,
    run=run,
    produces=COMPARISON_TYPE,
    inputs={
        "reports": InputSpec(EVAL_REPORT_TYPE, many=True, doc="one eval report per variant"),
        "checkpoints": InputSpec(CHECKPOINT_TYPE, many=True, doc="the pretrain checkpoints those reports evaluated"),
    },
    doc="Side-by-side comparison of pretrained-and-evaluated variants (the §2.2.2.3 / Figure 7 attention ablation): "
        "attention pattern, parameters, tokens, train and held-out loss, loss by position, NIAH, multi-round NIAH, "
        "multiple-choice acc_norm and log acc_norm² per task, and the power analysis of each observed gap; refuses "
        "variants trained on different data, token budgets or settings (allow_unfair to warn instead). Writes "
        "comparison.json, comparison.md and plots/comparison.png; logs <variant>.<metric>.",
)

