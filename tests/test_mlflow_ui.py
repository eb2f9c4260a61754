"""`hylight ui` as a person sees it: the MLflow UI in headless Chromium opens on the stage runs.

The store is built through hylight's own tracking code (a pipeline parent run, nested stage runs with
their summary metrics and a loss-curve PNG), so no DAG has to run. The browser test drives Debian's
`chromium` (`apt-get install -y chromium`) through Playwright's Python API; it is skipped, saying why,
where either is missing. HYLIGHT_UI_SCREENSHOTS=DIR also copies its screenshots there (docs/img).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pipeline import mlflow_ui, tracking
from pipeline.registry import BUILTIN_STAGES, _module_source, _project_imports

REPO = Path(__file__).resolve().parents[1]
PARENT_NAME = "uidemo 2026-11-23 10:00:00"
# (stage, kind, summary): kinds with headline metrics, and a plugin kind that falls back to its first key
STAGES = [
    ("ingest", "ingest", {"read": 120, "ingested": 118, "quarantined": 2}),
    ("dedup", "dedup", {"in": 118, "kept": 101, "exact_duplicates": 17}),
    ("pretrain", "pretrain", {"eval_loss": 5.8765, "unigram_loss": 7.25, "loss": 5.4}),
    ("widgets", "my_pkg.stages:WIDGETS", {"widgets_made": 37, "widgets_lost": 0}),
]
LOSS_CURVE = [7.0, 6.6, 6.2, 5.8, 5.4]  # pretrain's loss by step: the runs table shows the last one
EXPECTED_COLUMNS = [mlflow_ui.metric_column(m) for m in
                    ("ingested", "quarantined", "kept", "loss", "eval_loss", "widgets_made")]


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", head[16:24])


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """An embedded store written the way `hylight run` writes it, plus two experiments made elsewhere."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    root = tmp_path_factory.mktemp("ui") / "runs"
    root.mkdir()
    uri = tracking.default_tracking_uri(root)
    c = tracking.client(uri)
    # made before hylight tagged its experiments, and one whose kind a person chose: ensure_experiment
    # tags the first and leaves the second alone
    old = c.create_experiment("older", artifact_location=tracking.artifact_location(root))
    chosen = c.create_experiment("chosen", artifact_location=tracking.artifact_location(root),
                                 tags={tracking.TAG_EXPERIMENT_KIND: "genai_development"})
    exp = tracking.ensure_experiment(c, "uidemo", root, uri)
    assert tracking.ensure_experiment(c, "older", root, uri) == old
    assert tracking.ensure_experiment(c, "chosen", root, uri) == chosen

    parent = tracking.start_run(c, exp, PARENT_NAME, tags={tracking.TAG_SPEC: "dags/uidemo.yaml"})
    runs = {}
    for name, kind, summary in STAGES:
        rid = tracking.start_run(c, exp, name, parent_run_id=parent, tags={
            tracking.TAG_STAGE: name, tracking.TAG_KIND: kind, tracking.TAG_CACHE_HIT: "false"})
        tracking.log_params(c, rid, {"params": {"seed": 1}})
        if kind == "pretrain":
            for step, loss in enumerate(LOSS_CURVE):
                tracking.log_metrics_now(c, rid, {"loss": loss}, step=step)
            fig, ax = plt.subplots(figsize=(4, 3))
            ax.plot(LOSS_CURVE)
            ax.set(title="pretrain loss", xlabel="step")
            plot = root / "loss_curve.png"
            fig.savefig(plot, dpi=100)
            plt.close(fig)
            tracking.retry(c.log_artifact, rid, str(plot), "plots")
        tracking.log_metrics_now(c, rid, {k: v for k, v in summary.items() if k != "loss"})
        tracking.set_tags(c, rid, {"hylight.summary_keys": json.dumps(list(summary)), tracking.TAG_STATE: "done"})
        tracking.end_run(c, rid)
        runs[name] = rid
    tracking.log_metrics_now(c, parent, {"seconds": 12.5})
    tracking.end_run(c, parent)
    return {"uri": uri, "root": root, "client": c, "exp": exp, "older": old, "chosen": chosen,
            "parent": parent, "runs": runs, "plot": root / "loss_curve.png"}


def test_headline_columns_follow_the_stage_kinds_in_order_without_repeats():
    runs = [("ingest", ["read", "ingested"]), ("clean", ["in", "kept"]), ("dedup", ["in", "kept"]),
            ("pkg:THING", ["things", "other"]), ("pkg:EMPTY", []), ("sft", ["x"]), ("dpo", ["y"])]
    assert mlflow_ui.headline_columns(runs) == [
        "metrics.`ingested`", "metrics.`quarantined`", "metrics.`kept`", "metrics.`things`",
        "metrics.`loss`", "metrics.`eval_pass_rate`"]


def _stage_source(module: str) -> str:
    """The stage module's source and that of the modules of its own package it imports (a stage's report and
    metrics may live in e.g. ``evaluation/report.py``, issue 24), read, not imported."""
    package = module.split(".")[0]
    mine = [m for m in _project_imports(module) if m.startswith(package + ".")]  # not the (empty) package itself
    return "\n".join(_source_or_empty(m) for m in [module, *mine])


def _source_or_empty(module: str) -> str:
    try:
        return _module_source(module)
    except OSError:  # inspect cannot read an empty module it has imported (a package's bare __init__)
        return ""


def test_headline_metrics_name_built_in_kinds_and_metrics_their_module_logs():
    assert set(mlflow_ui.HEADLINE_METRICS) <= set(BUILTIN_STAGES)
    for kind, metrics in mlflow_ui.HEADLINE_METRICS.items():
        source = _stage_source(BUILTIN_STAGES[kind])
        missing = [m for m in metrics if f'"{m}"' not in source]
        assert not missing, f"{kind}: {BUILTIN_STAGES[kind]} never names {missing}"


def test_experiments_are_marked_model_training_unless_a_kind_was_chosen(store):
    c = store["client"]
    kind = {e: c.get_experiment(store[e]).tags.get(tracking.TAG_EXPERIMENT_KIND)
            for e in ("exp", "older", "chosen")}
    assert kind == {"exp": "custom_model_development", "older": "custom_model_development",
                    "chosen": "genai_development"}


def test_prepare_stores_the_runs_view_with_headline_columns(store):
    c = store["client"]
    assert mlflow_ui.hylight_experiments(c, None) == [store["exp"]]  # the only one with a pipeline run
    assert mlflow_ui.prepare_experiment(c, store["exp"]) == EXPECTED_COLUMNS
    view = json.loads(c.get_experiment(store["exp"]).tags[mlflow_ui.VIEW_TAG])
    assert view == {"selectedColumns": EXPECTED_COLUMNS}
    assert mlflow_ui.runs_url("http://127.0.0.1:5000", "7") == (
        "http://127.0.0.1:5000/#/experiments/7/runs?workflowType=machine_learning&viewStateShareKey=hylight")


def _chromium() -> str:
    path = os.environ.get("HYLIGHT_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.skip("no Chromium binary (Debian: `apt-get install -y chromium`; or set HYLIGHT_CHROMIUM)")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_browser_opens_the_runs_table_with_stage_runs_metrics_and_plot(store, tmp_path):
    chromium = _chromium()
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed (dev extra)")

    port = _free_port()
    log = tmp_path / "ui.log"
    env = {**os.environ, "HYLIGHT_STATE_DIR": str(tmp_path / "state")}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "ui", "--tracking-uri", store["uri"],
                                 "--port", str(port)], cwd=REPO, env=env, stdout=out, stderr=out,
                                start_new_session=True)
    shots = tmp_path / "screenshots"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None, f"hylight ui exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"MLflow UI not up in 120 s:\n{log.read_text()}"
            time.sleep(0.5)
        printed = re.search(r"stage runs: (\S+)", log.read_text())
        assert printed, log.read_text()
        url = printed.group(1)
        assert url == mlflow_ui.runs_url(f"http://127.0.0.1:{port}", store["exp"])

        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium,
                                        args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1800, "height": 850})
            page.set_default_timeout(60_000)
            page.goto(url)
            # the runs table (not the GenAI overview), with the pipeline run and hylight's columns
            grid = page.locator(".ag-root")
            grid.get_by_text(PARENT_NAME).wait_for()
            assert "/runs?" in page.url and "overview" not in page.url
            headers = page.locator(".ag-header-cell[col-id]").evaluate_all("(es) => es.map(e => e.getAttribute('col-id'))")
            assert {h for h in headers if h.startswith("metrics.")} == set(EXPECTED_COLUMNS), headers
            # nested stage runs under the pipeline run, each with its metric values
            page.locator("button[data-component-id$='runnamecellrenderer.tsx_46']").first.click()
            for name, _, _ in STAGES:
                grid.get_by_role("link", name=name, exact=True).wait_for()
            cells = grid.locator(".ag-cell").all_inner_texts()
            for value in ("118", "2", "101", "5.4", "5.8765", "37"):
                assert value in cells, (value, cells)
            shots.mkdir()
            page.screenshot(path=str(shots / "mlflow-ui.png"))

            # the pretrain run's artifacts: the plot PNG loads as an image of its real size
            grid.get_by_role("link", name="pretrain", exact=True).click()
            page.get_by_role("tab", name="Artifacts").click()
            page.get_by_text("plots", exact=True).click()
            page.get_by_text("loss_curve.png", exact=True).click()
            img = page.locator("img[src^='blob:'], img[src*='loss_curve']").first
            img.wait_for()
            page.wait_for_function("(e) => e.complete && e.naturalWidth > 0", arg=img.element_handle())
            size = img.evaluate("(e) => [e.naturalWidth, e.naturalHeight]")
            assert tuple(size) == _png_size(store["plot"])
            assert store["runs"]["pretrain"] in page.url
            page.screenshot(path=str(shots / "mlflow-ui-plot.png"))
            browser.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    if os.environ.get("HYLIGHT_UI_SCREENSHOTS"):
        for png in shots.glob("*.png"):
            shutil.copy(png, Path(os.environ["HYLIGHT_UI_SCREENSHOTS"]) / png.name)
