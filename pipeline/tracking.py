"""MLflow run structure: one parent run per invocation, one nested run per stage.

Default store is embedded: ``sqlite:///<artifact_root>/mlflow.db`` with the experiment's artifact
location set explicitly to ``<artifact_root>/mlflow-artifacts`` (never a cwd-relative ``./mlruns``).
Stage workers log through :class:`MLflowSink`, which batches metrics and retries when sqlite is
briefly locked by a concurrent stage.

A tracking server that is down: at start, :func:`check_reachable` stops the run before anything starts. Mid-run,
a stage never fails or blocks for it: what it could not send goes to a journal file
``<artifact_root>/tracking-journal/<run_id>.jsonl`` that the driver replays (:func:`replay_journal`) once the
server answers, after the stage and at the start of the next run; the driver's own calls wait up to
``HYLIGHT_TRACKING_WAIT_S`` seconds (default 120) for the server, then stop the run with
:class:`TrackingUnavailable`, whose message names what is left in the journals.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
import urllib.error
import urllib.request
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


JOURNAL_DIR = "tracking-journal"


class TrackingUnavailable(ConnectionError):
    """The MLflow tracking server does not answer (refused, timed out, 5xx)."""


def check_reachable(tracking_uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast, before any stage starts, when an http(s) tracking server does not answer its /health."""
    if not tracking_uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(tracking_uri.rstrip("/") + "/health", timeout=timeout_s):
            return
    except urllib.error.HTTPError as e:  # it answers: a server that has no /health (a proxy) is its own business
        if e.code < 500:
            return
        problem: Exception = e
    except (OSError, ValueError) as e:
        problem = e
    raise TrackingUnavailable(
        f"cannot reach the MLflow tracking server at {tracking_uri}: {problem}. Start it (e.g. `mlflow server "
        "--host 127.0.0.1 --port PORT ...`), or use the embedded store (tracking_uri: null in the spec, no "
        "--tracking-uri). Nothing was run.") from None


def unreachable(e: BaseException) -> bool:
    """Whether an MLflow client error means the server is down or unreachable (not a bad request)."""
    if isinstance(e, TrackingUnavailable | ConnectionError | TimeoutError):
        return True
    text = str(e)
    return any(s in text for s in ("Connection refused", "Max retries exceeded", "Failed to establish",
                                   "RemoteDisconnected", "Connection aborted", "timeout exception",
                                   "Read timed out", "too many 50", "Temporary failure in name resolution"))


def outage_wait_s() -> float:
    return float(os.environ.get("HYLIGHT_TRACKING_WAIT_S", "120"))


# Set once a wait for the server ran out, cleared by the next call that gets through: a driver stopping because
# the server is gone does not wait again for every run it closes on its way out.
_server_down = False


def client(tracking_uri: str) -> Any:
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    # MLflow's own http retries would block one call for ~4 minutes (7 retries, backoff factor 2) when the
    # server is down; outages are handled here instead (retry(), the journal)
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    from mlflow.tracking import MlflowClient  # heavy: mlflow

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


def retry(fn: Any, *args: Any, attempts: int = 8, wait_s: float | None = None, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, retried while sqlite is locked (``attempts`` times) and while the server is
    unreachable (for ``wait_s`` seconds, default :func:`outage_wait_s`; then :class:`TrackingUnavailable`)."""
    global _server_down
    delay, i = 0.1, 0
    deadline = None
    while True:
        try:
            out = fn(*args, **kwargs)
            _server_down = False
            return out
        except Exception as e:  # sqlite "database is locked" surfaces as MlflowException
            if unreachable(e):
                wait = (0.0 if _server_down else outage_wait_s()) if wait_s is None else wait_s
                deadline = deadline if deadline is not None else time.monotonic() + wait
                if time.monotonic() >= deadline:
                    _server_down = True
                    name = getattr(fn, "__name__", "call")
                    raise TrackingUnavailable(f"MLflow tracking server unreachable ({name}, waited {wait:.0f}s): "
                                              f"{str(e).splitlines()[0][:300]}") from e
                log.warning("MLflow tracking server unreachable; retrying until it answers (%.0fs left)",
                            deadline - time.monotonic())
                time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
                continue
            i += 1
            if "locked" not in str(e).lower() or i >= attempts:
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


def log_record(c: Any, run_id: str, params: dict[str, Any] | None = None, tags: dict[str, Any] | None = None,
               metrics: dict[str, float] | None = None, step: int | None = None) -> None:
    """Params (nested ones flattened, :func:`flatten`), tags and metrics in as few ``log_batch`` calls as MLflow's
    limits allow (100 params, 100 tags, 500 metrics a call): one for a stage's usual few dozen, where separate
    calls would cost one database transaction each."""
    from mlflow.entities import Metric, Param, RunTag  # heavy: mlflow

    now_ms = int(time.time() * 1000)
    ps = [Param(k, v[:6000]) for k, v in flatten(params or {}).items()]
    tgs = [RunTag(k, str(v)[:5000]) for k, v in (tags or {}).items()]
    ms = [Metric(k, float(v), now_ms, step or 0) for k, v in (metrics or {}).items()]
    calls = max(math.ceil(len(ps) / 100), math.ceil(len(tgs) / 100), math.ceil(len(ms) / 500))  # 0: nothing to log
    for i in range(calls):
        retry(c.log_batch, run_id, params=ps[i * 100:(i + 1) * 100], tags=tgs[i * 100:(i + 1) * 100],
              metrics=ms[i * 500:(i + 1) * 500])


def log_params(c: Any, run_id: str, params: dict[str, Any]) -> None:
    log_record(c, run_id, params=params)


def set_tags(c: Any, run_id: str, tags: dict[str, Any]) -> None:
    log_record(c, run_id, tags=tags)


def _log_metric_rows(c: Any, run_id: str, rows: list[tuple[str, float, int | None, int]],
                     wait_s: float | None = None) -> None:
    """(name, value, step, timestamp ms) rows, in MLflow's batches of at most 500."""
    from mlflow.entities import Metric  # heavy: mlflow

    items = [Metric(k, float(v), ts, step or 0) for k, v, step, ts in rows]
    for i in range(0, len(items), 500):
        retry(c.log_batch, run_id, metrics=items[i:i + 500], wait_s=wait_s)


def log_metrics_now(c: Any, run_id: str, metrics: dict[str, float], step: int | None = None) -> None:
    log_record(c, run_id, metrics=metrics, step=step)


def log_lineage(c: Any, run_id: str, inputs: dict[str, list[dict[str, Any]]]) -> None:
    """Input artifacts as MLflow dataset inputs (shown as 'Datasets used' in the UI)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag  # heavy: mlflow

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
    """Forwards a stage's measurements to its nested MLflow run (batched, retried). When the server does not
    answer, what could not be sent is appended to the run's journal (``journal_dir/<run_id>.jsonl``) and sent
    later, by this sink or by the driver (:func:`replay_journal`); the stage goes on either way."""

    def __init__(self, tracking_uri: str, run_id: str, flush_every_s: float = 5.0,
                 journal_dir: Path | None = None, retry_down_every_s: float = 10.0,
                 out_dir: Path | None = None) -> None:
        super().__init__()
        self.c = client(tracking_uri)
        self.run_id = run_id
        self.flush_every_s = flush_every_s
        self.journal = Path(journal_dir) / f"{run_id}.jsonl" if journal_dir else None
        self.out_dir = out_dir  # the stage's output dir: artifacts under it are journaled relative to it
        self.retry_down_every_s = retry_down_every_s
        self._pending: list[tuple[str, float, int | None, int]] = []
        self._last_flush = time.monotonic()
        self._down_since: float | None = None

    def log_metrics(self, metrics: dict[str, float], step: int | None) -> None:
        super().log_metrics(metrics, step)
        ts = int(time.time() * 1000)
        self._pending.extend((k, float(v), step, ts) for k, v in metrics.items())
        if time.monotonic() - self._last_flush >= self.flush_every_s:
            self.flush()

    def log_artifact(self, path: Path, artifact_path: str | None) -> None:
        super().log_artifact(path, artifact_path)
        self._send({"artifact": self._artifact_ref(Path(path)), "artifact_path": artifact_path})

    def set_tags(self, tags: dict[str, str]) -> None:
        super().set_tags(tags)
        self._send({"tags": tags})

    def flush(self) -> None:
        rows, self._pending = self._pending, []
        self._last_flush = time.monotonic()
        if rows:
            self._send({"metrics": rows})

    def _artifact_ref(self, path: Path) -> str:
        if self.out_dir is not None:
            try:
                return "out:" + path.resolve().relative_to(self.out_dir.resolve()).as_posix()
            except ValueError:
                pass
        return str(path.resolve())

    def _send(self, entry: dict[str, Any]) -> None:
        """Send ``entry`` (after what the journal holds); on an outage append it to the journal instead."""
        if self.journal is None:  # nowhere to keep it: fail as before
            _send_entry(self.c, self.run_id, entry, self.out_dir, wait_s=None)
            return
        down = self._down_since is not None and time.monotonic() - self._down_since < self.retry_down_every_s
        if not down:
            try:
                if self.journal.exists():
                    replay_journal(self.c, self.journal, self.out_dir, wait_s=0.0)
                _send_entry(self.c, self.run_id, entry, self.out_dir, wait_s=0.0)
                self._down_since = None
                return
            except TrackingUnavailable as e:
                if self._down_since is None:
                    log.warning("%s; keeping this run's metrics in %s until it answers", e, self.journal)
                self._down_since = time.monotonic()
        _append_journal(self.journal, entry)


def _append_journal(path: Path, entry: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _send_entry(c: Any, run_id: str, entry: dict[str, Any], out_dir: Path | None, wait_s: float | None) -> None:
    if "metrics" in entry:
        _log_metric_rows(c, run_id, [tuple(r) for r in entry["metrics"]], wait_s)
    elif "tags" in entry:
        from mlflow.entities import RunTag  # heavy: mlflow

        retry(c.log_batch, run_id, tags=[RunTag(k, str(v)[:5000]) for k, v in entry["tags"].items()], wait_s=wait_s)
    elif "artifact" in entry:
        ref = entry["artifact"]
        path = (out_dir / ref[4:]) if ref.startswith("out:") and out_dir is not None else Path(ref)
        if not path.exists():
            raise FileNotFoundError(f"artifact {ref} of run {run_id} is gone: {path}")
        retry(c.log_artifact, run_id, str(path), entry.get("artifact_path"), wait_s=wait_s)


def journal_path(artifact_root: Path, run_id: str) -> Path:
    return Path(artifact_root) / JOURNAL_DIR / f"{run_id}.jsonl"


def replay_journal(c: Any, path: Path, out_dir: Path | None, wait_s: float | None = None) -> int:
    """Send what a journal holds, in order, then delete it. Returns the number of entries sent. An entry that was
    sent is dropped from the file before the next one, so a replay cut short resends nothing twice except, at
    most, the entry in flight. An artifact whose file is gone (the stage failed) is skipped with a warning."""
    entries = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    run_id = path.stem
    for i, entry in enumerate(entries):
        try:
            _send_entry(c, run_id, entry, out_dir, wait_s)
        except FileNotFoundError as e:
            log.warning("not replayed: %s", e)
        except BaseException:
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text("".join(json.dumps(e) + "\n" for e in entries[i:]), encoding="utf-8")
            os.replace(tmp, path)
            raise
    path.unlink(missing_ok=True)
    return len(entries)


def journal_summary(artifact_root: Path) -> list[str]:
    """One line per journal left under ``artifact_root``: the run and what it holds that MLflow has not got."""
    lines = []
    for p in sorted((Path(artifact_root) / JOURNAL_DIR).glob("*.jsonl")):
        values, names, tags, arts = 0, set(), 0, []
        for line in p.read_text(encoding="utf-8").splitlines():
            e = json.loads(line)
            values += len(e.get("metrics", []))
            names.update(r[0] for r in e.get("metrics", []))
            tags += len(e.get("tags", {}))
            arts += [e["artifact"]] if "artifact" in e else []
        shown = ", ".join(sorted(names)[:8]) + (", ..." if len(names) > 8 else "")
        lines.append(f"run {p.stem}: {values} metric value(s) ({shown}), {tags} tag(s), {len(arts)} artifact(s)"
                     f" in {p}")
    return lines
