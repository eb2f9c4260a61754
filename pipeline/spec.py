"""DAG specs (``dags/*.yaml``): loading, CLI overrides and validation before anything runs.

A spec looks like::

    name: tiny
    artifact_root: runs/tiny          # relative to the working directory
    tracking_uri: null                # null: embedded sqlite store under artifact_root
    ray_address: null                 # null: start a local Ray bound to 127.0.0.1
    stages:
      ingest:
        uses: ingest
        params: {sample_corpus: true}
        resources: {cpus: 1}
      tokenizer:
        uses: tokenizer
        needs: [ingest]               # or {documents: ingest} to bind input roles explicitly
        params: {vocab_size: 8192}

Every problem found is reported at once, each naming file, line, stage and field.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.registry import UnknownStageKind, resolve
from pipeline.stage import StageKind, StageParams

STAGE_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_\-]*$")
URL_SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")  # s3://, gs://, file://: not an artifact root


MAX_RETRIES = 10  # a stage's `retries` (and the spec's) at most


class SpecError(Exception):
    """One or more problems in a spec; ``str()`` is the message for people."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


class ResourcesSpec(BaseModel):
    """What a stage asks for, per node. ``nodes > 1`` needs a kind that launches its own workers."""

    model_config = ConfigDict(extra="forbid")
    cpus: float = Field(1, ge=0)
    gpus: float = Field(0, ge=0)
    memory_gb: float | None = Field(None, gt=0)
    nodes: int = Field(1, ge=1)
    # Ray tasks a kind that splits its work (StageKind(splits_work=True)) runs over shards of its input, one
    # CPU each, anywhere in the cluster (not per node). Not in the cache key: such a kind's output does not
    # depend on it (pipeline/shards.py).
    tasks: int = Field(1, ge=1)


class StageSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    uses: str
    needs: list[str] | dict[str, str | list[str]] = Field(default_factory=list)
    params: dict[str, Any] = Field(default_factory=dict)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    # times a failed stage is started again in the same run (a training stage resumes from its checkpoints);
    # None: the spec's top-level `retries`. Not in the cache key: a retry makes the same artifact
    retries: int | None = Field(None, ge=0, le=MAX_RETRIES, strict=True)


class PipelineSpecModel(BaseModel):
    """The top level of a spec; each stage is validated on its own so every problem is reported."""

    model_config = ConfigDict(extra="forbid")
    name: str
    description: str = ""
    artifact_root: str | None = None
    tracking_uri: str | None = None
    ray_address: str | None = None
    retries: int = Field(0, ge=0, le=MAX_RETRIES, strict=True)  # every stage's, unless the stage sets its own
    stages: dict[str, Any]


@dataclass
class ResolvedStage:
    """A validated stage: its kind, typed params, resources and input roles bound to stages."""

    name: str
    uses: str
    kind: StageKind
    params: StageParams
    resources: ResourcesSpec
    inputs: dict[str, list[str]]  # role -> upstream stage names
    needs: list[str]
    retries: int = 0


@dataclass
class PipelineSpec:
    name: str
    path: Path | None
    artifact_root: Path
    tracking_uri: str | None
    ray_address: str | None
    stages: dict[str, ResolvedStage]  # in topological order
    description: str = ""
    overrides: list[str] = field(default_factory=list)

    def resolved(self) -> dict[str, Any]:
        """The spec as validated, every default filled and every input role bound, in the spec's own format:
        what a run logs, and a spec that loads back to this one."""
        return {"name": self.name, "description": self.description, "artifact_root": str(self.artifact_root),
                "tracking_uri": self.tracking_uri, "ray_address": self.ray_address,
                "stages": {n: {"uses": s.uses, "needs": s.inputs, "params": s.params.model_dump(mode="json"),
                               "resources": s.resources.model_dump(), "retries": s.retries}
                           for n, s in self.stages.items()}}

    def downstream_of(self, name: str) -> list[str]:
        """``name`` and every stage that (transitively) needs it, in topological order."""
        out = {name}
        for s in self.stages.values():
            if any(n in out for n in s.needs):
                out.add(s.name)
        return [s for s in self.stages if s in out]

    def depth_below(self) -> dict[str, int]:
        """For each stage, the most stages on a path from it down to a stage nothing needs (0 for such a stage):
        how much of the run waits behind it. The orchestrator gives GPUs to the deepest waiting stage first."""
        dependents: dict[str, list[str]] = {n: [] for n in self.stages}
        for s in self.stages.values():
            for n in s.needs:
                dependents[n].append(s.name)
        depth: dict[str, int] = {}
        for name in reversed(list(self.stages)):  # topological order reversed: a stage's dependents come first
            depth[name] = 1 + max((depth[d] for d in dependents[name]), default=-1)
        return depth

    def upstream_of(self, name: str) -> list[str]:
        """``name`` and everything it (transitively) needs, in topological order."""
        out, todo = set(), [name]
        while todo:
            n = todo.pop()
            if n not in out:
                out.add(n)
                todo.extend(self.stages[n].needs)
        return [s for s in self.stages if s in out]


@dataclass(frozen=True)
class NodeCapacity:
    cpus: float
    gpus: float
    memory_gb: float

    def fits(self, r: ResourcesSpec) -> bool:
        return (r.cpus <= self.cpus and r.gpus <= self.gpus
                and (r.memory_gb is None or r.memory_gb <= self.memory_gb))


@dataclass
class ClusterCapacity:
    """What the cluster offers: the largest amount of each resource on any node, and the nodes."""

    cpus: float
    gpus: float
    memory_gb: float
    where: str = "this machine"
    nodes: list[NodeCapacity] | None = None  # every live node; None: a single node with the above

    def node_list(self) -> list[NodeCapacity]:
        return self.nodes if self.nodes is not None else [NodeCapacity(self.cpus, self.gpus, self.memory_gb)]


# --------------------------------------------------------------------------------------------
# loading


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (plain YAML keeps the last silently). Merge keys
    (``<<: *anchor``) work as in YAML 1.1: the mapping's own keys override the merged ones."""


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == _MERGE_TAG:  # SafeLoader's construct_mapping merges it below
            continue
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"a key must be a plain value, not a {type(key).__name__}", key_node.start_mark) from None
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None,
                f"duplicate key {key!r} (first at line {seen[key] + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _field_lines(text: str) -> dict[tuple[str, ...], int]:
    """1-based line of every key (and list item) in the YAML, by path: ("stages", "a", "params", "paths",
    "0") -> line. Error messages point at the field's own line."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return {}
    lines: dict[tuple[str, ...], int] = {}

    def walk(node: yaml.Node, path: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                sub = (*path, str(k.value))
                lines.setdefault(sub, k.start_mark.line + 1)
                walk(v, sub)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                sub = (*path, str(i))
                lines.setdefault(sub, item.start_mark.line + 1)
                walk(item, sub)

    if root is not None:
        walk(root, ())
    return lines


def parse_override(text: str) -> tuple[list[str], Any]:
    """``stage.param=value`` / ``stage.resources.cpus=2`` / ``artifact_root=...`` -> (path, value)."""
    if "=" not in text:
        raise SpecError([f"--set {text!r}: expected KEY=VALUE, e.g. tokenizer.vocab_size=4096"])
    key, _, raw = text.partition("=")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except (yaml.YAMLError, RecursionError):
        value = raw
    return key.strip().split("."), value


def apply_overrides(raw: dict[str, Any], overrides: list[str], where: str) -> dict[tuple[str, ...], str]:
    """Apply ``--set`` overrides to the raw spec; returns the path each one set -> its text."""
    problems = []
    applied: dict[tuple[str, ...], str] = {}
    top_level = set(PipelineSpecModel.model_fields) - {"stages"}
    for text in overrides:
        path, value = parse_override(text)
        size, depth = _expanded_size(value, MAX_SPEC_VALUES)
        if size > MAX_SPEC_VALUES or depth > MAX_SPEC_DEPTH:
            problems.append(f"{where}: --set {_short(text, 60)}: a value nested too deeply or too large for a spec "
                            f"(at most {MAX_SPEC_DEPTH} levels and {MAX_SPEC_VALUES} values)")
            continue
        if len(path) == 1 and path[0] in top_level:
            raw[path[0]] = value
            applied[(path[0],)] = text
            continue
        stages = raw.get("stages") or {}
        stage = path[0]
        if not isinstance(stages, dict):
            problems.append(f"{where}: --set {text!r}: the spec's stages are not a mapping of stage names")
            continue
        if stage not in stages:
            problems.append(f"{where}: --set {text!r}: no stage named {stage!r} "
                            f"(stages: {', '.join(stages)})")
            continue
        if len(path) < 2:
            problems.append(f"{where}: --set {text!r}: name a field, e.g. {stage}.PARAM=VALUE")
            continue
        target = stages[stage]
        if path[1] in ("resources", "params", "uses", "needs", "retries"):
            section, rest = path[1], path[2:]
        else:
            section, rest = "params", path[1:]  # stage.param is short for stage.params.param
        keys = [section, *rest]
        node, walked = target, [stage]
        for p in keys[:-1]:
            if not isinstance(node, dict):
                break
            if node.get(p) is None:  # absent, or written as an empty `params:`
                node[p] = {}
            node = node[p]
            walked.append(p)
        if not isinstance(node, dict):
            problems.append(f"{where}: --set {text!r}: {'.'.join(walked)} is not a mapping in the spec, so it has "
                            f"no field {keys[len(walked) - 1]!r} to set")
            continue
        applied[("stages", stage, section, *rest)] = text
        node[keys[-1]] = value
    if problems:
        raise SpecError(problems)
    return applied


# A spec's values, counted with every YAML alias expanded: more means aliases of aliases (a "billion laughs"
# document, or a recursive one) that validation would walk for ever. dags/tiny.yaml, the largest, has 666.
MAX_SPEC_VALUES = 100_000
MAX_SPEC_DEPTH = 64  # nesting levels; a real spec uses under ten


def _expanded_size(value: Any, budget: int) -> tuple[int, int]:
    """How many values ``value`` holds with shared (aliased) parts counted each time, and how deep it nests; stops
    past ``budget`` values."""
    count, deepest, todo = 0, 0, [(value, 1)]
    while todo and count <= budget:
        v, depth = todo.pop()
        count, deepest = count + 1, max(deepest, depth)
        if isinstance(v, dict):
            todo.extend((x, depth + 1) for x in (*v.keys(), *v.values()))
        elif isinstance(v, list | tuple | set):
            todo.extend((x, depth + 1) for x in v)
    return count, deepest


def load_raw(path: str | Path) -> tuple[dict[str, Any], str]:
    path = Path(path)
    if not path.exists():
        raise SpecError([f"{path}: no such spec file"])
    if not path.is_file():
        raise SpecError([f"{path}: not a file; give the path of a spec (.yaml)"])
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError([f"{path}: not UTF-8 text (byte offset {e.start}: {e.reason}); a spec is a YAML file"]) from None
    except OSError as e:
        raise SpecError([f"{path}: cannot read the spec: {e.strerror or e}"]) from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        loc = f":{mark.line + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise SpecError([f"{path}{loc}: invalid YAML: {problem}"]) from None
    except RecursionError:
        raise SpecError([f"{path}: invalid YAML: nested too deeply for a spec"]) from None
    if not isinstance(raw, dict):
        raise SpecError([f"{path}: a spec is a mapping with 'name' and 'stages' (got "
                         f"{'an empty file' if raw is None else type(raw).__name__})"])
    size, depth = _expanded_size(raw, MAX_SPEC_VALUES)
    if size > MAX_SPEC_VALUES:
        raise SpecError([f"{path}: the spec holds more than {MAX_SPEC_VALUES} values with its YAML aliases "
                         "expanded (aliases of aliases, or an alias inside itself); write it out plainly"])
    if depth > MAX_SPEC_DEPTH:  # whether the YAML loader's recursion ran out above depends on the caller's stack
        raise SpecError([f"{path}: invalid YAML: nested too deeply for a spec ({depth} levels; at most "
                         f"{MAX_SPEC_DEPTH})"])
    return raw, text


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _fmt_loc(loc: tuple) -> str:
    return ".".join(str(p) for p in loc)


def load_spec(path: str | Path, overrides: list[str] | None = None,
              capacity: ClusterCapacity | None = None, check_external: bool = True) -> PipelineSpec:
    """Load, override and validate a spec. Raises :class:`SpecError` listing every problem.

    ``check_external``: also run each kind's ``validate_external`` (e.g. do ingest's input files
    exist); off for commands that only read a spec's settings (``hylight status``)."""
    path = Path(path)
    raw, text = load_raw(path)
    return build_spec(raw, where=str(path), path=path, text=text, overrides=overrides or [],
                      capacity=capacity, check_external=check_external)


class _Locator:
    """Turns a field path into ``file:line`` (the deepest part of the path present in the YAML), or
    names the ``--set`` override that put the value there."""

    def __init__(self, where: str, text: str, applied: dict[tuple[str, ...], str]):
        self.where, self.applied = where, applied
        self.lines = _field_lines(text) if text else {}

    def __call__(self, *path: Any) -> str:
        key = tuple(str(p) for p in path)
        for n in range(len(key), 0, -1):
            if key[:n] in self.applied:
                return f"{self.where} (--set {self.applied[key[:n]]})"
        for n in range(len(key), 0, -1):
            if key[:n] in self.lines:
                return f"{self.where}:{self.lines[key[:n]]}"
        return self.where


class _Problems:
    """Every problem of a spec, each with its place (``file:line``, or the ``--set`` that put the value there)."""

    def __init__(self, at: _Locator) -> None:
        self.at, self.lines = at, []

    def add(self, msg: str) -> None:
        self.lines.append(msg)

    def __call__(self, loc: tuple[Any, ...], stage: str | None, field_: str, msg: str) -> None:
        """A field's problem: ``file:line: stage 'x', field params.y: msg``."""
        who = f"stage {stage!r}, " if stage is not None else ""
        self.lines.append(f"{self.at(*loc)}: {who}field {field_}: {msg}")


@dataclass
class _Stages:
    """What each stage's own sections resolved to (a stage with a bad section is missing from the maps it feeds)."""

    specs: dict[str, StageSpec] = field(default_factory=dict)
    kinds: dict[str, StageKind] = field(default_factory=dict)
    params: dict[str, StageParams] = field(default_factory=dict)
    resources_ok: set[str] = field(default_factory=set)


def build_spec(raw: dict[str, Any], *, where: str = "<spec>", path: Path | None = None, text: str = "",
               overrides: list[str] | None = None, capacity: ClusterCapacity | None = None,
               check_external: bool = True) -> PipelineSpec:
    """Validate a parsed spec (after ``overrides``) and resolve it; raises :class:`SpecError` with every problem at
    once: a bad `resources` must not hide a bad `uses`, an unknown param or a missing need."""
    overrides = overrides or []
    problem = _Problems(_Locator(where, text, apply_overrides(raw, overrides, where)))
    model, stages_raw = _top_level(raw, problem)
    stages = _Stages()
    for name, st_raw in stages_raw.items():
        _check_stage(str(name), st_raw, stages, problem, check_external)
    needs, inputs = _bind_needs(stages_raw, stages, problem)
    order = _topological_order(stages.specs, needs, problem.lines, lambda n: problem.at("stages", n, "needs"))
    _check_artifact_root(model, problem)
    for name in stages.resources_ok:
        _check_stage_resources(name, stages, capacity, problem)
    if problem.lines:
        raise SpecError(problem.lines)
    assert model is not None  # no problems: the top level validated
    root = Path(model.artifact_root or f"runs/{model.name}").expanduser()
    resolved = {n: ResolvedStage(name=n, uses=stages.specs[n].uses, kind=stages.kinds[n], params=stages.params[n],
                                 resources=stages.specs[n].resources, inputs=inputs[n], needs=needs[n],
                                 retries=model.retries if stages.specs[n].retries is None else stages.specs[n].retries)
                for n in order}
    return PipelineSpec(name=model.name, path=path, artifact_root=Path(os.path.abspath(root)),
                        tracking_uri=model.tracking_uri, ray_address=model.ray_address, stages=resolved,
                        description=model.description, overrides=overrides)


def _top_level(raw: dict[str, Any], problem: _Problems) -> tuple[PipelineSpecModel | None, dict[Any, Any]]:
    """The spec's top-level fields (None where they do not validate) and its raw stages, which are checked one by
    one even then; a spec without a stages mapping ends here."""
    try:
        model = PipelineSpecModel.model_validate(raw)
    except ValidationError as e:
        for err in e.errors():
            problem(err["loc"], None, _fmt_loc(err["loc"]), err["msg"])
        stages_raw = raw.get("stages")
        if not isinstance(stages_raw, dict):
            raise SpecError(problem.lines) from None
        model = None
    else:
        stages_raw = model.stages
    if not stages_raw:
        problem.add(f"{problem.at('stages')}: field stages: a spec needs at least one stage")
    return model, stages_raw


def _check_stage(name: str, st_raw: Any, stages: _Stages, problem: _Problems, check_external: bool) -> None:
    """One stage, each section on its own: its name, its sections, its kind, its params, what they name outside."""
    if not STAGE_NAME_RE.match(name):
        problem.add(f"{problem.at('stages', name)}: stage {name!r}: names use letters, digits, '_' and '-'")
    if not isinstance(st_raw, dict):
        problem(("stages", name), name, "(stage)", "a stage is a mapping with at least 'uses'")
        return
    bad_sections: set[str] = set()
    try:
        StageSpec.model_validate(st_raw)
    except ValidationError as e:
        for err in e.errors():
            loc = err["loc"]
            got = f" (got {_short(err['input'])})" if err["type"] not in ("missing", "extra_forbidden") \
                and not isinstance(err.get("input"), dict | list) else ""
            problem(("stages", name, *loc), name, _fmt_loc(loc) or "(stage)", err["msg"] + got)
            if loc:
                bad_sections.add(str(loc[0]))
    kept = {k: v for k, v in st_raw.items() if k in StageSpec.model_fields and k not in bad_sections}
    if "uses" not in kept:
        return
    st = StageSpec.model_validate(kept)
    stages.specs[name] = st
    if "resources" not in bad_sections:
        stages.resources_ok.add(name)
    try:
        kind = stages.kinds[name] = resolve(st.uses)
    except UnknownStageKind as e:
        problem(("stages", name, "uses"), name, "uses", str(e))
        return
    if "params" in bad_sections:
        return
    try:
        stages.params[name] = kind.params.model_validate(st.params)
    except ValidationError as e:
        for err in e.errors():
            got = f" (got {_short(err['input'])})" if err["type"] != "missing" and not isinstance(
                err.get("input"), dict) else ""
            problem(("stages", name, "params", *err["loc"]), name,
                    f"params.{_fmt_loc(err['loc'])}".rstrip("."), f"{err['msg']}{got}")
        return
    if check_external and kind.validate_external is not None:
        _check_external(name, kind, stages.params[name], problem)


def _bind_needs(stages_raw: dict[Any, Any], stages: _Stages,
                problem: _Problems) -> tuple[dict[str, list[str]], dict[str, dict[str, list[str]]]]:
    """Each stage's needs (that they exist, once each, not itself) and its inputs bound to roles."""
    needs: dict[str, list[str]] = {}
    inputs: dict[str, dict[str, list[str]]] = {}
    for name, st in stages.specs.items():
        needs_at = problem.at("stages", name, "needs")
        bound: dict[str, list[str]] = {}
        if isinstance(st.needs, dict):
            for role, targets in st.needs.items():
                bound[role] = [targets] if isinstance(targets, str) else list(targets)
            flat = [t for ts in bound.values() for t in ts]
        else:
            flat = list(st.needs)
        if len(set(flat)) != len(flat):
            problem.add(f"{needs_at}: stage {name!r}, field needs: lists a stage twice")
        missing = [n for n in flat if n not in stages_raw]
        for n in missing:
            problem.add(f"{needs_at}: stage {name!r}, field needs: no stage named {n!r} "
                        f"(stages: {', '.join(map(str, stages_raw))})")
        if name in flat:
            problem.add(f"{needs_at}: stage {name!r}, field needs: a stage cannot need itself")
        needs[name] = [n for n in dict.fromkeys(flat) if n in stages.specs]
        kind = stages.kinds.get(name)
        if kind is None or missing or any(n not in stages.kinds for n in flat):
            continue
        inputs[name] = _bind_inputs(name, kind, bound, needs[name], stages.kinds, problem.lines, needs_at)
    return needs, inputs


def _check_artifact_root(model: PipelineSpecModel | None, problem: _Problems) -> None:
    if model is not None and model.artifact_root and URL_SCHEME_RE.match(model.artifact_root):
        problem.add(
            f"{problem.at('artifact_root')}: field artifact_root: {model.artifact_root!r} is a URL; artifact roots "
            "are filesystem paths only (fsspec URLs such as s3:// are not implemented). On a Ray cluster use a "
            "shared filesystem mounted at the same path on every node (NFS, Lustre, a FUSE mount of the bucket)")


def _check_stage_resources(name: str, stages: _Stages, capacity: ClusterCapacity | None, problem: _Problems) -> None:
    """What a stage asks for against the machine or cluster, then its kind's own check of resources and params."""
    if name in stages.kinds:
        _check_resources(name, stages.specs[name].resources, stages.kinds[name], capacity, problem)
    if name in stages.params and stages.kinds[name].validate_resources is not None:
        for field_, msg in stages.kinds[name].validate_resources(stages.params[name], stages.specs[name].resources):
            problem(("stages", name, *field_.split(".")), name, field_, msg)


def _check_external(name: str, kind: StageKind, params: StageParams, problem: Any) -> None:
    """The kind's own check of what its params name outside the spec (input files...)."""
    try:
        found = kind.validate_external(params)  # type: ignore[misc]
    except Exception as e:  # noqa: BLE001 (a hook that raises still reports, it does not crash validation)
        problem(("stages", name, "params"), name, "params", f"{type(e).__name__}: {e}")
        return
    for item in found or []:
        field_, msg = item if isinstance(item, tuple) else ("", item)
        parts = [p for p in str(field_).split(".") if p]
        problem(("stages", name, "params", *parts), name, ".".join(["params", *parts]), msg)


def _check_resources(name: str, r: ResourcesSpec, kind: StageKind, capacity: ClusterCapacity | None,
                     problem: Any) -> None:
    """A stage runs in one process on one node unless its kind launches its own workers; whatever it
    asks for, per node, must exist on that many live nodes."""
    if r.nodes > 1 and not kind.launches_workers:
        problem(("stages", name, "resources", "nodes"), name, "resources.nodes",
                f"asks for {r.nodes} nodes but kind {kind.name!r} runs in one process on one node; only a "
                "kind that launches its own workers (StageKind(launches_workers=True)) can span nodes")
        return
    if r.tasks > 1 and not kind.splits_work:
        problem(("stages", name, "resources", "tasks"), name, "resources.tasks",
                f"asks for {r.tasks} tasks but kind {kind.name!r} does not split its work into Ray tasks; "
                "kinds that do: clean, dedup, quality, mix (StageKind(splits_work=True))")
    if capacity is None:
        return
    over = False
    for what, asked, have in (("cpus", r.cpus, capacity.cpus), ("gpus", r.gpus, capacity.gpus),
                              ("memory_gb", r.memory_gb, capacity.memory_gb)):
        if asked is not None and asked > have:
            over = True
            problem(("stages", name, "resources", what), name, f"resources.{what}",
                    f"asks for {asked:g}{' per node' if r.nodes > 1 else ''} but the largest node of "
                    f"{capacity.where} has {have:g}")
    if over:
        return
    nodes = capacity.node_list()
    fitting = sum(n.fits(r) for n in nodes)
    if fitting < r.nodes:
        each = f"cpus={r.cpus:g} gpus={r.gpus:g}" + (f" memory_gb={r.memory_gb:g}" if r.memory_gb else "")
        field_ = "nodes" if r.nodes > 1 else "cpus"
        problem(("stages", name, "resources", field_), name, f"resources.{field_}",
                f"asks for {r.nodes} node(s) with {each} each but only {fitting} of the {len(nodes)} live "
                f"node(s) of {capacity.where} have that much")


def _bind_inputs(name: str, kind: StageKind, explicit: dict[str, list[str]], needs: list[str],
                 kinds: dict[str, StageKind], problems: list[str], where: str) -> dict[str, list[str]]:
    """Match each input role of ``kind`` to upstream stages by artifact type."""
    bound: dict[str, list[str]] = {}
    for role in explicit:
        if role not in kind.inputs:
            problems.append(f"{where}: stage {name!r}, field needs.{role}: kind {kind.name!r} has no input "
                            f"{role!r} (inputs: {', '.join(kind.inputs) or 'none'})")
    used: set[str] = set()
    for role, spec in kind.inputs.items():
        if role in explicit:
            cands = explicit[role]
        else:
            cands = [n for n in needs if n in kinds and spec.accepts(kinds[n].produces)
                     and not any(n in ts for ts in explicit.values())]
        for c in cands:
            if c in kinds and not spec.accepts(kinds[c].produces):
                problems.append(f"{where}: stage {name!r}, field needs: input {role!r} takes {spec.type_name!r} "
                                f"but stage {c!r} produces {kinds[c].produces!r}")
        if not cands and spec.required:
            problems.append(f"{where}: stage {name!r}, field needs: input {role!r} needs a stage producing "
                            f"{spec.type_name!r}; none of its needs ({', '.join(needs) or 'none'}) does")
        if len(cands) > 1 and not spec.many:
            problems.append(f"{where}: stage {name!r}, field needs: {len(cands)} stages ({', '.join(cands)}) "
                            f"produce {spec.type_name!r} for input {role!r}; bind one with needs: {{{role}: STAGE}}")
        bound[role] = cands
        used.update(cands)
    for n in needs:
        if n not in used and n in kinds:
            problems.append(f"{where}: stage {name!r}, field needs: stage {n!r} produces "
                            f"{kinds[n].produces!r}, which kind {kind.name!r} takes no input of")
    return bound


def _topological_order(stages: dict[str, Any], needs: dict[str, list[str]], problems: list[str],
                       at: Any) -> list[str]:
    order: list[str] = []
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(n: str, path: list[str]) -> None:
        if state.get(n) == 2:
            return
        if state.get(n) == 1:
            cycle = path[path.index(n):] + [n]
            problems.append(f"{at(n)}: stage {n!r}, field needs: dependency cycle "
                            f"{' -> '.join(cycle)} (each needs the next)")
            return
        state[n] = 1
        for m in needs.get(n, []):
            visit(m, path + [n])
        state[n] = 2
        order.append(n)

    for n in stages:
        visit(n, [])
    return order
