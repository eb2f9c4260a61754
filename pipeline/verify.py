"""``hylight verify``: re-hash artifacts against their manifests, for one spec's stages (the keys `hylight run` would
look up) or for a whole artifact store; read only."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.artifacts import ArtifactCheck, ArtifactStore, check_artifact
from pipeline.orchestrator import stage_cache_key
from pipeline.spec import PipelineSpec
from pipeline.stage import Artifact


@dataclass
class VerifiedArtifact:
    """One line of ``hylight verify``: an artifact re-hashed against its manifest, or why none was."""

    state: str  # ok | changed | not built | unknown
    path: Path | None
    check: ArtifactCheck | None = None
    stage: str | None = None
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "state": self.state, "path": str(self.path) if self.path else None,
                "note": self.note, **({"check": self.check.to_json()} if self.check else {})}


def _verified(check: ArtifactCheck, stage: str | None = None) -> VerifiedArtifact:
    return VerifiedArtifact("ok" if check.ok else "changed", check.path, check, stage,
                            "" if check.ok else check.describe())


def verify_spec(spec: PipelineSpec) -> list[VerifiedArtifact]:
    """Re-hash the artifact of every stage of ``spec`` that `hylight run` would look up (same keys), in
    topological order; read only. A stage whose artifact changed still passes its manifest's digest on, so
    its dependents' keys are those a rerun would look up when the rebuilt output is the same."""
    store = ArtifactStore(spec.artifact_root)
    found: dict[str, Artifact] = {}
    out = []
    for name, st in spec.stages.items():
        lacking = [n for n in st.needs if n not in found]
        if lacking:
            out.append(VerifiedArtifact("unknown", None, stage=name,
                                        note=f"key unknown: needs {lacking[0]}, which has no artifact"))
            continue
        try:
            key, _ = stage_cache_key(st, found)
        except Exception as e:  # noqa: BLE001 (a fingerprint failed, e.g. an input file that does not exist)
            out.append(VerifiedArtifact("unknown", None, stage=name, note=f"key unknown: {type(e).__name__}: {e}"))
            continue
        path = store.path_for(st.kind.name, key)
        if not path.exists():
            out.append(VerifiedArtifact("not built", path, stage=name, note="no artifact for its key"))
            continue
        check = check_artifact(path, kind=st.kind.name, key=key)
        if check.manifest is not None and "digest" in check.manifest and check.problem is None:
            found[name] = Artifact(path=path, manifest=check.manifest)
        out.append(_verified(check, name))
    return out


def verify_store(root: Path) -> list[VerifiedArtifact]:
    """Re-hash every artifact under ``root/artifacts`` (whatever spec made it); read only."""
    checks = [check_artifact(p) for p in ArtifactStore(root).artifact_dirs()]
    return [_verified(c, (c.manifest or {}).get("stage")) for c in checks]
