"""The documents of each domain of build_corpus.py, collected from the unpacked packages."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from corpus_fetch import DEB_FILES, DEBS, DEB_LICENCE, LICENCE_TEXT_ID, NEWS_LICENCE, PYPI_LICENCE, VENDORED
from corpus_text import Corpus, copyright_lines, html_to_text, pick, read_text, run, sections

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


