"""MLflow run structure: one parent run per invocation, one nested run per stage.

Default store is embedded: ``sqlite:///<artifact_root>/mlflow.db`` with the experiment's artifact
location set explicitly to ``<artifact_root>/mlflow-artifacts`` (never a cwd-relative ``./mlruns``).
Stage workers log through :class:`MLflowSink`, which batches metrics and retries when sqlite is
briefly locked by a concurrent stage.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from pipeline.stage import MetricSink

log = logging.getLogger("hylight.tracking")

TAG_STAGE = "hylight.stage"
TAG_KIND = "hylight.kind"
TAG_CACHE_HIT = "hylight.cache_hit"
TAG_CACHE_KEY = "hylight.cache_key"
TAG_PRODUCER = "hylight.produced_by_run"
TAG_ARTIFACT_URI = "hylight.artifact_uri"
TAG_ARTIFACT_DIGEST = "hylight.artifact_digest"
TAG_STATE = "hylight.state"
TAG_SPEC = "hylight.spec"
TAG_PARENT = "mlflow.parentRunId"
# MLflow's experiment kind: hylight's experiments hold training runs, not GenAI traces (pipeline/mlflow_ui.py)
TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
EXPERIMENT_KIND_TRAINING = "custom_model_development"


def default_tracking_uri(artifact_root: Path) -> str:
    return f"sqlite:///{Path(artifact_root).absolute() / 'mlflow.db'}"


def artifact_location(artifact_root: Path) -> str:
    return (Path(artifact_root).absolute() / "mlflow-artifacts").as_uri()


def client(tracking_uri: str) -> Any:
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def ensure_experiment(c: Any, name: str, artifact_root: Path, tracking_uri: str) -> str:
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        if TAG_EXPERIMENT_KIND not in exp.tags:  # created before hylight set it; a kind set by hand stays
            c.set_experiment_tag(exp.experiment_id, TAG_EXPERIMENT_KIND, EXPERIMENT_KIND_TRAINING)
        return exp.experiment_id
    # only the embedded store gets an explicit location; a server decides its own
    loc = artifact_location(artifact_root) if tracking_uri.startswith("sqlite:") else None
    try:
        return c.create_experiment(name, artifact_location=loc,
                                   tags={TAG_EXPERIMENT_KIND: EXPERIMENT_KIND_TRAINING})
    except Exception:  # created concurrently
        exp = c.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def retry(fn: Any, *args: Any, attempts: int = 8, **kwargs: Any) -> Any:
    delay = 0.1
    for i in range(attempts):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # sqlite "database is locked" surfaces as MlflowException
            if "locked" not in str(e).lower() or i == attempts - 1:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


_PARAM_KEY = re.compile(r"^[A-Za-z0-9_\-. :/]+$")  # what MLflow accepts in a param name


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested params as dotted keys; a mapping whose keys MLflow cannot name stays one JSON value."""
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and all(_PARAM_KEY.match(str(x)) for x in v):
            out.update(flatten(v, key + "."))
        else:
            out[key] = json.dumps(v, default=str) if isinstance(v, list | dict) else str(v)
    return out


def log_params(c: Any, run_id: str, params: dict[str, Any]) -> None:
    from mlflow.entities import Param

    items = [Param(k, v[:6000]) for k, v in flatten(params).items()]
    for i in range(0, len(items), 100):
        retry(c.log_batch, run_id, params=items[i:i + 100])


def set_tags(c: Any, run_id: str, tags: dict[str, Any]) -> None:
    from mlflow.entities import RunTag

    retry(c.log_batch, run_id, tags=[RunTag(k, str(v)[:5000]) for k, v in tags.items()])


def _log_metric_rows(c: Any, run_id: str, rows: list[tuple[str, float, int | None, int]]) -> None:
    """(name, value, step, timestamp ms) rows, in MLflow's batches of at most 500."""
    from mlflow.entities import Metric

    items = [Metric(k, float(v), ts, step or 0) for k, v, step, ts in rows]
    for i in range(0, len(items), 500):
        retry(c.log_batch, run_id, metrics=items[i:i + 500])


def log_metrics_now(c: Any, run_id: str, metrics: dict[str, float], step: int | None = None) -> None:
    ts = int(time.time() * 1000)
    _log_metric_rows(c, run_id, [(k, v, step, ts) for k, v in metrics.items()])


def log_lineage(c: Any, run_id: str, inputs: dict[str, list[dict[str, Any]]]) -> None:
    """Input artifacts as MLflow dataset inputs (shown as 'Datasets used' in the UI)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    datasets = []
    for role, arts in inputs.items():
        for a in arts:
            ds = Dataset(name=f"{a['stage']}:{a['type']}", digest=a["digest"][:32], source_type="local",
                         source=json.dumps({"uri": Path(a["path"]).as_uri(), "producer_run": a.get("run_id")}))
            datasets.append(DatasetInput(ds, tags=[InputTag("mlflow.data.context", role)]))
    if datasets:
        retry(c.log_inputs, run_id, datasets=datasets)


def start_run(c: Any, experiment_id: str, name: str, tags: dict[str, Any],
              parent_run_id: str | None = None) -> str:
    tags = dict(tags)
    if parent_run_id:
        tags[TAG_PARENT] = parent_run_id
    run = retry(c.create_run, experiment_id, run_name=name, tags={k: str(v) for k, v in tags.items()})
    return run.info.run_id


def end_run(c: Any, run_id: str, status: str = "FINISHED") -> None:
    retry(c.set_terminated, run_id, status=status)


class MLflowSink(MetricSink):
    """Forwards a stage's measurements to its nested MLflow run (batched, retried)."""

    def __init__(self, tracking_uri: str, run_id: str, flush_every_s: float = 5.0) -> None:
        super().__init__()
        self.c = client(tracking_uri)
        self.run_id = run_id
        self.flush_every_s = flush_every_s
        self._pending: list[tuple[str, float, int | None, int]] = []
        self._last_flush = time.monotonic()

    def log_metrics(self, metrics: dict[str, float], step: int | None) -> None:
        super().log_metrics(metrics, step)
        ts = int(time.time() * 1000)
        self._pending.extend((k, float(v), step, ts) for k, v in metrics.items())
        if time.monotonic() - self._last_flush >= self.flush_every_s:
            self.flush()

    def log_artifact(self, path: Path, artifact_path: str | None) -> None:
        super().log_artifact(path, artifact_path)
        retry(self.c.log_artifact, self.run_id, str(path), artifact_path)

    def set_tags(self, tags: dict[str, str]) -> None:
        super().set_tags(tags)
        set_tags(self.c, self.run_id, tags)

    def flush(self) -> None:
        rows, self._pending = self._pending, []
        _log_metric_rows(self.c, self.run_id, rows)
        self._last_flush = time.monotonic()
