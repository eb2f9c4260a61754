"""Tiny plugin stage kinds for orchestrator tests (``uses: tests.stage_fixtures:NAME``).

They do real file work through the real stage contract, so cache, Ray and MLflow behaviour is tested
without the cost of data stages. Each appends a line to ``$HYLIGHT_TEST_LOG`` when it actually runs.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from pipeline.stage import InputSpec, StageContext, StageKind, StageParams, file_fingerprint


def _record(name: str) -> None:
    log = os.environ.get("HYLIGHT_TEST_LOG")
    if log:
        with open(log, "a") as f:
            f.write(name + "\n")


class SourceParams(StageParams):
    text: str = "hello"
    repeat: int = 1
    sleep_s: float = 0.0


def run_source(params: SourceParams, ctx: StageContext) -> None:
    _record(ctx.stage_name)
    time.sleep(params.sleep_s)
    (ctx.out_dir / "text.txt").write_text(params.text * params.repeat)
    ctx.set_rows("chars", len(params.text) * params.repeat)
    ctx.log_summary({"chars": len(params.text) * params.repeat})
    ctx.log_metrics({"progress": 0.5}, step=1)
    ctx.log_metrics({"progress": 1.0}, step=2)


SOURCE = StageKind(name="test_source", params=SourceParams, run=run_source, produces="text")


class ConcatParams(StageParams):
    sep: str = "|"
    fail_marker: str | None = None  # raise while this file exists
    kill_marker: str | None = None  # SIGKILL this worker mid-write while this file exists


def run_concat(params: ConcatParams, ctx: StageContext) -> None:
    _record(ctx.stage_name)
    parts = [(a.path / "text.txt").read_text() for a in ctx.input_list("texts")]
    out = ctx.out_dir / "text.txt"
    with open(out, "w") as f:
        f.write(parts[0] if parts else "")
        f.flush()
        if params.kill_marker and Path(params.kill_marker).exists():
            Path(params.kill_marker).unlink()
            os.kill(os.getpid(), signal.SIGKILL)  # killed mid-write: half a file sits in the temp dir
        for p in parts[1:]:
            f.write(params.sep + p)
    if params.fail_marker and Path(params.fail_marker).exists():
        raise RuntimeError("concat was told to fail")
    ctx.log_summary({"parts": len(parts)})


CONCAT = StageKind(name="test_concat", params=ConcatParams, run=run_concat, produces="text",
                   inputs={"texts": InputSpec("text", many=True)})


class CountParams(StageParams):
    pass


def run_count(params: CountParams, ctx: StageContext) -> None:
    _record(ctx.stage_name)
    n = len(ctx.input("text").file("text.txt").read_text())
    (ctx.out_dir / "count.txt").write_text(str(n))
    ctx.log_summary({"length": n})


COUNT = StageKind(name="test_count", params=CountParams, run=run_count, produces="count",
                  inputs={"text": InputSpec("text")})


class FileSourceParams(StageParams):
    path: str


def run_file_source(params: FileSourceParams, ctx: StageContext) -> None:
    _record(ctx.stage_name)
    (ctx.out_dir / "text.txt").write_text(Path(params.path).read_text())


FILE_SOURCE = StageKind(name="test_file_source", params=FileSourceParams, run=run_file_source,
                        produces="text", fingerprint=lambda p: [file_fingerprint(p.path)])
