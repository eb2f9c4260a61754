"""Content-addressed artifact store: stage cache keys, manifests and atomic commits.

An artifact lives at ``<root>/artifacts/<kind>/<key[:24]>/`` and is accepted only if its
``manifest.json`` names the same cache key and the directory holds exactly the files it lists, each with
the listed sha256 (every lookup re-hashes: a same-size corruption is not reused), whose ``digest`` is the one its
file list gives, and whose fields all agree with its seal (``manifest_sha256``: the sha256 of the rest of the
manifest, so a one-character edit of its digest, summary or row count is found; a seal detects edits, it does not
authenticate: whoever can write the artifact can also recompute it). A stage writes into
``<root>/.tmp/...``; at commit every file and directory is fsynced, then the manifest is written (last),
and the directory is renamed into place, so neither a killed stage nor a crash leaves anything the cache
would accept. An artifact that fails verification is moved to ``<root>/corrupt/`` (and logged in
``corrupt/quarantine.log``), never deleted, and the stage is rebuilt.
"""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import json
import logging
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.launch import pid_alive
from pipeline.stage import MANIFEST_NAME, Artifact, sha256_file

MANIFEST_SCHEMA = "hylight.artifact/2"  # /2: manifests carry their seal (manifest_sha256)
SEAL_FIELD = "manifest_sha256"
QUARANTINE_DIR = "corrupt"  # under the artifact root: artifacts that failed verification, kept for inspection

log = logging.getLogger("hylight.artifacts")


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def cache_key(kind: str, code_digest: str, params: dict[str, Any],
              input_digests: dict[str, list[str]]) -> tuple[str, dict[str, Any]]:
    """Key = hash(kind + code version, validated params, digests of input artifacts)."""
    material = {"kind": kind, "code": code_digest, "params": params, "inputs": input_digests}
    return hashlib.sha256(canonical_json(material).encode()).hexdigest(), material


def artifact_digest(type_: str, schema_version: int, files: list[dict[str, Any]]) -> str:
    """The artifact's identity: its type, layout version and the content of every file but its records
    (``StageKind.records``: reports, logs and plots of the run, marked ``"record": true`` in the manifest)."""
    ident = {"type": type_, "schema_version": schema_version,
             "files": [(f["path"], f["sha256"]) for f in files if not f.get("record")]}
    return hashlib.sha256(canonical_json(ident).encode()).hexdigest()


def manifest_seal(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's canonical JSON without its seal field, as it reads back from manifest.json (a JSON
    round trip first: keys become strings, tuples lists, other objects their str, exactly as written)."""
    rest = json.loads(json.dumps({k: v for k, v in manifest.items() if k != SEAL_FIELD}, default=str))
    return hashlib.sha256(canonical_json(rest).encode()).hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: Path, mode: str = "wb") -> Iterator[Any]:
    """A file written under a temporary name beside ``path``, fsynced, then renamed onto ``path`` (and the
    rename fsynced). On failure the temporary file is removed and an OSError names ``path`` (a failed write
    reports no file name of its own: "[Errno 28] No space left on device")."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno is not None and not e.filename:
            raise OSError(e.errno, e.strerror or os.strerror(e.errno), str(path)) from e
        raise
    _fsync_dir(path.parent)


def write_json_atomic(path: Path, obj: Any) -> None:
    with atomic_file(path, "w") as f:
        json.dump(obj, f, indent=2, default=str)  # insertion order: summaries read in the order logged


def write_text_atomic(path: Path, text: str) -> None:
    """``text`` (UTF-8) under a temporary name, fsynced, then renamed: a report is whole or absent after a crash."""
    with atomic_file(path, "w") as f:
        f.write(text)


def write_jsonl_atomic(path: Path, rows: Iterable[Any]) -> None:
    """One JSON object a line (keys sorted, UTF-8 kept), under a temporary name, fsynced, then renamed."""
    with atomic_file(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")


def publish_dir(tmp: Path, dest: Path, *, replace: bool = True) -> None:
    """Move a finished directory ``tmp`` (written in full beside ``dest``) onto ``dest``: its files are fsynced,
    then one rename, then the parent's entry fsynced, so ``dest`` is whole or absent after a crash.

    ``replace``: an existing ``dest`` (a previous attempt's) is removed first; else an existing ``dest`` is an
    error. ``tmp`` and ``dest`` must be on one filesystem (a rename), e.g. siblings."""
    tmp, dest = Path(tmp), Path(dest)
    for path in sorted(tmp.rglob("*")):
        if path.is_file() and not path.is_symlink():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for d in [tmp, *sorted(p for p in tmp.rglob("*") if p.is_dir() and not p.is_symlink())]:
        _fsync_dir(d)
    if dest.exists() or dest.is_symlink():
        if not replace:
            raise FileExistsError(errno.EEXIST, "publish_dir: destination exists", str(dest))
        if dest.is_dir() and not dest.is_symlink():
            shutil.rmtree(dest)
        else:
            dest.unlink()
    os.replace(tmp, dest)
    _fsync_dir(dest.parent)


# --- verification ---------------------------------------------------------------------------------
def _sha256_and_sync(path: Path) -> str:
    """sha256 of a file just written, which is also flushed to disk (fsync works on a read-only fd on Linux)."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        os.fsync(f.fileno())
    return digest


def _hash_threads() -> int:
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def hash_files(paths: list[Path], *, sync: bool = False) -> list[str]:
    """sha256 of each file, several files at a time (hashlib releases the GIL); ``sync``: fsync each too."""
    fn = _sha256_and_sync if sync else sha256_file
    workers = min(len(paths), _hash_threads())
    if workers <= 1:
        return [fn(p) for p in paths]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, paths))


def _payload_files(path: Path) -> list[Path]:
    """Every file of an artifact directory except its top-level manifest, sorted."""
    top = path / MANIFEST_NAME
    return sorted(p for p in path.rglob("*") if p.is_file() and p != top)


@dataclass(frozen=True)
class ArtifactCheck:
    """What re-hashing an artifact directory against its manifest found."""

    path: Path
    manifest: dict[str, Any] | None
    problem: str | None = None  # the manifest itself is unusable (unreadable, another key, another format)
    changed: tuple[str, ...] = ()  # content (or size) differs from the manifest's sha256
    missing: tuple[str, ...] = ()  # listed, not on disk
    extra: tuple[str, ...] = ()  # on disk, not listed (written into the artifact after it was committed)
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not (self.problem or self.changed or self.missing or self.extra)

    def describe(self, limit: int = 5) -> str:
        if self.ok:
            return "ok"
        if self.problem:
            return self.problem
        parts = []
        for what, names in (("changed", self.changed), ("missing", self.missing), ("extra", self.extra)):
            if names:
                shown = ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")
                parts.append(f"{what}: {shown}")
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        m = self.manifest or {}
        return {"path": str(self.path), "ok": self.ok, "kind": m.get("kind"), "stage": m.get("stage"),
                "cache_key": m.get("cache_key"), "problem": self.problem, "changed": list(self.changed),
                "missing": list(self.missing), "extra": list(self.extra), "files": self.files,
                "bytes": self.bytes, "seconds": round(self.seconds, 3)}


def _load_manifest(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(the manifest of the artifact at ``path``, None) or (None, why it cannot be used)."""
    try:
        with open(path / MANIFEST_NAME, encoding="utf-8") as f:
            m = json.load(f)
    except FileNotFoundError:
        return None, f"no {MANIFEST_NAME}"
    except (OSError, ValueError) as e:
        return None, f"{MANIFEST_NAME} unreadable ({type(e).__name__}: {e})"
    return (m, None) if isinstance(m, dict) else (None, f"{MANIFEST_NAME} is not a JSON object")


def check_artifact(path: str | Path, *, kind: str | None = None, key: str | None = None) -> ArtifactCheck:
    """Re-hash every file of the artifact at ``path`` against its manifest. ``kind``/``key``: what the
    caller looks for (default: what the directory's place in the store says, ``<kind>/<key[:24]>``)."""
    path, t0 = Path(path), time.monotonic()
    m, problem = _load_manifest(path)
    if m is None:
        return ArtifactCheck(path, None, problem=problem)
    kind = kind or path.parent.name
    if m.get("schema") != MANIFEST_SCHEMA:
        problem = f"manifest schema {m.get('schema')!r}, expected {MANIFEST_SCHEMA!r}"
    elif m.get("kind") != kind:
        problem = f"manifest is for kind {m.get('kind')!r}, found under {kind!r}"
    elif key is not None and m.get("cache_key") != key:
        problem = f"manifest is for cache key {m.get('cache_key')!r}, looked up {key!r}"
    elif key is None and not str(m.get("cache_key", "")).startswith(path.name):
        problem = f"manifest is for cache key {m.get('cache_key')!r}, which does not match the directory name"
    elif m.get(SEAL_FIELD) != manifest_seal(m):
        problem = (f"{MANIFEST_NAME} was edited after its commit: its fields do not match its seal ({SEAL_FIELD})")
    if problem:
        return ArtifactCheck(path, m, problem=problem)
    try:
        listed = {f["path"]: f for f in m.get("files", [])}
        digest = artifact_digest(m["type"], m["schema_version"], m["files"])
    except (TypeError, KeyError):
        return ArtifactCheck(path, m, problem="manifest has no valid file list")
    if m.get("digest") != digest:
        return ArtifactCheck(path, m, problem=f"manifest digest {m.get('digest')!r} is not its file list's {digest!r}")
    on_disk = {p.relative_to(path).as_posix(): p for p in _payload_files(path)}
    missing = tuple(sorted(set(listed) - set(on_disk)))
    extra = tuple(sorted(set(on_disk) - set(listed)))
    present = sorted(set(listed) & set(on_disk))
    # a size mismatch needs no hashing; everything else is read in full (same-size corruption)
    sized = [n for n in present if on_disk[n].stat().st_size == listed[n].get("size")]
    digests = dict(zip(sized, hash_files([on_disk[n] for n in sized]), strict=True))
    changed = tuple(n for n in present if digests.get(n) != listed[n].get("sha256"))
    return ArtifactCheck(path, m, changed=changed, missing=missing, extra=extra, files=len(listed),
                         bytes=sum(int(f.get("size", 0)) for f in listed.values()),
                         seconds=time.monotonic() - t0)


# --- a full disk ----------------------------------------------------------------------------------
DISK_FULL_ERRNOS = {
    errno.ENOSPC: "no space left on device (ENOSPC)",
    errno.EDQUOT: "disk quota exceeded (EDQUOT)",
    errno.EFBIG: "file larger than this process's file-size limit (EFBIG)",
}


class ArtifactWriteError(OSError):
    """A stage could not write its artifact because the disk (or a quota, or the file-size limit) is full."""


def _disk_full_cause(exc: BaseException) -> OSError | None:
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return e
        todo += [e.__cause__, e.__context__]
    return None


def _newest_file(dirs: Iterable[Path]) -> Path | None:
    newest: tuple[int, Path] | None = None
    for d in dirs:
        for p in d.rglob("*") if d.is_dir() else ():
            try:
                t = p.stat().st_mtime_ns
            except OSError:
                continue
            if p.is_file() and (newest is None or t > newest[0]):
                newest = (t, p)
    return newest[1] if newest else None


def explain_write_failure(exc: BaseException, stage: str, written: list[Path],
                          root: Path) -> ArtifactWriteError | None:
    """An :class:`ArtifactWriteError` naming the stage, the file and the limit hit when ``exc`` (or its
    cause) is a full disk, quota or file-size limit; None for any other failure. Call it before the partial
    output in ``written`` is removed: it names the newest file there when the error itself names none."""
    cause = _disk_full_cause(exc)
    if cause is None:
        return None
    if cause.filename:
        where = f"while writing {cause.filename}"
    else:
        newest = _newest_file(written)
        where = (f"(the file it wrote last: {newest})" if newest
                 else "(the error names no file and the stage's output held none)")
    if cause.errno == errno.EFBIG:
        import resource  # Unix only: the module imports on any platform

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
        detail = f"this process's file-size limit (RLIMIT_FSIZE, `ulimit -f`) is {limit}"
    else:
        try:
            free = shutil.disk_usage(root).free
            detail = f"the filesystem holding {root} has {free:,} bytes free"
        except OSError:
            detail = f"the filesystem holding {root} cannot be queried"
    return ArtifactWriteError(cause.errno, (
        f"stage {stage!r} could not write its artifact: {DISK_FULL_ERRNOS[cause.errno]} {where}; {detail}. "
        "Nothing was committed and its partial output is removed: free space (or raise the limit, or point "
        "artifact_root at a larger disk) and rerun."))


class ArtifactStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.artifacts = self.root / "artifacts"
        self.tmp = self.root / ".tmp"

    def path_for(self, kind: str, key: str) -> Path:
        return self.artifacts / kind / key[:24]

    def lookup(self, kind: str, key: str, on_reject: Callable[[str], None] | None = None,
               quarantine: bool = True) -> Artifact | None:
        """The accepted artifact for ``key``, or None. Every file is re-hashed against the manifest; an
        artifact that fails (changed, missing or extra files, an unusable manifest) is a miss, so the stage
        reruns: it is moved to the quarantine (unless ``quarantine`` is False: a dry run changes nothing) and
        reported through ``on_reject`` (default: this module's logger)."""
        path = self.path_for(kind, key)
        if not path.exists():
            return None
        check = check_artifact(path, kind=kind, key=key)
        if not check.ok and check.manifest != _load_manifest(path)[0]:
            check = check_artifact(path, kind=kind, key=key)  # replaced by a concurrent commit while we read
        if check.ok:
            assert check.manifest is not None
            return Artifact(path=path, manifest=check.manifest)
        if quarantine:
            moved = self.quarantine(path, check)
            where = f"moved to {moved}" if moved else "already moved away by another process"
        else:
            where = "left in place"
        (on_reject or log.warning)(
            f"cached artifact {path} failed verification ({check.describe()}); {where}; the stage will be rebuilt")
        return None

    def quarantine(self, path: Path, check: ArtifactCheck) -> Path | None:
        """Move a rejected artifact to ``<root>/corrupt/<kind>/`` and log why in ``corrupt/quarantine.log``.
        None if it is gone already (another process moved it)."""
        dest = (self.root / QUARANTINE_DIR / path.parent.name
                / f"{path.name}-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(path, dest)
        except FileNotFoundError:
            return None
        _fsync_dir(path.parent)
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "from": str(path), "to": str(dest),
                 **{k: v for k, v in check.to_json().items() if k not in ("path", "ok", "seconds")}}
        with open(self.root / QUARANTINE_DIR / "quarantine.log", "a", encoding="utf-8") as f:
            f.write(json.dumps(entry, sort_keys=True) + "\n")
        return dest

    def artifact_dirs(self) -> list[Path]:
        """Every directory in the store's place for artifacts (``artifacts/<kind>/<key prefix>``), sorted."""
        if not self.artifacts.is_dir():
            return []
        return sorted(p for k in self.artifacts.iterdir() if k.is_dir() for p in k.iterdir() if p.is_dir())

    def resume_dir(self, kind: str, key: str) -> Path:
        """Where a stage keeps what must outlive a killed attempt (checkpoints); never swept, keyed like the
        artifact so only a rerun of the same stage (same key) resumes from it."""
        return self.root / "resume" / kind / key[:24]

    def begin(self, kind: str, key: str) -> Path:
        """A fresh private directory for a stage to write into."""
        self.tmp.mkdir(parents=True, exist_ok=True)
        # the owner (host, pid) is in the name so sweep() can tell abandoned dirs from live ones
        path = self.tmp / f"{kind}__{key[:12]}__{socket.gethostname()}__{os.getpid()}__{uuid.uuid4().hex[:8]}"
        path.mkdir()
        return path

    def commit(self, tmp_dir: Path, *, type_: str, schema_version: int, kind: str, key: str,
               meta: dict[str, Any], records: Sequence[str] = ()) -> Artifact:
        """Write the manifest into ``tmp_dir`` and move it into place atomically. Files matching a ``records``
        pattern are marked as records: listed and hashed, left out of the digest (``artifact_digest``)."""
        # data first, durably (files, then the directories that name them); the manifest last
        paths = _payload_files(tmp_dir)
        digests = hash_files(paths, sync=True)
        files = []
        for p, d in zip(paths, digests, strict=True):
            rel = p.relative_to(tmp_dir).as_posix()
            entry: dict[str, Any] = {"path": rel, "size": p.stat().st_size, "sha256": d}
            if any(fnmatch.fnmatchcase(rel, pattern) for pattern in records):
                entry["record"] = True
            files.append(entry)
        for d in sorted({p.parent for p in paths} | {tmp_dir}, key=lambda d: len(d.parts), reverse=True):
            _fsync_dir(d)
        manifest = {
            "schema": MANIFEST_SCHEMA,
            "type": type_,
            "schema_version": schema_version,
            "kind": kind,
            "cache_key": key,
            "digest": artifact_digest(type_, schema_version, files),
            "files": files,
            "bytes": sum(f["size"] for f in files),
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **meta,
        }
        manifest[SEAL_FIELD] = manifest_seal(manifest)
        write_json_atomic(tmp_dir / MANIFEST_NAME, manifest)
        final = self.path_for(kind, key)
        if not final.parent.is_dir():
            final.parent.mkdir(parents=True, exist_ok=True)
            _fsync_dir(final.parent.parent)
        trash = None
        if final.exists():  # a forced rerun replaces the old artifact
            trash = self.tmp / f"trash-{final.name}-{uuid.uuid4().hex[:8]}"
            os.replace(final, trash)
        os.replace(tmp_dir, final)
        _fsync_dir(final.parent)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        return Artifact(path=final, manifest=manifest)

    def sweep(self) -> int:
        """Delete temp dirs left by stages whose process is gone (this host only)."""
        if not self.tmp.exists():
            return 0
        host = socket.gethostname()
        removed = 0
        for p in self.tmp.iterdir():
            parts = p.name.split("__")
            if p.name.startswith("trash-"):
                alive = False
            elif len(parts) != 5 or parts[2] != host:
                continue
            else:
                alive = parts[3].isdigit() and pid_alive(int(parts[3]))
            if not alive:
                shutil.rmtree(p, ignore_errors=True)
                removed += 1
        return removed
