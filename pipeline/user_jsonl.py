"""JSONL files that users name in params (prompts, preference pairs, eval tasks): read line by line, each line
checked, every problem a ``file:line`` message instead of an exception from deep inside a stage.

One reader for every stage that takes such files, so they refuse the same inputs the same way: a line that is not
UTF-8, not JSON (or nested deeper than Python's parser goes), or holds a lone surrogate escape (``"\\ud800"``, no
character: it could not be written back as UTF-8) is a problem of that line; a ``.gz`` file cut short or damaged
is a problem of the line after the last one read, and nothing after it is read. Blank lines are skipped. Line
numbers are physical (1-based, ``\\n``-separated), as in the ingest stage's quarantine.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

_UTF8_BOM = b"\xef\xbb\xbf"


def _json_problem(line: bytes) -> tuple[Any, str | None]:
    """(parsed value, None) or (None, why the line is no usable JSON)."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"not valid UTF-8 (byte {e.start + 1}: {e.reason})"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e.msg} at column {e.colno})"
    except RecursionError:
        return None, "not usable JSON (nested too deeply)"
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return None, "not usable JSON (a \\uD800-\\uDFFF escape that is no character: a lone surrogate)"
    return obj, None


def iter_checked_jsonl(path: str | Path,
                       problem: Callable[[Any], str | None]) -> Iterator[tuple[int, Any, str | None]]:
    """(line number, parsed object or None, ``problem(obj)`` or why the line is unusable) for every non-blank line
    of a user's JSONL file (``.gz`` read as gzip). A damaged or cut-short ``.gz`` ends with one entry for the line
    after the last one read, saying so."""
    path = Path(path)
    opener: Callable[..., Any] = gzip.open if path.name.endswith(".gz") else open
    line_no = 0
    with opener(path, "rb") as f:
        lines = iter(f)
        while True:
            try:
                raw = next(lines)
            except StopIteration:
                return
            except (OSError, EOFError, zlib.error) as e:
                yield line_no + 1, None, (f"the file is damaged or cut short after line {line_no} "
                                          f"({type(e).__name__}: {e}); nothing after it was read")
                return
            line_no += 1
            if line_no == 1 and raw.startswith(_UTF8_BOM):
                raw = raw[len(_UTF8_BOM):]
            if not raw.strip():
                continue
            obj, why = _json_problem(raw)
            yield line_no, obj, why or problem(obj)


def jsonl_file_problems(paths: Iterable[str], field: str, what: str,
                        problem: Callable[[Any], str | None]) -> list[tuple[str, str]]:
    """(field.i, 'file:line: problem') for missing files and bad lines (the first 5 a file), for spec validation."""
    problems = []
    for i, p in enumerate(paths):
        if not Path(p).is_file():
            problems.append((f"{field}.{i}", f"{what} {p!r} does not exist (resolved against {os.getcwd()})"))
            continue
        bad = [(n, why) for n, _, why in iter_checked_jsonl(p, problem) if why]
        problems += [(f"{field}.{i}", f"{p}:{n}: {why}") for n, why in bad[:5]]
        if len(bad) > 5:
            problems.append((f"{field}.{i}", f"{p}: {len(bad) - 5} more bad lines; fix the file"))
    return problems
