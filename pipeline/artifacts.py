"""Content-addressed artifact store: stage cache keys, manifests and atomic commits.

An artifact lives at ``<root>/artifacts/<kind>/<key[:24]>/`` and is accepted only if its
``manifest.json`` names the same cache key and every listed file is present with its size. A stage
writes into ``<root>/.tmp/...`` and the directory is renamed into place only after the manifest is
written, so a killed stage never leaves anything the cache would accept.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pipeline.launch import pid_alive
from pipeline.stage import MANIFEST_NAME, Artifact, sha256_file

MANIFEST_SCHEMA = "hylight.artifact/1"


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def cache_key(kind: str, code_digest: str, params: dict[str, Any],
              input_digests: dict[str, list[str]]) -> tuple[str, dict[str, Any]]:
    """Key = hash(kind + code version, validated params, digests of input artifacts)."""
    material = {"kind": kind, "code": code_digest, "params": params, "inputs": input_digests}
    return hashlib.sha256(canonical_json(material).encode()).hexdigest(), material


def artifact_digest(type_: str, schema_version: int, files: list[dict[str, Any]]) -> str:
    """The artifact's identity: its type, layout version and the content of every file."""
    ident = {"type": type_, "schema_version": schema_version,
             "files": [(f["path"], f["sha256"]) for f in files]}
    return hashlib.sha256(canonical_json(ident).encode()).hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, default=str)  # insertion order: summaries read in the order logged
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_jsonl_atomic(path: Path, rows: Iterable[Any]) -> None:
    """One JSON object a line (keys sorted, UTF-8 kept), under a temporary name, fsynced, then renamed."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class ArtifactStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.artifacts = self.root / "artifacts"
        self.tmp = self.root / ".tmp"

    def path_for(self, kind: str, key: str) -> Path:
        return self.artifacts / kind / key[:24]

    def lookup(self, kind: str, key: str) -> Artifact | None:
        """The accepted artifact for ``key``, or None (absent, partial or foreign)."""
        path = self.path_for(kind, key)
        try:
            art = Artifact.load(path)
        except (OSError, ValueError):
            return None
        m = art.manifest
        if m.get("schema") != MANIFEST_SCHEMA or m.get("cache_key") != key:
            return None
        for f in m.get("files", []):
            p = path / f["path"]
            try:
                if p.stat().st_size != f["size"]:
                    return None
            except OSError:
                return None
        return art

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
               meta: dict[str, Any]) -> Artifact:
        """Write the manifest into ``tmp_dir`` and move it into place atomically."""
        files = []
        for p in sorted(tmp_dir.rglob("*")):
            if p.is_file() and p.name != MANIFEST_NAME:
                files.append({"path": p.relative_to(tmp_dir).as_posix(), "size": p.stat().st_size,
                              "sha256": sha256_file(p)})
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
        write_json_atomic(tmp_dir / MANIFEST_NAME, manifest)
        final = self.path_for(kind, key)
        final.parent.mkdir(parents=True, exist_ok=True)
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
