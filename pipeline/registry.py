"""The stage-kind registry: the one place that maps a spec's ``uses:`` to a stage module.

Built-in kinds are named here and imported lazily (validating a spec should not import torch for a
data-only DAG). A spec may also name a plugin kind by import path, ``uses: my_pkg.stages:MY_STAGE``.
"""

from __future__ import annotations

import ast
import difflib
import functools
import hashlib
import importlib
import importlib.machinery
import importlib.util
import inspect
import sys

from pipeline.stage import StageKind

# kind name -> module exposing STAGE (one source of truth for what `uses:` accepts)
BUILTIN_STAGES: dict[str, str] = {
    "ingest": "data.ingest",
    "clean": "data.clean",
    "dedup": "data.dedup",
    "quality": "data.quality",
    "mix": "data.mix",
    "tokenizer": "data.tokenizer",
    "pretrain": "pretrain.stage",
    "long_context": "pretrain.long_context",
    "eval": "evaluation.eval",
    "prompts": "posttrain.prompts",
    "reward_model": "posttrain.reward_model",
    "dpo": "posttrain.dpo",
    "sft": "posttrain.sft",
    "grpo": "posttrain.grpo",
    "compare": "evaluation.compare",
}


class UnknownStageKind(LookupError):
    pass


def resolve(uses: str) -> StageKind:
    """The StageKind for a spec's ``uses:`` value, or :class:`UnknownStageKind` with a hint."""
    if uses in BUILTIN_STAGES:
        module = importlib.import_module(BUILTIN_STAGES[uses])
        return module.STAGE
    if ":" in uses:
        mod_name, _, attr = uses.partition(":")
        try:
            module = importlib.import_module(mod_name)
        except ImportError as e:
            raise UnknownStageKind(f"cannot import plugin stage module {mod_name!r}: {e}") from e
        kind = getattr(module, attr, None)
        if not isinstance(kind, StageKind):
            raise UnknownStageKind(f"{uses!r} is not a StageKind (found {type(kind).__name__})")
        return kind
    close = difflib.get_close_matches(uses, list(BUILTIN_STAGES), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise UnknownStageKind(
        f"unknown stage kind {uses!r}{hint} (known: {', '.join(sorted(BUILTIN_STAGES))}; "
        "or give a plugin as 'module:ATTRIBUTE')"
    )


# Top-level packages of this project: their modules count as a stage's code when a stage imports them.
PROJECT_PACKAGES = ("pipeline", "data", "model", "kernels", "pretrain", "posttrain", "evaluation")


def _module_source(name: str) -> str:
    """A module's source, read from its file without importing it (a cached rerun must not pay for importing
    torch and DeepSpeed just to hash the pretrain stage's code)."""
    module = sys.modules.get(name)
    if module is not None:
        return inspect.getsource(module)
    spec = _find_spec(name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise OSError(f"no Python source for module {name!r}")
    with open(spec.origin, encoding="utf-8") as f:
        return f.read()


@functools.lru_cache(maxsize=1024)
def _imported_names(source: str) -> tuple[str, ...]:
    """Every module name an absolute import statement in ``source`` names (``from a import b`` gives ``a`` and
    ``a.b``). Cached by the source text: parsing is most of a cache-key computation, and a kind's modules are
    the same for every stage of that kind in a run; an edited source is a new text, so it is parsed again."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ()
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return tuple(names)


def _project_imports(module_name: str) -> list[str]:
    """Project modules that ``module_name`` imports (statically, anywhere in its source)."""
    try:
        source = _module_source(module_name)
    except (OSError, TypeError):
        return []
    return [name for name in _imported_names(source)
            if name.split(".")[0] in PROJECT_PACKAGES and _find_spec(name) is not None]


def _find_spec(name: str) -> importlib.machinery.ModuleSpec | None:
    """The spec of module ``name``, found without importing it or its packages (``importlib.util.find_spec``
    imports the parents; ``from pretrain.moe import X`` names ``pretrain.moe.X``, which must not import
    ``pretrain.moe`` to find out it is no module). None if there is no such module."""
    parts = name.split(".")
    path, spec = None, None
    for i, part in enumerate(parts):
        if i and path is None:
            return None  # the parent is a plain module, not a package
        try:
            spec = importlib.machinery.PathFinder.find_spec(part, path)
        except (ImportError, ValueError):
            return None
        if spec is None:
            return None
        path = spec.submodule_search_locations
    return spec


def code_modules(kind: StageKind) -> list[str]:
    """The stage module and every project module it (transitively) imports, sorted."""
    seen: set[str] = set()
    todo = [kind.run.__module__]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name.split(".")[0] in PROJECT_PACKAGES or name == kind.run.__module__:
            todo.extend(_project_imports(name))
    return sorted(seen)


def code_digest(kind: StageKind) -> str:
    """Version of a kind's code: its declared versions plus the source of its module and of every
    project module it imports — edit any of them and the stage's cache key changes."""
    h = hashlib.sha256()
    h.update(f"{kind.name}\0{kind.version}\0{kind.schema_version}\0".encode())
    for name in code_modules(kind):
        try:
            source = _module_source(name)
        except (OSError, TypeError, ImportError):
            source = ""
        h.update(name.encode() + b"\0" + source.encode() + b"\0")
    return h.hexdigest()


def describe_markdown() -> str:
    """Reference of every built-in stage kind, generated from the registry and the params models
    (docs/stages.md is this output; a test keeps it current)."""
    lines = ["# Stage reference", "",
             "Generated by `hylight stages --markdown` from the params models; do not edit by hand.", ""]
    for name in BUILTIN_STAGES:
        kind = resolve(name)
        lines += [f"## `{name}`", "", kind.doc, ""]
        ins = ", ".join(f"`{r}` ({s.type_name}{', many' if s.many else ''}{', optional' if not s.required else ''})"
                        for r, s in kind.inputs.items()) or "none"
        lines += [f"- inputs: {ins}", f"- output artifact type: `{kind.produces}`",
                  f"- module: `{kind.run.__module__}`", "",
                  "| param | type | default | meaning |", "| --- | --- | --- | --- |"]
        for pname, f in kind.params.model_fields.items():
            default = f.default_factory() if f.default_factory else f.default
            ann = getattr(f.annotation, "__name__", None) if isinstance(f.annotation, type) else None
            ann = (ann or str(f.annotation).replace("typing.", "")).replace("|", "\\|")
            desc = (f.description or "").replace("|", "\\|").replace("\n", " ")
            lines.append(f"| `{pname}` | `{ann}` | `{default!r}` | {desc} |")
        lines.append("")
    return "\n".join(lines)
