"""The import graph's shape, imports inside functions included: no circle, and no arrow up the package order.

The order is the table of ``docs/layout.md`` (``flows/`` on top, each package above those listed after it); every
module of ``grpo_core`` and ``flows`` must fall under one of its rows. ``tests/test_vllm_plugin_imports.py`` checks
the stricter boundary of the package vLLM loads.
"""

from __future__ import annotations

from pathlib import Path

from tests.import_graph import ROOT, Import, all_imports, circles, layer_of, layers, modules

LAYOUT = ROOT / "docs" / "layout.md"


def upward(imports: list[Import], rows: list[list[str]]) -> list[str]:
    """``importer -> imported`` for each import of a package listed above the importer's."""
    return [f"{i.importer}:{i.line} -> {i.imported}" for i in imports
            if layer_of(i.importer, rows) is not None and layer_of(i.imported, rows) is not None
            and layer_of(i.importer, rows) > layer_of(i.imported, rows)]


def test_no_circle_with_deferred_imports():
    imports = all_imports()
    assert any(i.deferred for i in imports) and len(imports) > 300  # the walk read the tree, functions included
    found = circles([(i.importer, i.imported) for i in imports])
    assert not found, f"modules that import each other (deferred imports included): {found}"


def test_every_module_has_a_row_in_the_layout():
    rows = layers(LAYOUT)
    assert rows[0] == ["flows."] and ["grpo_core.sync."] in rows
    missing = sorted(m for m in modules() if layer_of(m, rows) is None)
    assert not missing, f"give these a row in docs/layout.md's table (the package order): {missing}"


def test_nothing_imports_a_package_above_it():
    wrong = upward(all_imports(), layers(LAYOUT))
    assert not wrong, f"imports up the package order of docs/layout.md (importer -> imported): {wrong}"


def _package(root: Path, files: dict[str, str]) -> None:
    """A ``grpo_core`` package under ``root`` with ``files`` (paths below it)."""
    for name, text in files.items():
        path = root / "grpo_core" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checks_find_a_hidden_circle_and_an_upward_import(tmp_path):
    """The walk itself: a circle closed only inside a function, and a lower package importing a higher one."""
    _package(tmp_path, {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "from grpo_core.low.b import x\n",
        "low/b.py": "def f():\n    from grpo_core.low import a\n",
        "low/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from grpo_core.high import h\n",
        "high/__init__.py": "",
        "high/h.py": "",
        "low/d.py": "def g():\n    import grpo_core.high.h\n",
    })
    (tmp_path / "layout.md").write_text("| `grpo_core/high/` | h |\n| `grpo_core/low/` | l |\n")
    imports = all_imports(tmp_path)
    assert circles([(i.importer, i.imported) for i in imports]) == [["grpo_core.low.a", "grpo_core.low.b"]]
    # c's import is for type checkers only (it never runs); d's runs when g is called.
    assert upward(imports, layers(tmp_path / "layout.md")) == ["grpo_core.low.d:2 -> grpo_core.high.h"]
