"""Text helpers of build_corpus.py: hashing and picking, decoding, slugs, paragraph splits, the Corpus being
built, copyright lines, and HTML to plain text."""
from __future__ import annotations

import collections
import gzip
import hashlib
import re
import subprocess
from html.parser import HTMLParser
from pathlib import Path

MAX_BYTES = 100_000  # cap for one document (UTF-8 bytes)
DOMAINS = ("prose", "code", "legal", "manual", "misc")


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


