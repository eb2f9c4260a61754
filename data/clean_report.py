"""Stage ``clean``'s accounting and report: every document kept or dropped by one step (checked per step and per
domain), ``clean_report.json`` with its keep-rate table, the dropped samples, the run's metrics and its plot."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from data.clean_params import FORMATTERS, CleanParams
from data.clean_pipeline import CleanTally, DomainTally, Pipeline, StepTally
from data.documents import write_jsonl_gz
from pipeline.stage import metric_key

REPORT_NAME = "clean_report.json"
SAMPLES_DIR = "dropped_samples"
PLOT_NAME = "drops_per_domain.png"


def build_report(params: CleanParams, pipeline: Pipeline, merged: CleanTally) -> dict[str, Any]:
    """The content of ``clean_report.json``: no timings, so the artifact's bytes depend only on input and params."""
    tallies, domains, reasons, samples = merged.tallies, merged.domains, merged.reasons, merged.samples
    n_in = sum(d.docs for d in domains.values())
    kept = sum(d.kept for d in domains.values())
    dropped = sum(reasons.values())
    chars_in = sum(d.chars_in for d in domains.values())
    chars_kept = sum(d.chars_kept for d in domains.values())
    report = {
        "in": n_in, "kept": kept, "dropped": dropped,
        "dropped_by_reason": dict(sorted(reasons.items())),
        "steps": {name: {"in": t.applied + t.skipped, "applied": t.applied, "skipped": t.skipped,
                         "kept": t.applied + t.skipped - t.dropped, "dropped": t.dropped,
                         "modified": t.modified}
                  for name, t in tallies.items()},
        "domains": {name: {"in": d.docs, "kept": d.kept, "dropped": d.docs - d.kept,
                           "keep_rate": round(d.kept / d.docs, 4),
                           "dropped_by_step": dict(sorted(d.dropped.items())),
                           "chars_in": d.chars_in, "chars_kept": d.chars_kept,
                           "profile": params.profile(name),
                           "skipped_steps": [n for n, s in pipeline.plan(name) if s is None],
                           "overrides": params.overrides(name)}
                    for name, d in sorted(domains.items())},
        "chars_in": chars_in, "chars_kept": chars_kept,
        "word_tokenizer": params.word_tokenizer,
        "language_model": str(pipeline.lid_path) if pipeline.lid_path else None,
        "samples_dir": SAMPLES_DIR,
        "sampled_per_reason": {r: len(v) for r, v in sorted(samples.items())},
    }  # no timings here: the artifact's bytes depend only on input and params (timings go to metrics)
    report["keep_rate_table"] = keep_rate_table(report["domains"])
    return report


def stage_metrics(merged: CleanTally, seconds: float) -> dict[str, float]:
    """The run's metrics: drops per reason, each step's drops, edits and seconds, each domain's counts, and
    throughput over ``seconds`` (wall, shards and merge)."""
    tallies, domains, reasons = merged.tallies, merged.domains, merged.reasons
    n_in = sum(d.docs for d in domains.values())
    chars_in = sum(d.chars_in for d in domains.values())
    chars_kept = sum(d.chars_kept for d in domains.values())
    metrics: dict[str, float] = {f"dropped.{metric_key(r)}": n for r, n in reasons.items()}
    for name, t in tallies.items():
        metrics |= {f"step.{name}.dropped": t.dropped, f"step.{name}.modified": t.modified,
                    f"step.{name}.seconds": t.seconds}
    for name, d in domains.items():
        key = metric_key(name)
        metrics |= {f"domain.{key}.in": d.docs, f"domain.{key}.kept": d.kept,
                    f"domain.{key}.dropped": d.docs - d.kept, f"domain.{key}.keep_rate": d.kept / d.docs}
        metrics |= {f"domain.{key}.dropped.{step}": n for step, n in d.dropped.items()}
    metrics |= {"docs_per_s": n_in / seconds if seconds else 0.0,
                "mb_per_s": sum(d.bytes_in for d in domains.values()) / 1e6 / seconds if seconds else 0.0,
                "chars_kept_fraction": chars_kept / chars_in if chars_in else 0.0}
    return metrics


def keep_rate_table(domains: dict[str, dict[str, Any]]) -> list[str]:
    """The report's per-domain keep rates as Markdown table lines: domain, documents in, kept, keep rate,
    the profile that applied (the domain's own entries or '*'), and the step that dropped the most."""
    lines = ["| domain | in | kept | keep rate | profile | most drops by |", "| --- | ---: | ---: | ---: | --- | --- |"]
    for name, d in domains.items():
        worst = max(d["dropped_by_step"].items(), key=lambda kv: (kv[1], kv[0]), default=None)
        lines.append(f"| {name} | {d['in']} | {d['kept']} | {d['keep_rate']:.1%} | {d['profile']} | "
                     f"{f'{worst[0]} ({worst[1]})' if worst else '-'} |")
    return lines


def check_accounting(n_in: int, kept: int, written: int, reasons: Counter[str],
                      tallies: dict[str, StepTally], domains: dict[str, DomainTally]) -> None:
    dropped = sum(reasons.values())
    if n_in != kept + dropped or kept != written:
        raise RuntimeError(f"clean accounting is off: in {n_in} != kept {kept} (written {written}) + dropped "
                           f"{dropped} (a bug in data/clean.py)")
    reaching = n_in  # documents that reach each step in turn
    for name, t in tallies.items():
        by_reason = sum(n for r, n in reasons.items() if r.split(".", 1)[0] == name)
        if t.applied + t.skipped != reaching or t.dropped != by_reason:
            raise RuntimeError(f"clean accounting is off at step {name}: {t.applied} applied + {t.skipped} "
                               f"skipped != {reaching} reaching it, or dropped {t.dropped} != {by_reason} by "
                               "reason (a bug in data/clean.py)")
        reaching -= t.dropped
    if reaching != kept:
        raise RuntimeError(f"clean accounting is off: {reaching} passed every step but {kept} were kept")
    for name, d in domains.items():
        if d.docs != d.kept + sum(d.dropped.values()):
            raise RuntimeError(f"clean accounting is off for domain {name!r}: in {d.docs} != kept {d.kept} "
                               f"+ dropped {sum(d.dropped.values())}")


def write_samples(directory: Path, samples: dict[str, list[dict[str, Any]]]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for reason, docs in sorted(samples.items()):
        write_jsonl_gz(directory / f"{reason}.jsonl.gz", docs)


def drops_figure(domains: dict[str, DomainTally], step_names: list[str]) -> Any:
    from matplotlib.figure import Figure  # no pyplot: no global backend state in a worker

    names = sorted(domains)
    fig = Figure(figsize=(max(5.0, 0.9 * len(names) + 3), 4.0))
    ax = fig.add_subplot()
    bottom = [domains[n].kept for n in names]
    ax.bar(names, bottom, color="lightgray", edgecolor="gray", label="kept")
    colors = iter(["tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:blue"])
    for step in (s for s in step_names if s not in FORMATTERS):  # formatters never drop
        counts = [domains[n].dropped.get(step, 0) for n in names]
        color = next(colors, "tab:olive")  # one color per step, used or not: the same step, the same color
        if any(counts):
            ax.bar(names, counts, bottom=bottom, color=color, label=f"dropped: {step}")
            bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
    ax.set_ylim(0, max(bottom) * 1.08)
    ax.set_ylabel("documents")
    ax.set_title("clean: kept and dropped documents per domain, by the step that dropped them", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.tick_params(axis="x", labelrotation=45)
    return fig

