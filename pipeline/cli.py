"""``hylight`` command line: run, validate, status, verify, ui.

Exit codes: 0 success, 1 a stage failed (``verify``: an artifact changed), 2 the spec or the command line is
invalid (nothing ran), 130 interrupted.

The pipeline modules are imported inside each command: ``hylight --help`` starts in ~0.06 s, where importing
``pipeline.spec``/``pipeline.orchestrator`` (pydantic, the stage registry) takes ~0.4 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.worker_env import apply_env_defaults

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_INTERRUPTED = 0, 1, 2, 130


def _load(args: argparse.Namespace) -> Any:
    from pipeline.orchestrator import local_capacity, ray_capacity  # lazy: start-up
    from pipeline.spec import SpecError, load_raw, load_spec  # lazy: start-up

    address = getattr(args, "ray_address", None)
    if address is None:
        try:
            raw, _ = load_raw(args.spec)
            address = raw.get("ray_address")
        except SpecError:
            address = None
    try:
        capacity = ray_capacity(address) if address else local_capacity()
    except ConnectionError as e:
        raise SpecError([f"{args.spec}: {e}"]) from None
    return load_spec(args.spec, overrides=args.set or [], capacity=capacity)


def cmd_validate(args: argparse.Namespace) -> int:
    from pipeline.spec import SpecError, load_spec  # lazy: start-up

    def is_resource(problem: str) -> bool:
        return "resources." in problem

    try:
        if args.skip_resources:  # everything but what this machine (or cluster) offers
            spec = load_spec(args.spec, overrides=args.set or [], capacity=None)
        else:
            spec = _load(args)
    except SpecError as e:
        print(f"invalid spec:\n{e}", file=sys.stderr)
        if not args.skip_resources and any(map(is_resource, e.problems)):
            print("(a spec for other machines: `hylight validate --skip-resources` checks everything else)",
                  file=sys.stderr)
        return EXIT_INVALID
    print(f"{args.spec}: OK — {len(spec.stages)} stages: {' → '.join(spec.stages)}")
    if args.skip_resources:
        try:  # what was not checked: each stage's ask against this machine, reported, not failed
            _load(args)
            print("resources: not checked (--skip-resources); they also fit this machine")
        except SpecError as e:
            skipped = sorted(filter(is_resource, e.problems), key=lambda p: (len(p.split(":")[1]), p))
            print(f"resources: not checked (--skip-resources); on this machine these would fail "
                  f"({len(skipped)}):\n" + "\n".join(f"  - {p}" for p in skipped))
    return EXIT_OK


def _json_target_problem(path: str) -> str | None:
    """Why the run report could not be written to ``path`` (None: it can)."""
    target = Path(path)
    parent = target.parent  # "." for a bare file name
    if target.is_dir():
        return "is a directory; give a file path"
    if not parent.is_dir():
        return f"its directory {parent} does not exist"
    if not os.access(parent, os.W_OK):
        return f"its directory {parent} is not writable"
    return None


def cmd_run(args: argparse.Namespace) -> int:
    from pipeline.orchestrator import RunOptions, report_json, run_pipeline, summary_table  # lazy: start-up
    from pipeline.spec import SpecError  # lazy: start-up

    try:
        spec = _load(args)
    except SpecError as e:
        print(f"invalid spec:\n{e}", file=sys.stderr)
        return EXIT_INVALID
    opts = RunOptions(stages=args.stage or [], downstream=args.downstream, from_stage=args.from_stage,
                      dry_run=args.dry_run, tracking_uri=args.tracking_uri, ray_address=args.ray_address,
                      command=shlex.join(["hylight", *sys.argv[1:]]))
    if opts.downstream and not opts.stages:
        print("--downstream goes with --stage NAME", file=sys.stderr)
        return EXIT_INVALID
    unknown = [n for n in [*opts.stages, *([opts.from_stage] if opts.from_stage else [])] if n not in spec.stages]
    if unknown:
        print(f"{args.spec}: no stage named {', '.join(map(repr, unknown))} (stages: {', '.join(spec.stages)})",
              file=sys.stderr)
        return EXIT_INVALID
    problem = _json_target_problem(args.json) if args.json else None
    if problem:  # found before anything runs, not after the whole DAG
        print(f"--json {args.json}: {problem}", file=sys.stderr)
        return EXIT_INVALID
    from pipeline.tracking import TrackingUnavailable, check_reachable, journal_summary  # lazy: start-up

    try:
        if not opts.dry_run:  # before any stage starts
            check_reachable(opts.tracking_uri or spec.tracking_uri or "")
    except TrackingUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_INVALID
    try:
        report = run_pipeline(spec, opts)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except TrackingUnavailable as e:
        left = journal_summary(spec.artifact_root)
        print(f"\nFAILED: {e}. The run stopped; stages that finished are cached. Not logged to MLflow yet (kept "
              f"in journals; the next `hylight run` with the server up sends them):\n  "
              + ("\n  ".join(left) or "(no stage metrics: only the runs' final status and tags)"), file=sys.stderr)
        return EXIT_FAILED
    print("\n" + summary_table(report), file=sys.stderr)
    if args.json:
        Path(args.json).write_text(report_json(report))
    if opts.dry_run:
        todo = [r.name for r in report.stages.values() if r.state == "planned"]
        print(f"\ndry run: would run {len(todo)} stage(s): {', '.join(todo) or 'none'}", file=sys.stderr)
        return EXIT_OK if report.ok else EXIT_FAILED
    verdict = "OK" if report.ok else "FAILED"
    print(f"\n{verdict} in {report.seconds:.1f}s · run {report.run_id} · `hylight status` / `hylight ui`",
          file=sys.stderr)
    return EXIT_OK if report.ok else EXIT_FAILED


def _last_run() -> dict[str, Any] | None:
    from pipeline.orchestrator import state_dir  # lazy: start-up

    p = state_dir() / "last_run.json"
    return json.loads(p.read_text()) if p.exists() else None


def _tracking_from(args: argparse.Namespace) -> tuple[str, str | None]:
    """(tracking URI, experiment name) from --tracking-uri / --spec / the last run."""
    if args.tracking_uri:
        return args.tracking_uri, None
    if args.spec:
        from pipeline.spec import SpecError, load_spec  # lazy: start-up
        from pipeline.tracking import default_tracking_uri  # lazy: start-up

        try:
            spec = load_spec(args.spec, check_external=False)  # only its tracking settings are needed
        except SpecError as e:
            raise SystemExit(f"invalid spec:\n{e}") from None
        return spec.tracking_uri or default_tracking_uri(spec.artifact_root), spec.name
    last = _last_run()
    if last is None:
        raise SystemExit("no run recorded yet: pass --spec SPEC or --tracking-uri URI")
    return last["tracking_uri"], last["experiment"]


def cmd_status(args: argparse.Namespace) -> int:
    from pipeline import tracking  # lazy: start-up

    uri, exp_name = _tracking_from(args)
    c = tracking.client(uri)
    if args.run:
        parent = c.get_run(args.run)
    else:
        last = _last_run()
        if last and last["tracking_uri"] == uri and not args.spec:
            parent = c.get_run(last["run_id"])
        else:
            if exp_name:
                exp = c.get_experiment_by_name(exp_name)
                exp_ids = [exp.experiment_id] if exp else []
            else:  # a tracking URI alone: the newest hylight invocation in any experiment
                exp_ids = [e.experiment_id for e in c.search_experiments()]
            runs = c.search_runs(exp_ids, filter_string="tags.`hylight.spec` != ''",
                                 order_by=["attributes.start_time DESC"], max_results=1) if exp_ids else []
            if not runs:
                print("no runs found", file=sys.stderr)
                return EXIT_FAILED
            parent = runs[0]
    children = c.search_runs([parent.info.experiment_id],
                             filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'",
                             order_by=["attributes.start_time ASC"], max_results=1000)
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(parent.info.start_time / 1000))
    print(f"run {parent.info.run_id}  {parent.info.run_name}  status={parent.info.status}  started {when}")
    print(f"tracking {uri}")
    rows = [("stage", "state", "cache", "time", "key metrics")]
    for r in children:
        tags, metrics = r.data.tags, dict(r.data.metrics)
        secs = metrics.pop("stage_seconds", None)
        if tags.get(tracking.TAG_CACHE_HIT) == "true":
            secs = (r.info.end_time - r.info.start_time) / 1000 if r.info.end_time else None
        shown = [k for k in json.loads(tags.get("hylight.summary_keys", "[]")) if k in metrics]
        shown = shown or sorted(metrics)
        key = " ".join(f"{k}={metrics[k]:.4g}" for k in shown[:4])
        if tags.get(tracking.TAG_STATE) == "failed":
            key = tags.get("hylight.error", "")[:80]
        rows.append((tags.get(tracking.TAG_STAGE, r.info.run_name), tags.get(tracking.TAG_STATE, r.info.status),
                     {"true": "hit", "false": "miss"}.get(tags.get(tracking.TAG_CACHE_HIT, ""), "-"),
                     f"{secs:.1f}s" if secs is not None else "-", key))
    from pipeline.orchestrator import format_table  # lazy: start-up

    print(format_table(rows))
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from pipeline.orchestrator import format_table  # lazy: start-up
    from pipeline.spec import SpecError, load_spec  # lazy: start-up
    from pipeline.verify import verify_spec, verify_store

    t0 = time.monotonic()
    if args.spec:
        if args.root:
            print("--root goes without SPEC (with a spec, use --set artifact_root=DIR)", file=sys.stderr)
            return EXIT_INVALID
        try:  # external files are fingerprinted below; a missing one makes that stage's key unknown, not an error
            spec = load_spec(args.spec, overrides=args.set or [], check_external=False)
        except SpecError as e:
            print(f"invalid spec:\n{e}", file=sys.stderr)
            return EXIT_INVALID
        root, rows = spec.artifact_root, verify_spec(spec)
    else:
        last = _last_run()
        if not args.root and last is None:
            print("no run recorded yet: pass SPEC or --root ARTIFACT_ROOT", file=sys.stderr)
            return EXIT_INVALID
        root = Path(args.root or last["artifact_root"]).absolute()
        if not root.is_dir():
            print(f"artifact root {root} does not exist", file=sys.stderr)
            return EXIT_INVALID
        rows = verify_store(root)
    table = [("state", "stage", "artifact", "files", "MB", "detail")]
    for r in rows:
        where = str(r.path.relative_to(root)) if r.path and r.path.is_relative_to(root) else str(r.path or "-")
        c = r.check
        table.append((r.state.upper() if r.state == "changed" else r.state, r.stage or "-", where,
                      str(c.files) if c and c.manifest else "-", f"{c.bytes / 1e6:.1f}" if c and c.manifest else "-",
                      r.note))
    print(f"artifact root {root}")
    print(format_table(table))
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.state] = counts.get(r.state, 0) + 1
    hashed = sum(r.check.bytes for r in rows if r.check)
    print(f"{len([r for r in rows if r.check])} artifact(s) re-hashed ({hashed / 1e6:.1f} MB) in "
          f"{time.monotonic() - t0:.1f}s: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    if args.json:
        Path(args.json).write_text(json.dumps({"artifact_root": str(root), "artifacts": [r.to_json() for r in rows]},
                                              indent=2))
    return EXIT_FAILED if counts.get("changed") else EXIT_OK


def cmd_ui(args: argparse.Namespace) -> int:
    from pipeline import mlflow_ui, tracking  # lazy: start-up

    uri, exp_name = _tracking_from(args)
    base = f"http://127.0.0.1:{args.port}"
    c = tracking.client(uri)
    exp_ids = mlflow_ui.hylight_experiments(c, exp_name)
    for exp_id in exp_ids:
        try:
            columns = mlflow_ui.prepare_experiment(c, exp_id)
        except Exception as e:  # noqa: BLE001 (a read-only store still gets its UI, with MLflow's columns)
            print(f"could not store the runs view in experiment {exp_id}: {type(e).__name__}: {e}", file=sys.stderr)
            columns = []
        shown = ", ".join(col.removeprefix("metrics.").strip("`") for col in columns)
        print(f"stage runs: {mlflow_ui.runs_url(base, exp_id, with_view=bool(columns))}"
              + (f"  (columns: {shown})" if shown else ""), file=sys.stderr)
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", "127.0.0.1",
           "--port", str(args.port), "--workers", "1"]
    if uri.startswith("sqlite:///"):
        root = Path(uri[len("sqlite:///"):]).parent
        cmd += ["--default-artifact-root", (root / "mlflow-artifacts").as_uri()]
    print(f"MLflow UI for {uri} at {base} (Ctrl-C to stop)", file=sys.stderr)
    os.execv(sys.executable, cmd)
    return EXIT_OK  # not reached


def cmd_stages(args: argparse.Namespace) -> int:
    from pipeline.registry import BUILTIN_STAGES, describe_markdown, resolve  # lazy: start-up

    if args.markdown:
        print(describe_markdown())
        return EXIT_OK
    for name in BUILTIN_STAGES:
        kind = resolve(name)
        ins = ", ".join(f"{r}:{s.type_name}" for r, s in kind.inputs.items()) or "-"
        print(f"{name:<12} {ins:>22} -> {kind.produces:<12} {kind.doc.split('.')[0]}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hylight", description="Train MiniMax-01-style models from a DAG spec.")
    sub = p.add_subparsers(dest="command", required=True)

    def spec_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("spec", help="DAG spec, e.g. dags/tiny.yaml")
        sp.add_argument("--set", action="append", metavar="STAGE.PARAM=VALUE",
                        help="override a param (or STAGE.resources.cpus=N, or artifact_root=DIR); repeatable")
        sp.add_argument("--ray-address", help="attach to this Ray cluster instead of starting a local one")

    r = sub.add_parser("run", help="run a spec (cached stages are skipped)")
    spec_args(r)
    r.add_argument("--stage", action="append", metavar="NAME",
                   help="run only this stage (forced) and what it needs; repeatable")
    r.add_argument("--downstream", action="store_true", help="with --stage: also force its dependents")
    r.add_argument("--from", dest="from_stage", metavar="NAME", help="force NAME and everything after it")
    r.add_argument("--dry-run", action="store_true", help="show what would run; run nothing")
    r.add_argument("--tracking-uri", help="MLflow tracking URI (default: sqlite store in the artifact root)")
    r.add_argument("--json", metavar="FILE", help="also write the run report as JSON")
    r.set_defaults(fn=cmd_run)

    v = sub.add_parser("validate", help="check a spec without running anything")
    spec_args(v)
    v.add_argument("--skip-resources", action="store_true", help=(
        "check everything but whether this machine (or --ray-address's cluster) has the CPUs, GPUs and memory each "
        "stage asks for, e.g. a GPU spec on a laptop; the skipped checks are listed"))
    v.set_defaults(fn=cmd_validate)

    s = sub.add_parser("status", help="per-stage table of a run (default: the last one)")
    s.add_argument("run", nargs="?", help="MLflow run id of an invocation")
    s.add_argument("--spec", help="read the tracking store of this spec")
    s.add_argument("--tracking-uri")
    s.set_defaults(fn=cmd_status)

    vf = sub.add_parser("verify", help="re-hash cached artifacts against their manifests (read only)")
    vf.add_argument("spec", nargs="?", help="verify the artifacts `hylight run SPEC` would reuse (default: every "
                                            "artifact under --root, or under the last run's artifact root)")
    vf.add_argument("--set", action="append", metavar="STAGE.PARAM=VALUE", help="as for run: the same keys")
    vf.add_argument("--root", help="without SPEC: the artifact root to verify")
    vf.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    vf.set_defaults(fn=cmd_verify)

    k = sub.add_parser("stages", help="list the stage kinds (--markdown: with every param)")
    k.add_argument("--markdown", action="store_true", help="full reference (docs/stages.md)")
    k.set_defaults(fn=cmd_stages)

    u = sub.add_parser("ui", help="serve the MLflow UI on 127.0.0.1")
    u.add_argument("--spec", help="the spec whose tracking store to show (default: the last run's)")
    u.add_argument("--tracking-uri")
    u.add_argument("--port", type=int, default=5000)
    u.set_defaults(fn=cmd_ui)
    return p


def main(argv: list[str] | None = None) -> int:
    apply_env_defaults()  # defaults it fills in are not forwarded: each stage worker picks its own
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
