"""The stage-kind registry: the one place that maps a spec's ``uses:`` to a stage module.

Built-in kinds are named here and imported lazily (validating a spec should not import torch for a
data-only DAG). A spec may also name a plugin kind by import path, ``uses: my_pkg.stages:MY_STAGE``.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import inspect
import sys

from pipeline.stage import StageKind

# kind name -> module exposing STAGE (one source of truth for what `uses:` accepts)
BUILTIN_STAGES: dict[str, str] = {
    "ingest": "data.ingest",
    "tokenizer": "data.tokenizer",
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


def code_digest(kind: StageKind) -> str:
    """Version of a kind's code: its declared version plus the source of the module defining run()."""
    module = sys.modules[kind.run.__module__]
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        source = ""
    h = hashlib.sha256()
    h.update(f"{kind.name}\0{kind.version}\0{kind.schema_version}\0".encode())
    h.update(source.encode())
    return h.hexdigest()
