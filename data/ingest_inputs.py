"""Stage ``ingest``'s inputs: the files ``paths`` and ``sample_corpus`` name, in reading order, each once, with
its format (by extension, or ``format``) and the prefix of its records' generated ids."""

from __future__ import annotations

import glob
import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from data.ingest_params import IngestParams

SAMPLE_CORPUS_DIR = Path(__file__).parent / "sample_corpus"
SAMPLE_CORPUS_GLOB = "*.jsonl.gz"

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".jsonl.bz2", ".jsonl.xz", ".json.gz", ".ndjson",
                  ".ndjson.gz")
# JSONL compression, by the file name's last suffix (also under format: jsonl)
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd"}
PARQUET_SUFFIXES = (".parquet",)
SUFFIXES: dict[str, tuple[str, ...]] = {"jsonl": JSONL_SUFFIXES, "parquet": PARQUET_SUFFIXES}

log = logging.getLogger("data.ingest")  # the stage's logger, where a skipped file is reported


@dataclass(frozen=True)
class InputFile:
    """One file to read: where it is, how it is shown, its format, and the prefix of generated ids."""

    path: Path  # absolute
    display: str  # as the user wrote it (or package-relative for the sample corpus)
    format: Literal["jsonl", "parquet"]
    key: str  # unique among this run's inputs


def _known_format(path: str, fmt: str) -> Literal["jsonl", "parquet"] | None:
    name = path.lower()
    for candidate, suffixes in SUFFIXES.items():
        if (fmt in ("auto", candidate)) and name.endswith(suffixes):
            return candidate  # type: ignore[return-value]
    return None


def _strip_suffix(display: str) -> str:
    lower = display.lower()
    for suffix in sorted(JSONL_SUFFIXES + PARQUET_SUFFIXES, key=len, reverse=True):
        if lower.endswith(suffix):
            return display[: -len(suffix)]
    return str(Path(display).with_suffix("")) if Path(display).suffix else display


def _files_in_dir(directory: str, fmt: str) -> list[str]:
    found = []
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        found += [os.path.join(root, f) for f in files if _known_format(f, fmt)]
    return sorted(found)


def expand(pattern: str, fmt: str) -> list[tuple[str, Literal["jsonl", "parquet"]]]:
    """(display path, format) of the files one ``paths`` entry names; an error if it names none."""
    expanded = os.path.expanduser(pattern)
    where = f"(resolved against {os.getcwd()})" if not os.path.isabs(expanded) else ""
    if glob.escape(expanded) != expanded:  # a glob pattern
        matches = sorted(glob.glob(expanded, recursive=True))
        if not matches:
            raise FileNotFoundError(f"ingest: paths entry {pattern!r} matches no file {where}".rstrip())
    elif os.path.isdir(expanded) or os.path.isfile(expanded):
        matches = [expanded]
    else:
        raise FileNotFoundError(f"ingest: paths entry {pattern!r} does not exist {where}".rstrip())

    out: list[tuple[str, Literal["jsonl", "parquet"]]] = []
    skipped: list[str] = []
    for match in matches:
        if os.path.isdir(match):
            out += [(f, _known_format(f, fmt)) for f in _files_in_dir(match, fmt)]  # type: ignore[misc]
        elif (known := _known_format(match, fmt)) is not None:
            out.append((match, known))
        elif fmt != "auto":
            out.append((match, fmt))  # type: ignore[arg-type]  # the user said what it is
        else:
            skipped.append(match)
    known = ", ".join(JSONL_SUFFIXES + PARQUET_SUFFIXES)
    if skipped and matches == [expanded]:
        raise ValueError(f"ingest: cannot tell the format of {pattern!r} from its extension (known: "
                         f"{known}); set format: jsonl or parquet")
    if not out:
        raise FileNotFoundError(
            f"ingest: paths entry {pattern!r} matches no {'readable' if fmt == 'auto' else fmt} file "
            f"{where} (known extensions: {known}; {len(skipped)} other file(s) matched); "
            "set format to read other extensions")
    if skipped:
        log.warning("ingest: paths entry %r: skipping %d file(s) of unknown format, e.g. %s",
                    pattern, len(skipped), ", ".join(skipped[:3]))
    return out


def _unique_keys(displays: list[str]) -> list[str]:
    """Id prefixes: the file stem; where stems collide, the path without, then with, its extension."""
    keys = [Path(_strip_suffix(d)).name for d in displays]
    for longer in (_strip_suffix, str):
        counts = Counter(keys)
        keys = [longer(d) if counts[k] > 1 else k for d, k in zip(displays, keys, strict=True)]
    counts = Counter(keys)
    return [f"{k}#{i}" if counts[k] > 1 else k for i, k in enumerate(keys)]  # only for contrived names


def resolve_inputs(params: IngestParams) -> list[InputFile]:
    """The files ``params`` names, in reading order, each once."""
    named: list[tuple[str, Path, Literal["jsonl", "parquet"]]] = []
    if params.sample_corpus:
        files = sorted(SAMPLE_CORPUS_DIR.glob(SAMPLE_CORPUS_GLOB))
        if not files:
            raise FileNotFoundError(
                f"ingest: the shipped sample corpus is missing ({SAMPLE_CORPUS_DIR}/{SAMPLE_CORPUS_GLOB} "
                "matches nothing); reinstall hylight or set sample_corpus: false")
        named += [(f"data/sample_corpus/{f.name}", f.resolve(), "jsonl") for f in files]
    for pattern in params.paths:
        named += [(d, Path(d).resolve(), f) for d, f in expand(pattern, params.format)]

    seen: set[Path] = set()
    kept = []
    for display, path, fmt in named:
        if path not in seen:
            seen.add(path)
            kept.append((display, path, fmt))
    keys = _unique_keys([d for d, _, _ in kept])
    return [InputFile(path=p, display=d, format=f, key=k) for (d, p, f), k in zip(kept, keys, strict=True)]

