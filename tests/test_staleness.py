"""The limits derived from ``max_staleness`` (grpo_core/staleness.py), and that nothing else derives them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from grpo_core.config import AsyncGRPOConfig, ConfigError
from grpo_core.rollout.scheduler import sample_budget
from grpo_core.staleness import resident_adapters, samples_ahead, versions_in_flight

ROOT = Path(__file__).resolve().parent.parent


def test_versions_in_flight_counts_the_current_version_and_the_stale_ones():
    assert [versions_in_flight(s) for s in (0, 1, 4)] == [1, 2, 5]


def test_resident_adapters_hold_the_window_and_the_next_version():
    assert [resident_adapters(s) for s in (0, 1, 4)] == [2, 3, 6]


def test_negative_staleness_is_refused_where_the_config_is_built():
    """The one check of the value: every function here takes a config's ``max_staleness`` as given."""
    with pytest.raises(ConfigError, match="max_staleness"):
        AsyncGRPOConfig(max_staleness=-1)


def test_samples_ahead_is_one_push_of_samples_per_version_in_flight():
    # versions in flight x steps per push x samples per step
    assert samples_ahead(0, 1, 64) == 64  # synchronous: the next step's rollouts wait for the last push
    assert samples_ahead(2, 1, 64) == 3 * 64
    assert samples_ahead(4, 3, 10) == 5 * 3 * 10


@pytest.mark.parametrize("settings", [
    dict(max_staleness=0),
    dict(max_staleness=2, per_device_train_batch_size=64),
    dict(max_staleness=4, weight_sync_steps=3, gradient_accumulation_steps=2, per_device_train_batch_size=8),
])
def test_the_queue_bound_is_one_value(settings):
    """The scheduler admits groups within the same bound that caps rollouts in flight by default."""
    config = AsyncGRPOConfig(**settings)
    for processes in (1, 2):
        per_step = config.per_device_train_batch_size * config.gradient_accumulation_steps * processes
        bound = samples_ahead(config.max_staleness, config.weight_sync_steps, per_step)
        assert sample_budget(config, processes) == bound
        assert config.resolved_max_concurrent_rollouts(processes) == bound
    assert AsyncGRPOConfig(**settings, max_concurrent_rollouts=3).resolved_max_concurrent_rollouts(2) == 3


def _names_max_staleness(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "max_staleness") or (
        isinstance(node, ast.Attribute) and node.attr == "max_staleness")


# What staleness.py's own functions return: a product of one of them is a limit derived outside it.
DERIVED = ("versions_in_flight", "resident_adapters", "samples_ahead")


def _derived_from_staleness(node: ast.AST) -> bool:
    return _names_max_staleness(node) or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name | ast.Attribute)
        and (node.func.id if isinstance(node.func, ast.Name) else node.func.attr) in DERIVED)


def arithmetic_on_max_staleness(source: str, filename: str) -> list[int]:
    """Lines of ``source`` that compute with ``max_staleness`` in code (docstrings do not count): add to it, subtract
    from it, multiply it or a limit derived from it (the queue's bound), or clamp it with ``max``/``min``."""
    lines = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub):
            if _names_max_staleness(node.left) or _names_max_staleness(node.right):
                lines.append(node.lineno)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            if _derived_from_staleness(node.left) or _derived_from_staleness(node.right):
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("max", "min"):
            if any(_names_max_staleness(arg) for arg in node.args):
                lines.append(node.lineno)
    return sorted(set(lines))


def test_the_scan_finds_a_derived_limit_written_out():
    assert arithmetic_on_max_staleness("n = config.max_staleness + 2\nm = 1 + max_staleness\n", "x.py") == [1, 2]
    assert arithmetic_on_max_staleness('"""max_staleness + 1 versions"""\n', "x.py") == []
    # The two queue bounds this module replaced: a clamped staleness times the batch, and versions times the batch.
    assert arithmetic_on_max_staleness("a = max(self.max_staleness, 1) * b\n", "x.py") == [1]
    assert arithmetic_on_max_staleness("a = versions_in_flight(c.max_staleness) * w * s\n", "x.py") == [1]
    assert arithmetic_on_max_staleness("a = min(samples_ahead(s, w, n), cap)\nb = c.max_staleness\n", "x.py") == []


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
