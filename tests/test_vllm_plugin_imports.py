"""The package vLLM loads in its own processes imports nothing of the trainer side.

Walks ``grpo_core.vllm_plugin``'s imports transitively from the source (every ``import`` statement, at
module level or inside a function, and the ``__init__.py`` of each package a module sits in, which
Python runs first) and fails on any ``grpo_core`` module outside what the server side may load.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = "grpo_core.vllm_plugin"
# What both sides share: the wire formats, storage (patches are read from it), the retry policy it uses, and what
# differs between the supported vLLM lines (the plugin adds routes a 0.25 server lacks).
SHARED = ("grpo_core.sync.wire", "grpo_core.storage", "grpo_core.retry", "grpo_core.vllm_lines", "grpo_core.vllm_types")
# Package faces Python runs on the way to a shared module; each is checked to define and import nothing.
FACES = ("grpo_core", "grpo_core.sync")


def _source(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imports(module: str, path: Path) -> set[str]:
    """The ``grpo_core`` modules ``path`` imports (``from a import b`` counts ``a.b`` where it is a module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if _source(f"{base}.{alias.name}"))
    return {name for name in found if name == "grpo_core" or name.startswith("grpo_core.")}


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def plugin_closure() -> dict[str, str]:
    """Every ``grpo_core`` module the plugin package reaches, each with the module that first imported it."""
    roots = [PLUGIN] + [f"{PLUGIN}.{p.stem}" for p in sorted((ROOT / "grpo_core" / "vllm_plugin").glob("*.py"))
                        if p.stem != "__init__"]
    reached = {name: "(root)" for name in roots}
    todo = list(roots)
    while todo:
        module = todo.pop()
        path = _source(module)
        assert path is not None, f"{module} (imported by {reached[module]}) has no source under grpo_core/"
        # A face's own imports are type-checking-only or lazy (test_package_faces_on_the_way_import_nothing).
        imported = set() if module in FACES else _imports(module, path)
        for name in imported | set(_parents(module)):
            if name not in reached:
                reached[name] = module
                todo.append(name)
    return reached


def _allowed(module: str) -> bool:
    return module in FACES or any(module == p or module.startswith(p + ".") for p in (PLUGIN, *SHARED))


def test_plugin_imports_nothing_trainer_side():
    reached = plugin_closure()
    wrong = {m: by for m, by in reached.items() if not _allowed(m)}
    assert not wrong, f"the vLLM-side package reaches trainer-side modules (module <- importer): {wrong}"
    # The walk must have followed something: the engine, the receiver and the wire formats it decodes.
    assert {f"{PLUGIN}.gloo_engine", f"{PLUGIN}.receiver", "grpo_core.sync.wire.delta",
            "grpo_core.storage.store"} <= set(reached)


def test_package_faces_on_the_way_import_nothing():
    """``grpo_core/__init__.py`` and ``grpo_core/sync/__init__.py`` run first in every vLLM process."""
    for face in FACES:
        path = _source(face)
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom) and n.module != "__future__"]
        assert all(n.module in ("typing",) for n in top if isinstance(n, ast.ImportFrom)), face
        assert not [n for n in top if isinstance(n, ast.Import)], face


def test_walk_catches_a_trainer_import(tmp_path, monkeypatch):
    """The walk itself: a module that imports the trainer inside a function is caught."""
    pkg = tmp_path / "grpo_core" / "vllm_plugin"
    pkg.mkdir(parents=True)
    (tmp_path / "grpo_core" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "engine.py").write_text("def f():\n    from grpo_core.training import trainer\n")
    (tmp_path / "grpo_core" / "training").mkdir()
    (tmp_path / "grpo_core" / "training" / "__init__.py").write_text("")
    (tmp_path / "grpo_core" / "training" / "trainer.py").write_text("")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    reached = plugin_closure()
    assert "grpo_core.training.trainer" in reached and not _allowed("grpo_core.training.trainer")


def test_entry_point_names_the_plugin_package():
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    targets = {value.split(":")[0] for value in entry.values()}
    assert targets == {f"{PLUGIN}.entry_point"}, targets
