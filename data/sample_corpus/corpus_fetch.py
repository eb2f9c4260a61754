"""The pinned inputs of build_corpus.py (Debian, npm and PyPI packages, their licences) and their download into
the work directory."""
from __future__ import annotations

import re
import sys
import tarfile
import zipfile
from pathlib import Path

from corpus_text import run

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


