"""The limits derived from ``max_staleness`` (grpo_core/staleness.py), and that nothing else derives them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from grpo_core.staleness import resident_adapters, versions_in_flight

ROOT = Path(__file__).resolve().parent.parent


def test_versions_in_flight_counts_the_current_version_and_the_stale_ones():
    assert [versions_in_flight(s) for s in (0, 1, 4)] == [1, 2, 5]


def test_resident_adapters_hold_the_window_and_the_next_version():
    assert [resident_adapters(s) for s in (0, 1, 4)] == [2, 3, 6]


def test_negative_staleness_is_refused():
    with pytest.raises(ValueError, match="max_staleness"):
        versions_in_flight(-1)


def _names_max_staleness(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "max_staleness") or (
        isinstance(node, ast.Attribute) and node.attr == "max_staleness")


def arithmetic_on_max_staleness(source: str, filename: str) -> list[int]:
    """Lines of ``source`` that add to or subtract from ``max_staleness`` in code (docstrings do not count)."""
    return [node.lineno for node in ast.walk(ast.parse(source, filename))
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub)
            and (_names_max_staleness(node.left) or _names_max_staleness(node.right))]


def test_the_scan_finds_a_derived_limit_written_out():
    assert arithmetic_on_max_staleness("n = config.max_staleness + 2\nm = 1 + max_staleness\n", "x.py") == [1, 2]
    assert arithmetic_on_max_staleness('"""max_staleness + 1 versions"""\n', "x.py") == []


def test_each_derived_limit_has_one_definition():
    """Only grpo_core/staleness.py turns ``max_staleness`` into a count; every other module asks it."""
    found = {}
    for folder in ("grpo_core", "flows", "benchmarks", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            lines = arithmetic_on_max_staleness(path.read_text(), rel)
            if lines and rel != "grpo_core/staleness.py":
                found[rel] = lines
    assert not found, f"derive these from grpo_core.staleness instead: {found}"
    assert arithmetic_on_max_staleness((ROOT / "grpo_core/staleness.py").read_text(), "staleness.py")
