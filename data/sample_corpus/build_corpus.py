#!/usr/bin/env python3
"""Build the small, real sample corpus shipped in ``data/sample_corpus/``.

The corpus lets the default pipeline run offline.  Every document is real,
human-written text (documentation prose, source code, licence texts, man
pages, changelogs/NEWS and fortune-cookie quotations) taken verbatim from
redistributable packages of three public package registries.  Nothing is
generated, paraphrased or edited; duplicates in the output are the natural
ones that occur in those packages (e.g. the same licence shipped by several
packages, vendored copies of the same module, two versions of one file).

Output (written next to this script, nothing else in the repository is
touched; downloads go to a temporary directory):

    prose.jsonl.gz  code.jsonl.gz  legal.jsonl.gz  manual.jsonl.gz  misc.jsonl.gz

plus the generated attribution block (between the ``BEGIN/END GENERATED
ATTRIBUTION`` markers) at the end of ``LICENSES.md``; the hand-written part of
that file and ``PROVENANCE.md`` are not touched.  Each ``.jsonl.gz`` holds
one JSON object per line::

    {"id": "<domain>/<slug>", "text": "...", "source": "<registry>:<pkg>@<version>:<path>",
     "domain": "<domain>", "metadata": {"licence": "<SPDX id>", "url_or_path": "<archive>!/<member>"}}

Requirements (not needed in CI; the built files are committed):

* Debian 12 (bookworm) with ``apt-get`` (run ``apt-get update`` first),
  ``dpkg-deb``, ``man`` (man-db) and ``groff-base`` -- all present on a
  standard Debian system.  Packages are fetched with ``apt-get download``
  (pinned versions, see ``DEBS``) and unpacked with ``dpkg-deb -x`` into the
  temp dir; nothing is installed into the system.
* ``npm`` (any recent version): packages are fetched with ``npm pack``
  (pinned versions, see ``NPM``) into the temp dir and untarred.
* ``python3 -m pip download --no-deps`` (pinned versions, see ``PYPI``) into
  the temp dir; nothing is installed.
* Python >= 3.9, standard library only.

The code: this script (the command line, the output files and the attribution block), ``corpus_fetch.py``
(the pinned packages and their downloads), ``corpus_collect.py`` (the documents of each domain) and
``corpus_text.py`` (text helpers: decoding, slugs, paragraph splits, HTML to text, the corpus being built).

Usage::

    python3 data/sample_corpus/build_corpus.py [--workdir DIR] [--keep]

The build is deterministic for a given set of package versions: inputs are
walked in sorted order, subsets are chosen by a SHA-1 of the member path,
gzip headers carry no timestamp, ids are stable slugs of the source path.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import hashlib
import io
import json
import shutil
import tempfile
from pathlib import Path

from corpus_collect import collect_code, collect_legal, collect_manual, collect_misc, collect_prose, npm_licence
from corpus_fetch import fetch_debs, fetch_npm, fetch_pypi
from corpus_text import DOMAINS, Corpus

HERE = Path(__file__).resolve().parent

# --------------------------------------------------------------------------
def write(c: Corpus, outdir: Path):
    stats = {}
    for dom in DOMAINS:
        docs = sorted(c.docs[dom], key=lambda d: d["id"])
        buf = io.BytesIO()
        with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
            for d in docs:
                gz.write((json.dumps(d, ensure_ascii=False) + "\n").encode("utf-8"))
        path = outdir / f"{dom}.jsonl.gz"
        path.write_bytes(buf.getvalue())
        texts = collections.Counter(hashlib.sha256(d["text"].encode()).hexdigest() for d in docs)
        stats[dom] = {
            "docs": len(docs),
            "text_bytes": sum(len(d["text"].encode()) for d in docs),
            "gz_bytes": path.stat().st_size,
            "exact_dup_docs": sum(n - 1 for n in texts.values() if n > 1),
            "dup_groups": sum(1 for n in texts.values() if n > 1),
            "licences": dict(collections.Counter(d["metadata"]["licence"] for d in docs).most_common()),
        }
    return stats


BEGIN_GEN = "<!-- BEGIN GENERATED ATTRIBUTION (build_corpus.py) -->"
END_GEN = "<!-- END GENERATED ATTRIBUTION -->"


def attribution_md(c: Corpus, npm) -> str:
    out = [BEGIN_GEN, "",
           "### Generated: copyright statements per source",
           "",
           "Extracted by `build_corpus.py` from the licence/copyright files of each",
           "package (npm, PyPI, Debian) and from the roff source of each man page",
           "included (the rendered pages drop the source comments that carry them).",
           ""]
    titles = {"npm": "npm packages", "pypi": "PyPI distributions",
              "debian": "Debian packages (from debian/copyright)",
              "man": "Man pages (sections `manual/`)"}
    for sec in ("npm", "pypi", "debian", "man"):
        out += [f"#### {titles[sec]}", ""]
        keys = sorted(c.attrib[sec])
        if sec == "npm":
            keys = sorted(set(keys) | set(npm))
        for k in keys:
            lic, lines = c.attrib[sec].get(k, (npm_licence(npm[k]) if sec == "npm" else "?", []))
            if sec == "npm" and not lines:
                meta = json.loads((npm[k] / "package.json").read_text(encoding="utf-8"))
                a = meta.get("author")
                a = a.get("name") if isinstance(a, dict) else a
                lines = [f"(no copyright line in a licence file; package.json author: {a})"]
            txt = "; ".join(l.replace("|", "/") for l in lines) or "(no copyright line found)"
            out.append(f"- `{k}` ({lic}): {txt}")
        out.append("")
    out.append(END_GEN)
    return "\n".join(out) + "\n"


def update_licenses_md(path: Path, block: str):
    if not path.exists():
        return
    text = path.read_text(encoding="utf-8")
    if BEGIN_GEN in text and END_GEN in text:
        head, rest = text.split(BEGIN_GEN, 1)
        tail = rest.split(END_GEN, 1)[1].lstrip("\n")
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text, encoding="utf-8")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", help="download/extract dir (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir")
    ap.add_argument("--out", default=str(HERE), help="output dir (default: this dir)")
    args = ap.parse_args(argv)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="sample_corpus_"))
    try:
        debs = fetch_debs(work)
        npm = fetch_npm(work)
        pypi = fetch_pypi(work)
        c = Corpus()
        collect_prose(c, debs, npm, pypi)
        collect_code(c, debs, npm, pypi)
        collect_legal(c, debs, npm, pypi)
        collect_manual(c, debs)
        collect_misc(c, debs, npm, pypi)
        stats = write(c, Path(args.out))
        update_licenses_md(Path(args.out) / "LICENSES.md", attribution_md(c, npm))
        groups = {f"{d}:{g}": [n, c.group_bytes[(d, g)]] for (d, g), n in sorted(c.groups.items())}
        print(json.dumps({"domains": stats, "groups": groups, "skipped": c.skipped}, indent=1))
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
