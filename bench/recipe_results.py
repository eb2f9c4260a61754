"""The GPU recipe's results in one Markdown file, from a run's `hylight run --json` report and its artifacts: the
stage table (when each stage's body started, how long it took, on which GPU, its headline numbers), how many GPUs
were busy when, the copy curriculum's probe curve and the MoE drop rate, NIAH after pretraining and after
long_context, the ablation table (`compare`'s comparison.md), and the post-training pass rates with 95% Wilson
intervals, per task, each post-training eval against the eval of the checkpoint its stage started from prompt by
prompt (wrong -> right, right -> wrong, exact McNemar p), and DPO's held-out preference accuracy.

    python bench/recipe_results.py REPORT_JSON [--out results.md]
    python bench/recipe_results.py --root ARTIFACT_ROOT [--out results.md]   # a run stopped before its report:
                                                          # the finished stages, from their artifacts' manifests
    python bench/recipe_results.py REPORT_JSON --plot pass_rates.png          # also the pass rates as bars: each
                                                          # eval's rate per task and overall, overall's 95% interval

Run by bench/run_gpu_dag.sh at the end of every call (a stage that has not finished is listed as such); works on
the CPU rehearsal's report too (bench/gpu_recipe_cpu.py --json).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
# the stages whose eval_pass_rate is post-training's, in the recipe's order, and the checkpoint each evaluates
PASS_RATE_EVALS = ("eval", "eval_long_context", "eval_sft_short", "eval_sft_long", "eval_dpo_short", "eval_dpo_long",
                   "eval_grpo")
HEADLINE = ("eval_loss", "unigram_loss", "drop_rate", "niah_accuracy", "niah_accuracy_2x", "copy_accuracy",
            "eval_pass_rate", "eval_pass_rate_before", "eval_preference_accuracy", "tokens", "steps")


def wilson(k: float, n: float, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of k successes in n trials."""
    if n <= 0:
        return (math.nan, math.nan)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


@functools.cache  # read once a run: the pairing looks each stage's up many times
def _manifest(artifact: str | None) -> dict[str, Any]:
    if not artifact or not (Path(artifact) / MANIFEST).is_file():
        return {}
    return json.loads((Path(artifact) / MANIFEST).read_text())


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:,.0f}"
    return str(v)


def stage_table(stages: dict[str, dict[str, Any]]) -> tuple[list[str], list[tuple[float, float, str]]]:
    """The table's lines and each finished stage's (start, end, gpus) in seconds after the first start."""
    placed = {}
    for name, r in stages.items():
        m = _manifest(r.get("artifact"))
        if r.get("state") == "done" and "started_unix" in m:
            placed[name] = (m["started_unix"], m["started_unix"] + m.get("seconds", r.get("seconds") or 0),
                            m.get("gpus", ""))
    t0 = min((s for s, _, _ in placed.values()), default=0.0)
    lines = ["| stage | state | started (s) | seconds | GPU | headline |", "|---|---|---:|---:|---|---|"]
    order = sorted(stages, key=lambda n: (placed[n][0] if n in placed else math.inf, n))
    for name in order:
        r = stages[name]
        s = r.get("summary") or {}
        head = " ".join(f"{k}={_fmt(s[k])}" for k in HEADLINE if k in s)
        start = f"{placed[name][0] - t0:.0f}" if name in placed else "-"
        secs = f"{r['seconds']:.1f}" if r.get("seconds") is not None else "-"
        gpu = placed[name][2] if name in placed else ""
        why = r.get("error") or r.get("reason") or ""
        state = r.get("state", "?") + (f" (attempt {r['attempts']})" if (r.get("attempts") or 0) > 1 else "")
        failed = r.get("attempt_errors") or []
        retried = f"retried after: {failed[-1][:100]}" if failed and r.get("state") != "failed" else ""
        cell = " · ".join(x for x in (head, retried) if x) or why[:120]
        lines.append(f"| {name} | {state} | {start} | {secs} | {gpu or '-'} | {cell} |")
    spans = [(a - t0, b - t0, g) for a, b, g in placed.values()]
    return lines, spans


def gpu_busy(spans: list[tuple[float, float, str]]) -> list[str]:
    """How many GPUs the finished stages held, between each change."""
    events = []
    for a, b, g in spans:
        n = len([x for x in g.split(",") if x.strip()])
        if n:
            events += [(a, n), (b, -n)]
    if not events:
        return ["No finished GPU stage recorded its GPUs."]
    events.sort()
    busy, last, lines, peak = 0, events[0][0], [], 0
    for t, d in events:
        if t > last and busy:
            lines.append(f"- {last:.0f}–{t:.0f} s: {busy} GPU(s) busy")
        busy += d
        peak = max(peak, busy)
        last = t
    return [f"At most {peak} GPU(s) busy at once (finished stages only).", *lines]


def probe_curve(stages: dict[str, dict[str, Any]], name: str) -> list[str]:
    art = (stages.get(name) or {}).get("artifact")
    log = Path(art) / "train_log.jsonl" if art else None
    if not log or not log.is_file():
        return [f"`{name}`: no train log."]
    rows = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    probed = [r for r in rows if "copy_accuracy" in r]
    out = [f"`{name}`: {len(rows)} logged steps; probe at {len(probed)} of them.", "",
           "| step | tokens | loss | copy accuracy | copy loss gain | NIAH forced choice | drop rate |",
           "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in probed:
        out.append(f"| {r['step']} | {r.get('tokens', 0):,} | {r['loss']:.3f} | {r['copy_accuracy']:.3f} | "
                   f"{r.get('copy_loss_gain', math.nan):.2f} | {r.get('niah_choice_accuracy', math.nan):.2f} | "
                   f"{r.get('drop_rate', math.nan):.1%} |")
    return out


def post_training_evals(stages: dict[str, dict[str, Any]]) -> list[str]:
    """The recipe's pass-rate evals in its order, then the eval of every other post-training stage (a branch such as
    `sft_more`: a stage whose summary has `eval_pass_rate_before`), by name."""
    extra = sorted(n for n in stages if n.startswith("eval_") and n not in PASS_RATE_EVALS
                   and "eval_pass_rate_before" in ((stages.get(n[len("eval_"):]) or {}).get("summary") or {}))
    return [*PASS_RATE_EVALS, *extra]


def pass_rates(stages: dict[str, dict[str, Any]]) -> list[str]:
    out = ["| eval of | eval_pass_rate | 95% CI | prompts | per task |", "|---|---:|---|---:|---|"]
    for name in post_training_evals(stages):
        s = (stages.get(name) or {}).get("summary") or {}
        if "eval_pass_rate" not in s:
            continue
        n = s.get("eval_pass_prompts", 0)
        lo, hi = wilson(s["eval_pass_rate"] * n, n)
        tasks = " ".join(f"{k.split('.', 1)[1]}={v:.3f}" for k, v in s.items() if k.startswith("eval_pass_rate."))
        out.append(f"| {name} | {s['eval_pass_rate']:.3f} | [{lo:.3f}, {hi:.3f}] | {n:.0f} | {tasks} |")
    for name in ("reward_model", "dpo_short", "dpo_long"):
        s = (stages.get(name) or {}).get("summary") or {}
        if "eval_preference_accuracy" in s:
            held = s.get("dpo_pairs_heldout")
            on = f" on {held:.0f} held-out pairs" if held is not None else ""
            out.append(f"\n`{name}` held-out preference accuracy {s['eval_preference_accuracy']:.3f}{on} (untrained "
                       f"{s.get('eval_preference_accuracy_untrained', math.nan):.3f})")
    return out


def _checkpoint_of(stages: dict[str, dict[str, Any]], name: str) -> str | None:
    """The stage whose artifact ``name`` read as its checkpoint (matched by digest in ``name``'s manifest), or None."""
    manifest = _manifest((stages.get(name) or {}).get("artifact"))
    wanted = set(((manifest.get("key_material") or {}).get("inputs") or {}).get("checkpoint") or [])
    for other, s in stages.items():
        if other != name and wanted and (s.get("digest") or _manifest(s.get("artifact")).get("digest")) in wanted:
            return other
    return None


def _prompts_of(stages: dict[str, dict[str, Any]], name: str) -> list[str]:
    """The digests of the prompts artifact an eval read (its manifest's key material)."""
    manifest = _manifest((stages.get(name) or {}).get("artifact"))
    return ((manifest.get("key_material") or {}).get("inputs") or {}).get("prompts") or []


def _graded(stages: dict[str, dict[str, Any]], name: str) -> dict[str, bool]:
    """An eval's verdict per held-out prompt id (its ``pass_rate.jsonl``), or {} where it has none."""
    artifact = (stages.get(name) or {}).get("artifact")
    path = Path(artifact) / "pass_rate.jsonl" if artifact else None
    if path is None or not path.is_file():
        return {}
    return {r["id"]: bool(r["correct"]) for r in (json.loads(line) for line in path.read_text().splitlines() if line)}


def mcnemar_p(gained: int, lost: int) -> float:
    """Exact two-sided McNemar p-value of ``gained`` prompts wrong -> right against ``lost`` right -> wrong (under no
    change each discordant prompt goes either way with probability 1/2)."""
    n = gained + lost
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(min(gained, lost) + 1)) / 2 ** n)


def paired_gains(stages: dict[str, dict[str, Any]]) -> list[str]:
    """Each post-training eval against the eval of the checkpoint its stage started from, prompt by prompt: the
    intervals of two pass rates on the same prompts overlap long before a paired difference is noise."""
    evals = [n for n in stages if n.startswith("eval")]
    out = ["| eval of | against | prompts | wrong → right | right → wrong | net (points) | McNemar p |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for name in post_training_evals(stages):
        trained = _checkpoint_of(stages, name) if name in stages else None
        start = _checkpoint_of(stages, trained) if trained else None
        # an eval of the start with verdicts, on the same prompts artifact as this eval's where one is
        bases = sorted((e for e in evals if start and e != name and _checkpoint_of(stages, e) == start
                        and _graded(stages, e)), key=lambda e: _prompts_of(stages, e) != _prompts_of(stages, name))
        base = bases[0] if bases else None
        after, before = _graded(stages, name), _graded(stages, base) if base else {}
        both = sorted(set(after) & set(before))
        if not both:
            continue
        gained = sum(after[i] and not before[i] for i in both)
        lost = sum(before[i] and not after[i] for i in both)
        out.append(f"| {name} | {base} | {len(both)} | {gained} | {lost} | {100 * (gained - lost) / len(both):+.1f} | "
                   f"{mcnemar_p(gained, lost):.3g} |")
    return out if len(out) > 2 else ["(no post-training eval with the eval of its starting checkpoint in this run)"]


def pass_rate_plot(stages: dict[str, dict[str, Any]], path: Path) -> dict[str, dict[str, float]]:
    """Grouped bars: each post-training eval's pass rate per task and overall (with its 95% Wilson interval), in the
    recipe's order. Returns what it drew: {eval: {task or "all": rate}}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn: dict[str, dict[str, float]] = {}
    for name in post_training_evals(stages):
        s = (stages.get(name) or {}).get("summary") or {}
        if "eval_pass_rate" in s:
            drawn[name] = {"all": s["eval_pass_rate"], **{k.split(".", 1)[1]: v for k, v in s.items()
                                                          if k.startswith("eval_pass_rate.")}}
    if not drawn:
        raise ValueError("no post-training eval with an eval_pass_rate in this report")
    groups = ["all", *sorted({t for d in drawn.values() for t in d} - {"all"})]
    width = 0.8 / len(drawn)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.6 * len(groups) + 0.25 * len(drawn)), 4.2))
    for i, (name, rates) in enumerate(drawn.items()):
        xs = [g + (i - (len(drawn) - 1) / 2) * width for g in range(len(groups))]
        label = "pretrain" if name == "eval" else name.removeprefix("eval_")
        ax.bar(xs, [rates.get(t, math.nan) for t in groups], width, label=label)
        n = (stages[name].get("summary") or {}).get("eval_pass_prompts", 0)
        if n:
            lo, hi = wilson(rates["all"] * n, n)  # may miss a rate of 0 or 1 by a rounding error: clamped
            ax.errorbar(xs[0], rates["all"], yerr=[[max(0.0, rates["all"] - lo)], [max(0.0, hi - rates["all"])]],
                        color="black", capsize=2, linewidth=0.8)
    ax.set_xticks(range(len(groups)), [f"{g} (95% CI)" if g == "all" else g for g in groups])
    ax.set_ylabel("eval_pass_rate (greedy, held-out prompts)")
    ax.set_ylim(0, max(0.1, 1.15 * max(v for d in drawn.values() for v in d.values())))
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("pass rate after each stage, per task")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def niah(stages: dict[str, dict[str, Any]]) -> list[str]:
    keys = ("niah_accuracy", "niah_accuracy_2x", "niah_prefix_digits", "niah_chat_accuracy", "multi_round_niah_recall",
            "multi_round_niah_recall_2x", "niah_choice_accuracy", "copy_accuracy", "copy_loss_gain")
    out = ["| eval | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
    post = post_training_evals(stages)
    evals = [n for n in ("eval", "eval_long_context") if n in stages] + sorted(
        n for n in stages if n.startswith("eval_") and n != "eval_long_context" and n not in post)
    for name in evals:  # after pretraining and long_context, and each ablation branch's eval
        s = (stages.get(name) or {}).get("summary") or {}
        if s:
            out.append(f"| {name} | " + " | ".join(_fmt(s.get(k, math.nan)) for k in keys) + " |")
    return out


def post_training_niah(stages: dict[str, dict[str, Any]]) -> list[str]:
    """NIAH at the trained length and twice it after each post-training stage: the plain prompt's exact match, the
    chat template's (``niah_chat``), and the forced choice."""
    keys = ("niah_accuracy", "niah_chat_accuracy", "niah_accuracy_2x", "niah_chat_accuracy_2x", "niah_choice_accuracy")
    out = ["| eval of | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
    for name in post_training_evals(stages):
        s = (stages.get(name) or {}).get("summary") or {}
        if "niah_accuracy" in s:
            out.append(f"| {name} | " + " | ".join(_fmt(s.get(k, math.nan)) for k in keys) + " |")
    return out


def _eval_niah(stages: dict[str, dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(eval stage, the "niah" section of its artifact's report.json) for every eval stage that has one."""
    found = []
    for name, r in stages.items():
        art = r.get("artifact")
        path = Path(art) / "report.json" if art else None
        if not name.startswith("eval") or path is None or not path.is_file():
            continue
        try:
            niah = json.loads(path.read_text())["niah"]
        except (ValueError, KeyError, TypeError):
            continue  # not an eval report with a NIAH section
        if isinstance(niah, dict):
            found.append((name, niah))
    return found


def niah_by_depth(stages: dict[str, dict[str, Any]]) -> list[str]:
    """NIAH accuracy by needle depth (0: the needle in the first sentence; 1: next to the question), one row per
    eval and context length, from each eval artifact's report.json (the heat maps' numbers)."""
    out = ["| eval | length | accuracy by needle depth (depth: accuracy) |", "|---|---:|---|"]
    for name, grid in _eval_niah(stages):
        try:
            rows = [(d, row) for d, row in zip(grid["depths"], grid["accuracy"], strict=True)]
            lengths = grid["lengths"]
        except (KeyError, TypeError, ValueError):
            continue  # no NIAH grid
        for j, length in enumerate(lengths):
            out.append(f"| {name} | {length:,} | " + " · ".join(f"{d:g}: {row[j]:.2f}" for d, row in rows) + " |")
    return out


def niah_answer_kinds(stages: dict[str, dict[str, Any]]) -> list[str]:
    """Each eval's NIAH answers by kind and length (``evaluation.metrics.niah_answer_kind``): correct, a wrong copy of
    the needle, another number, or text (the haystack went on), from its report.json (evals before the kinds were
    recorded are left out)."""
    kinds = ("correct", "near_copy", "other_number", "text")  # evaluation.metrics.NIAH_ANSWER_KINDS (this script
    # runs on the lent machine without the project on its path)
    out = ["| eval | length | " + " | ".join(kinds) + " |", "|---|---:|" + "---:|" * len(kinds)]
    for name, niah in _eval_niah(stages):
        for length, counts in (niah.get("answer_kinds_by_length") or {}).items():
            out.append(f"| {name} | {int(length):,} | " + " | ".join(str(counts.get(k, 0)) for k in kinds) + " |")
    return out


def niah_misses(stages: dict[str, dict[str, Any]]) -> list[str]:
    """Why the wrong NIAH answers are wrong, per eval and length, from each report's trials: how many of them the
    forced choice still got right (the needle's number scored above every other number: the model found the needle
    and answered with something else), and the needle's whole number's log-likelihood at the cue, median over the
    right and over the wrong answers (the thirteenth lease: about -0.9 against -3.6 at 8K), and the same medians of
    the probability that the answer begins with a number at all (the eval's ``number_start_prob``; "-" in reports
    from before it)."""
    out = ["| eval | length | wrong | of them, forced choice right | needle's log-likelihood, median: right / wrong "
           "| p(the answer starts with a number), median: right / wrong |", "|---|---:|---:|---:|---|---|"]
    for name, niah in _eval_niah(stages):
        trials = [t for t in niah.get("trials") or [] if isinstance(t, dict) and "answer_loglik" in t]
        for length in sorted({t["length"] for t in trials}):
            rows = [t for t in trials if t["length"] == length]
            right = [t["answer_loglik"] for t in rows if t.get("correct")]
            wrong = [t for t in rows if not t.get("correct")]
            ll = " / ".join(f"{statistics.median(x):.2f}" if x else "-" for x in (right, [t["answer_loglik"] for t in wrong]))
            mass = " / ".join(
                f"{statistics.median(x):.2f}" if x else "-"
                for x in ([t["number_start_prob"] for t in rows if t.get("correct") and "number_start_prob" in t],
                          [t["number_start_prob"] for t in wrong if "number_start_prob" in t]))
            out.append(f"| {name} | {int(length):,} | {len(wrong)} of {len(rows)} | "
                       f"{sum(bool(t.get('choice_correct')) for t in wrong)} | {ll} | {mass} |")
    return out


def niah_paired(stages: dict[str, dict[str, Any]], against: str = "eval_long_context") -> list[str]:
    """Each eval's NIAH against ``against``'s trial by trial, where the two asked the same needles (the eval draws
    them from one seeded stream, so evals with the same lengths, depths and trial counts do): per length, needles
    gained (wrong there, right here) and lost, and the exact McNemar p."""
    out = ["| eval | against | length | needles | gained | lost | McNemar p |", "|---|---|---:|---:|---:|---:|---:|"]
    found = dict(_eval_niah(stages))
    if against not in found:
        return out

    def key(t: dict[str, Any]) -> tuple[Any, ...]:
        return t.get("length"), t.get("depth"), t.get("city"), t.get("number")

    base = {key(t): bool(t.get("correct")) for t in found[against].get("trials") or [] if isinstance(t, dict)}
    for name, niah in found.items():
        trials = [t for t in niah.get("trials") or [] if isinstance(t, dict)]
        if name == against or not trials or any(key(t) not in base for t in trials):
            continue  # not the same needles
        for length in sorted({t["length"] for t in trials}):
            rows = [t for t in trials if t["length"] == length]
            gained = sum(bool(t.get("correct")) and not base[key(t)] for t in rows)
            lost = sum(base[key(t)] and not t.get("correct") for t in rows)
            out.append(f"| {name} | {against} | {int(length):,} | {len(rows)} | {gained} | {lost} | "
                       f"{mcnemar_p(gained, lost):.3g} |")
    return out


def report_from_root(root: Path) -> dict[str, Any]:
    """A report of the finished stages under an artifact root (the newest artifact a stage name committed), for a
    run that was stopped before it wrote its own."""
    stages: dict[str, dict[str, Any]] = {}
    for m in sorted((root / "artifacts").glob(f"*/*/{MANIFEST}"), key=lambda p: p.stat().st_mtime):
        meta = json.loads(m.read_text())
        name = meta.get("stage")
        if name:
            stages[name] = {"name": name, "state": "done", "artifact": str(m.parent), "seconds": meta.get("seconds"),
                            "summary": meta.get("summary") or {}}
    return {"stages": stages}


def results(report: dict[str, Any]) -> str:
    stages = report.get("stages", {})
    table, spans = stage_table(stages)
    parts = ["# GPU recipe: results", "", f"{sum(r.get('state') in ('done', 'cached') for r in stages.values())} of "
             f"{len(stages)} stages done or cached.", "", "## Stages", "", *table, "", "## GPUs busy", "",
             *gpu_busy(spans), "", "## Pretraining: the copy curriculum's probe", ""]
    for name in sorted(n for n in stages if n.startswith("pretrain")):  # the hybrid's, then each ablation branch's
        parts += [f"### {name}", "", *probe_curve(stages, name), ""]
    parts += ["## NIAH and copying", "", *niah(stages), "", "### NIAH by needle depth", "", *niah_by_depth(stages),
              "", "### NIAH answers by kind", "", *niah_answer_kinds(stages), "",
              "### NIAH's wrong answers: found and not answered?", "", *niah_misses(stages), "",
              "### NIAH against long_context's, needle by needle", "", *niah_paired(stages), "",
              "## Post-training", "", *pass_rates(stages), "",
              "### Against the starting checkpoint, prompt by prompt", "", *paired_gains(stages), "",
              "### NIAH after each stage", "", *post_training_niah(stages), ""]
    comp = (stages.get("compare") or {}).get("artifact")
    if comp and (Path(comp) / "comparison.md").is_file():
        parts += ["## Ablation (`compare`)", "", (Path(comp) / "comparison.md").read_text()]
    return "\n".join(parts) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report", type=Path, nargs="?")
    ap.add_argument("--root", type=Path, help="an artifact root instead of a report")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path, help="also draw the post-training pass rates (a PNG) here")
    args = ap.parse_args()
    if (args.report is None) == (args.root is None):
        ap.error("give a report or --root")
    report = json.loads(args.report.read_text()) if args.report else report_from_root(args.root)
    if args.plot:
        pass_rate_plot(report.get("stages", {}), args.plot)
    text = results(report)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
