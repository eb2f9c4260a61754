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


class SpecError(Exception):
    """One or more problems in a spec; ``str()`` is the message for people."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


class ResourcesSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cpus: float = Field(1, ge=0)
    gpus: float = Field(0, ge=0)
    memory_gb: float | None = Field(None, gt=0)


class StageSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    uses: str
    needs: list[str] | dict[str, str | list[str]] = Field(default_factory=list)
    params: dict[str, Any] = Field(default_factory=dict)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)


class PipelineSpecModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str = ""
    artifact_root: str | None = None
    tracking_uri: str | None = None
    ray_address: str | None = None
    stages: dict[str, StageSpec]


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

    def downstream_of(self, name: str) -> list[str]:
        """``name`` and every stage that (transitively) needs it, in topological order."""
        out = {name}
        for s in self.stages.values():
            if any(n in out for n in s.needs):
                out.add(s.name)
        return [s for s in self.stages if s in out]

    def upstream_of(self, name: str) -> list[str]:
        """``name`` and everything it (transitively) needs, in topological order."""
        out, todo = set(), [name]
        while todo:
            n = todo.pop()
            if n not in out:
                out.add(n)
                todo.extend(self.stages[n].needs)
        return [s for s in self.stages if s in out]


@dataclass
class ClusterCapacity:
    """What the largest node offers; a stage must fit on one node."""

    cpus: float
    gpus: float
    memory_gb: float
    where: str = "this machine"


# --------------------------------------------------------------------------------------------
# loading


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (plain YAML keeps the last silently)."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None,
                f"duplicate key {key!r} (first at line {seen[key] + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _stage_lines(text: str) -> dict[str, int]:
    """Line number of each stage's key, for error messages."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return {}
    lines: dict[str, int] = {}
    if isinstance(root, yaml.MappingNode):
        for k, v in root.value:
            if k.value == "stages" and isinstance(v, yaml.MappingNode):
                for sk, _ in v.value:
                    lines[sk.value] = sk.start_mark.line + 1
    return lines


def parse_override(text: str) -> tuple[list[str], Any]:
    """``stage.param=value`` / ``stage.resources.cpus=2`` / ``artifact_root=...`` -> (path, value)."""
    if "=" not in text:
        raise SpecError([f"--set {text!r}: expected KEY=VALUE, e.g. tokenizer.vocab_size=4096"])
    key, _, raw = text.partition("=")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(raw: dict[str, Any], overrides: list[str], where: str) -> None:
    problems = []
    top_level = set(PipelineSpecModel.model_fields) - {"stages"}
    for text in overrides:
        path, value = parse_override(text)
        if len(path) == 1 and path[0] in top_level:
            raw[path[0]] = value
            continue
        stages = raw.get("stages") or {}
        stage = path[0]
        if stage not in stages:
            problems.append(f"{where}: --set {text!r}: no stage named {stage!r} "
                            f"(stages: {', '.join(stages)})")
            continue
        if len(path) < 2:
            problems.append(f"{where}: --set {text!r}: name a field, e.g. {stage}.PARAM=VALUE")
            continue
        target = stages[stage]
        if path[1] in ("resources", "params", "uses", "needs"):
            section, rest = path[1], path[2:]
        else:
            section, rest = "params", path[1:]  # stage.param is short for stage.params.param
        if not rest:
            target[section] = value
            continue
        node = target.setdefault(section, {})
        for p in rest[:-1]:
            node = node.setdefault(p, {})
        node[rest[-1]] = value
    if problems:
        raise SpecError(problems)


def load_raw(path: str | Path) -> tuple[dict[str, Any], str]:
    path = Path(path)
    if not path.exists():
        raise SpecError([f"{path}: no such spec file"])
    text = path.read_text(encoding="utf-8")
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        loc = f":{mark.line + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise SpecError([f"{path}{loc}: invalid YAML: {problem}"]) from None
    if not isinstance(raw, dict):
        raise SpecError([f"{path}: a spec is a mapping with 'name' and 'stages'"])
    return raw, text


def _fmt_loc(loc: tuple) -> str:
    return ".".join(str(p) for p in loc)


def load_spec(path: str | Path, overrides: list[str] | None = None,
              capacity: ClusterCapacity | None = None) -> PipelineSpec:
    """Load, override and validate a spec. Raises :class:`SpecError` listing every problem."""
    path = Path(path)
    raw, text = load_raw(path)
    return build_spec(raw, where=str(path), path=path, text=text, overrides=overrides or [],
                      capacity=capacity)


def build_spec(raw: dict[str, Any], *, where: str = "<spec>", path: Path | None = None, text: str = "",
               overrides: list[str] | None = None, capacity: ClusterCapacity | None = None) -> PipelineSpec:
    overrides = overrides or []
    apply_overrides(raw, overrides, where)
    lines = _stage_lines(text) if text else {}

    def at(stage: str | None) -> str:
        if stage is None:
            return where
        line = lines.get(stage)
        return f"{where}:{line}" if line else where

    try:
        model = PipelineSpecModel.model_validate(raw)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            loc = err["loc"]
            if len(loc) >= 2 and loc[0] == "stages":
                problems.append(f"{at(str(loc[1]))}: stage {loc[1]!r}, field {_fmt_loc(loc[2:]) or '(stage)'}: "
                                f"{err['msg']}")
            else:
                problems.append(f"{where}: field {_fmt_loc(loc)}: {err['msg']}")
        raise SpecError(problems) from None

    problems: list[str] = []
    if not model.stages:
        problems.append(f"{where}: field stages: a spec needs at least one stage")
    kinds: dict[str, StageKind] = {}
    params: dict[str, StageParams] = {}
    for name, st in model.stages.items():
        if not STAGE_NAME_RE.match(name):
            problems.append(f"{at(name)}: stage {name!r}: names use letters, digits, '_' and '-'")
        try:
            kinds[name] = resolve(st.uses)
        except UnknownStageKind as e:
            problems.append(f"{at(name)}: stage {name!r}, field uses: {e}")
            continue
        try:
            params[name] = kinds[name].params.model_validate(st.params)
        except ValidationError as e:
            for err in e.errors():
                got = f" (got {err['input']!r})" if err["type"] != "missing" and not isinstance(
                    err.get("input"), dict) else ""
                problems.append(f"{at(name)}: stage {name!r}, field params.{_fmt_loc(err['loc'])}: "
                                f"{err['msg']}{got}")

    # needs: existence, role binding
    needs: dict[str, list[str]] = {}
    inputs: dict[str, dict[str, list[str]]] = {}
    for name, st in model.stages.items():
        bound: dict[str, list[str]] = {}
        if isinstance(st.needs, dict):
            for role, targets in st.needs.items():
                bound[role] = [targets] if isinstance(targets, str) else list(targets)
            flat = [t for ts in bound.values() for t in ts]
        else:
            flat = list(st.needs)
        if len(set(flat)) != len(flat):
            problems.append(f"{at(name)}: stage {name!r}, field needs: lists a stage twice")
        missing = [n for n in flat if n not in model.stages]
        for n in missing:
            problems.append(f"{at(name)}: stage {name!r}, field needs: no stage named {n!r} "
                            f"(stages: {', '.join(model.stages)})")
        if name in flat:
            problems.append(f"{at(name)}: stage {name!r}, field needs: a stage cannot need itself")
        needs[name] = [n for n in dict.fromkeys(flat) if n in model.stages]
        kind = kinds.get(name)
        if kind is None or missing:
            continue
        inputs[name] = _bind_inputs(name, kind, bound, needs[name], kinds, problems, at(name))

    order = _topological_order(model.stages, needs, problems, at)

    if capacity is not None:
        for name, st in model.stages.items():
            r = st.resources
            for what, asked, have in (("cpus", r.cpus, capacity.cpus), ("gpus", r.gpus, capacity.gpus),
                                      ("memory_gb", r.memory_gb, capacity.memory_gb)):
                if asked is not None and asked > have:
                    problems.append(
                        f"{at(name)}: stage {name!r}, field resources.{what}: asks for {asked:g} but the "
                        f"largest node of {capacity.where} has {have:g}")

    if problems:
        raise SpecError(problems)

    root = Path(model.artifact_root or f"runs/{model.name}").expanduser()
    stages = {
        n: ResolvedStage(name=n, uses=model.stages[n].uses, kind=kinds[n], params=params[n],
                         resources=model.stages[n].resources, inputs=inputs[n], needs=needs[n])
        for n in order
    }
    return PipelineSpec(name=model.name, path=path, artifact_root=Path(os.path.abspath(root)),
                        tracking_uri=model.tracking_uri, ray_address=model.ray_address, stages=stages,
                        description=model.description, overrides=overrides)


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
