"""The project's import graph read from its source: every ``grpo_core`` and ``flows`` import, at module level or
inside a function (deferred), with where it stands. ``tests/test_import_graph.py`` checks its shape (no circle,
no arrow up the package order of ``docs/layout.md``), ``tests/test_deferred_imports.py`` which imports are deferred.

An import made only for type checkers (under ``if TYPE_CHECKING:``) never runs and is left out. An import of
``a.b.c`` is an arrow to that module only: the package faces Python runs on the way (``a/__init__.py``) are not
arrows, as a face hands names on (``tests/test_vllm_plugin_imports.py`` checks the faces the plugin passes).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("grpo_core", "flows")


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    function: str | None
    """The qualified name of the function the import sits in; None at module level."""

    @property
    def deferred(self) -> bool:
        return self.function is not None


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for package in PACKAGES if (root / package).is_dir()
            for p in sorted((root / package).rglob("*.py"))}


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is a module of the project (``a.b.attr`` -> ``a.b``)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in known:
            return ".".join(parts)
        parts.pop()
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str, path: Path, known: dict[str, Path]) -> list[Import]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, scope: str, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:
                    visit_one(sub, scope, function)
                continue
            visit_one(child, scope, function)

    def visit_one(child: ast.AST, scope: str, function: str | None) -> None:
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            inner = f"{scope}.{child.name}" if scope else child.name
            is_function = not isinstance(child, ast.ClassDef)
            visit(child, inner, inner if is_function or function else None)
            return
        names: list[str] = []
        if isinstance(child, ast.Import):
            names = [alias.name for alias in child.names]
        elif isinstance(child, ast.ImportFrom):
            base = child.module or ""
            if child.level:
                parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in child.names]
        for target in sorted({t for t in (_resolve(n, known) for n in names) if t and t != module}):
            found.append(Import(module, target, child.lineno, function))
        if not isinstance(child, ast.Import | ast.ImportFrom):
            visit(child, scope, function)

    visit(ast.parse(path.read_text(), str(path)), "", None)
    return found


def all_imports(root: Path = ROOT) -> list[Import]:
    known = modules(root)
    return [imp for module, path in known.items() for imp in imports_of(module, path, known)]


# ---- the package order ----------------------------------------------------------------------------
def layers(layout: Path) -> list[list[str]]:
    """The rows of ``docs/layout.md``'s table, top first, each as the names it gives: a folder as ``grpo_core.tiny.``
    (every module under it), a file as ``grpo_core.config`` (that module alone). ``flows/``, on top by the page's
    rule, comes first whatever its row's place."""
    rows: list[list[str]] = []
    for line in layout.read_text().splitlines():
        if not line.startswith("| `"):
            continue
        names = re.findall(r"`([^`]+)`", line.split("|")[1])
        folder = names[0].rpartition("/")[0] if "/" in names[0].rstrip("/") else ""
        row = []
        for name in names:
            if "/" not in name.rstrip("/") and folder:
                name = f"{folder}/{name}"  # `config_sections.py` beside `grpo_core/config.py`
            if name.endswith("/"):
                row.append(name.replace("/", "."))
            else:
                row.append(name.removesuffix(".py").removesuffix("/__init__").replace("/", "."))
        if any(n.split(".")[0] in PACKAGES for n in row):
            rows.append(row)
    flows = [r for r in rows if r == ["flows."]]
    return flows + [r for r in rows if r != ["flows."]]


def layer_of(module: str, rows: list[list[str]]) -> int | None:
    """The index of the row that names ``module`` (None where none does): the file itself, or its folder."""
    for index, row in enumerate(rows):
        for name in row:
            if module == name or module == name.rstrip(".") or (name.endswith(".") and module.startswith(name)):
                return index
    return None


def circles(edges: list[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        group.append(top)
                        if top == node:
                            break
                    if len(group) > 1:
                        found.append(sorted(group))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found
