"""The layout is the architecture: every project import (at module level or inside a function) points down.

    pipeline, kernels  <  model  <  data  <  pretrain  <  posttrain  <  evaluation

``pipeline`` knows Ray, the cache and MLflow and finds stage modules by name (``pipeline/registry.py``), never by
import; ``model`` and ``kernels`` are libraries (no DeepSpeed, Ray, MLflow or pipeline); ``kernels`` imports only
itself. No module is ranked apart from its package: the eval sets that pretraining's in-training probe shares with
the eval stage (so that a training curve and an eval report measure the same thing) live in ``data/eval_tasks.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANK = {"pipeline": 0, "kernels": 0, "model": 1, "data": 2, "pretrain": 3, "posttrain": 4, "evaluation": 5}
MODULE_RANK: dict[str, int] = {}  # module -> rank, for a module that must rank apart from its package (none now)
LIBRARY_FORBIDDEN = ("deepspeed", "ray", "mlflow", "pipeline")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in RANK:
        for f in (ROOT / pkg).rglob("*.py"):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            out[name] = f
    return out


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) of every absolute import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(node.module, node.lineno, id(node) in top)]
            out += [(f"{node.module}.{a.name}", node.lineno, id(node) in top) for a in node.names]
    return out


def _rank(module: str) -> int | None:
    for name, rank in MODULE_RANK.items():
        if module == name or module.startswith(name + "."):
            return rank
    return RANK.get(module.split(".")[0])


def _project_target(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def test_every_project_import_points_down_the_layers() -> None:
    modules = _modules()
    upward = []
    for name, path in modules.items():
        for imported, line, _ in _imports(path):
            target = _project_target(imported, modules)
            if target is None or target.split(".")[0] == name.split(".")[0] and target not in MODULE_RANK \
                    and name not in MODULE_RANK:
                continue  # not ours, or within one package (the two evaluation leaves are checked like packages)
            if _rank(target) > _rank(name):
                upward.append(f"{path.relative_to(ROOT)}:{line}: {name} imports {target}")
    assert not upward, "imports that point up the layers:\n" + "\n".join(sorted(set(upward)))


def test_the_libraries_import_no_distributed_tracking_or_pipeline_code() -> None:
    found = []
    for name, path in _modules().items():
        if name.split(".")[0] not in ("model", "kernels"):
            continue
        for imported, line, _ in _imports(path):
            root = imported.split(".")[0]
            if root in LIBRARY_FORBIDDEN or name.startswith("kernels") and root in ("model",):
                found.append(f"{path.relative_to(ROOT)}:{line}: {imported}")
    assert not found, "model/ and kernels/ are libraries:\n" + "\n".join(sorted(set(found)))


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports (at module level or inside a function); a package's own
    ``__init__`` importing its submodules, or a submodule its package, is not an edge."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for imported, _, _ in _imports(path):
            target = _project_target(imported, modules)
            if target and target != name and not name.startswith(target + "."):
                graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, successors = work[-1]
            w = next(successors, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out)


def test_no_project_module_imports_itself_in_a_circle() -> None:
    """No import cycle between modules, function-level imports included: a lazy import may avoid the cost of a
    heavy or optional module, never hide a circle."""
    cycles = _cycles(_import_graph(_modules()))
    assert not cycles, "modules that import each other in a circle:\n" + "\n".join(
        " <-> ".join(component) for component in cycles)


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch) -> None:
    """The check itself: a model module that imports pipeline, a pretrain module that imports posttrain, or two
    data modules that import each other (one of them inside a function), is reported (so an empty report means
    something)."""
    fake = tmp_path
    for pkg in RANK:
        (fake / pkg).mkdir()
        (fake / pkg / "__init__.py").write_text("")
    (fake / "model" / "bad.py").write_text("def f():\n    from pipeline import stage\n")
    (fake / "pretrain" / "up.py").write_text("from posttrain.sft import run\n")
    (fake / "posttrain" / "sft.py").write_text("")
    (fake / "data" / "eval_tasks.py").write_text("from pretrain import up\n")
    (fake / "data" / "one.py").write_text("from data.two import X\n")
    (fake / "data" / "two.py").write_text("X = 1\n\n\ndef f():\n    from data import one\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", fake)
    for test, needle in ((test_every_project_import_points_down_the_layers, "pretrain.up imports posttrain.sft"),
                         (test_every_project_import_points_down_the_layers, "data.eval_tasks imports pretrain.up"),
                         (test_the_libraries_import_no_distributed_tracking_or_pipeline_code, "pipeline"),
                         (test_no_project_module_imports_itself_in_a_circle, "data.one <-> data.two")):
        try:
            test()
        except AssertionError as e:
            assert needle in str(e), str(e)
        else:
            raise AssertionError(f"{test.__name__} missed: {needle}")


def _unexplained_function_imports(path: Path, root: Path = ROOT) -> list[str]:
    """Function-level imports of ``path`` with no reason: no comment on the import's lines or on the line above, and
    not inside a ``try`` (an optional import, whose ``except ImportError`` says what happens without it)."""
    src = path.read_text(encoding="utf-8")
    lines = src.splitlines()
    tree = ast.parse(src)
    guarded = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) for b in t.body for n in ast.walk(b)}
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if not isinstance(node, ast.Import | ast.ImportFrom) or id(node) in guarded:
                continue
            if not any("#" in t for t in lines[node.lineno - 1:node.end_lineno]) and not _explained_above(
                    lines, node.lineno - 1):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return found


def _explained_above(lines: list[str], i: int) -> bool:
    """A comment line just above line ``i``, or a comment on an import of the block of imports it continues."""
    j = i - 1
    while j >= 0 and lines[j].strip().startswith(("import ", "from ")):
        if "#" in lines[j]:
            return True
        j -= 1
    return j >= 0 and lines[j].strip().startswith("#")


def test_every_function_level_import_says_why() -> None:
    """Issue 24 item 5: an import inside a function hides an edge of the import graph, so it is there only for a
    reason (a heavy or optional library, start-up time, the sandboxed child) that a comment names."""
    found = [f for p in sorted(_modules().values()) for f in _unexplained_function_imports(p)]
    assert not found, "function-level imports without a reason comment:\n" + "\n".join(found)


def test_the_reason_checker_flags_a_bare_function_import(tmp_path) -> None:
    f = tmp_path / "m.py"
    f.write_text("def a():\n    import json\n\n\ndef b():\n    import json  # heavy: nothing\n    import os\n\n\n"
                 "def c():\n    try:\n        import json\n    except ImportError:\n        pass\n\n\n"
                 "def d():\n    x = 1\n    import os\n")
    assert _unexplained_function_imports(f, tmp_path) == ["m.py:2: import json", "m.py:19: import os"]
