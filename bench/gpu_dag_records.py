"""Every stage's records of a GPU run in one archive (a device call returns at most 8 files): summaries, train logs,
eval reports, plots, retrieval and copy-curriculum counts, the ablation table, from each finished stage's
artifact (the report's, else every artifact under the root), and the train logs of unfinished training stages.

    python bench/gpu_dag_records.py --work WORK --out OUT_DIR      # writes OUT_DIR/records.tar.gz

Used by bench/run_gpu_dag.sh at the end of a call and by bench/gpu_recipe_lease.sh at the end of each watch.
"""

from __future__ import annotations

import argparse
import json
import tarfile
from pathlib import Path

RECORD_GLOBS = ("summary.json", "train_log.jsonl", "report.json", "timing.json", "packing.json", "retrieval.json",
                "copy_curriculum.json", "plots/*.png", "phases/*/summary.json", "phases/*/retrieval.json",
                "phases/*/phase_data.json", "*_report.json", "pass_rate.jsonl", "comparison.md", "comparison.json")
MAX_FILE = 8_000_000


def finished_artifacts(work: Path) -> dict[str, Path]:
    """Stage name -> artifact directory: from ``work/report.json`` where the run wrote one, else the newest artifact
    each stage name committed under ``work/root``."""
    report = work / "report.json"
    if report.is_file():
        stages = json.loads(report.read_text())["stages"]
        return {n: Path(r["artifact"]) for n, r in stages.items() if r.get("artifact")}
    found: dict[str, Path] = {}
    for m in sorted((work / "root" / "artifacts").glob("*/*/manifest.json"), key=lambda p: p.stat().st_mtime):
        name = json.loads(m.read_text()).get("stage")
        if name:
            found[name] = m.parent
    return found


def write_records(work: Path, out: Path) -> Path:
    target = out / "records.tar.gz"
    with tarfile.open(target, "w:gz") as tar:
        for name, art in finished_artifacts(work).items():
            for pattern in RECORD_GLOBS:
                for f in sorted(art.glob(pattern)):
                    if f.is_file() and f.stat().st_size < MAX_FILE:
                        tar.add(f, arcname=f"{name}/{f.relative_to(art)}")
        for f in sorted((work / "root").rglob("train_log.jsonl")):  # unfinished training stages' logs
            if f.stat().st_size < MAX_FILE and "artifacts" not in f.parts:
                tar.add(f, arcname=f"unfinished/{f.relative_to(work / 'root')}")
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    print(write_records(args.work, args.out))


if __name__ == "__main__":
    main()
