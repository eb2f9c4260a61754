"""What `hylight ui` prepares in the tracking store so that the MLflow UI opens on the stage runs.

MLflow 3.17's UI has two modes, "GenAI" (traces, an overview of token usage, an assistant) and "Model
training" (the runs table). Which one an experiment page opens in is decided by the ``workflowType``
URL parameter, else by the browser's last choice of the sidebar toggle (default: GenAI); the
``mlflow.experimentKind`` experiment tag, which earlier MLflow 3 releases read, is not what decides it
in 3.17. So hylight does both: its experiments carry the tag (``tracking.ensure_experiment``), and the
URL `hylight ui` prints names the mode.

The columns of the runs table come from the UI state; a state can be stored in the experiment as the tag
``mlflow.sharedViewState.<key>`` and opened with ``?viewStateShareKey=<key>`` (MLflow's "share view").
hylight stores one whose columns are the headline metrics of the stage kinds in the experiment.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlencode

from pipeline import tracking

VIEW_KEY = "hylight"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"

# The metrics that say how a stage of each built-in kind went (all are in its summary). A kind missing
# here (``compare``, whose metrics are named after its variants; plugin kinds) contributes the first key
# of its summary.
HEADLINE_METRICS: dict[str, tuple[str, ...]] = {
    "ingest": ("ingested", "quarantined"),
    "clean": ("kept",),
    "dedup": ("kept",),
    "quality": ("heldout_category_accuracy",),
    "mix": ("tokens",),
    "tokenizer": ("bytes_per_token",),
    "pretrain": ("loss", "eval_loss"),
    "long_context": ("loss", "eval_loss"),
    "eval": ("niah_accuracy", "eval_pass_rate"),
    "prompts": ("prompts_kept",),
    "reward_model": ("eval_preference_accuracy",),
    "sft": ("loss", "eval_pass_rate"),
    "dpo": ("loss", "eval_pass_rate"),
    "grpo": ("reward_mean", "eval_pass_rate"),
}


def metric_column(name: str) -> str:
    """The runs table's id of a metric column (the UI's canonical sort key)."""
    return f"metrics.`{name}`"


def headline_columns(stage_runs: list[tuple[str, list[str]]]) -> list[str]:
    """Metric columns for stage runs given as (kind, summary keys), in order of first appearance."""
    names: dict[str, None] = {}
    for kind, summary_keys in stage_runs:
        for m in HEADLINE_METRICS.get(kind, tuple(summary_keys[:1])):
            names.setdefault(m)
    return [metric_column(m) for m in names]


def stage_runs_of(c: Any, experiment_id: str, max_runs: int = 1000) -> list[tuple[str, list[str]]]:
    """(kind, summary keys) of the experiment's newest hylight stage runs, oldest first."""
    runs = tracking.retry(c.search_runs, [experiment_id], filter_string=f"tags.`{tracking.TAG_KIND}` != ''",
                          order_by=["attributes.start_time DESC"], max_results=max_runs)
    return [(r.data.tags[tracking.TAG_KIND], json.loads(r.data.tags.get("hylight.summary_keys", "[]")))
            for r in reversed(runs)]


def prepare_experiment(c: Any, experiment_id: str) -> list[str]:
    """Mark the experiment as model training (if it has no kind yet) and store the runs-table view with
    the headline metric columns. Returns those columns."""
    exp = tracking.retry(c.get_experiment, experiment_id)
    if tracking.TAG_EXPERIMENT_KIND not in exp.tags:
        tracking.retry(c.set_experiment_tag, experiment_id, tracking.TAG_EXPERIMENT_KIND,
                       tracking.EXPERIMENT_KIND_TRAINING)
    columns = headline_columns(stage_runs_of(c, experiment_id))
    tracking.retry(c.set_experiment_tag, experiment_id, VIEW_TAG, json.dumps({"selectedColumns": columns}))
    return columns


def runs_url(base: str, experiment_id: str, with_view: bool = True) -> str:
    """The experiment's runs table in "Model training" mode, with hylight's columns if its view is stored."""
    query = urlencode({"workflowType": "machine_learning", **({"viewStateShareKey": VIEW_KEY} if with_view else {})})
    return f"{base}/#/experiments/{experiment_id}/runs?{query}"


def hylight_experiments(c: Any, name: str | None) -> list[str]:
    """Ids of the experiment named ``name``, or (no name) of every experiment holding a hylight run."""
    if name is not None:
        exp = tracking.retry(c.get_experiment_by_name, name)
        return [exp.experiment_id] if exp is not None else []
    found = []
    for exp in tracking.retry(c.search_experiments):
        if tracking.retry(c.search_runs, [exp.experiment_id], filter_string=f"tags.`{tracking.TAG_SPEC}` != ''",
                          max_results=1):
            found.append(exp.experiment_id)
    return found
