"""Imports of the project's own modules inside functions, each with the reason it is deferred; any other fails.

A deferred import hides an arrow of the import graph from whoever reads a module's head, so one is kept only where
importing at module level would cost something real: a package that is optional (Triton, vLLM, the environments'
ecosystems), or a process that must start before it loads what the import brings (the ``grpo`` command, the
training process's job check, the rollout process's heartbeat, the processes of a vLLM server). Everything else
is imported at the top of its module.
"""

from __future__ import annotations

from pathlib import Path

from tests.import_graph import all_imports

_GRPO_COMMAND = ("the grpo command loads what a subcommand runs when it runs it: --help and `grpo ui` answer without "
                 "importing Prefect (flows.train_flow takes seconds) or the job's pydantic models")
_JOB_FIRST = ("python -m grpo_core.launch parses and checks the job file before importing torch and the trainer, so a "
              "bad job fails in a second (its docstring)")
_PLUGIN = ("vLLM loads the plugin in every one of its processes (API server, engine core, workers); the rendezvous "
           "and the storage patch reader load only in the worker that receives weights")
_TINY_PATH = ("build_tiny_model answers a cached model's folder without importing torch and transformers; only a "
              "build loads them (every test session and the demo ask for the folder)")

ALLOWED: dict[tuple[str, str], str] = {
    # optional packages
    ("grpo_core.models.attention.short_conv", "grpo_core.models.attention.tree_conv_triton"):
        "Triton is optional; its backend is chosen only where its probe imports and runs it (probe_failure)",
    ("grpo_core.environments", "grpo_core.environments.verifiers_tasksets"):
        "verifiers is an optional ecosystem (the environments extra), imported only when a run names it",
    ("grpo_core.environments", "grpo_core.environments.reasoning_gym_tasks"):
        "reasoning-gym is an optional ecosystem (the environments extra), imported only when a run names it",
    ("grpo_core.sync.protocol", "grpo_core.sync.send.nccl_trainer"):
        "only the backend the run uses loads its engine; the NCCL one needs vLLM's NCCL engine (a CUDA build)",
    # processes that start before they load what the import brings
    ("grpo_core.launch.__main__", "grpo_core.ranks"): _JOB_FIRST,
    ("grpo_core.launch.__main__", "grpo_core.tracking.tracker"): _JOB_FIRST,
    ("grpo_core.launch.__main__", "grpo_core.training.collector"): _JOB_FIRST,
    ("grpo_core.launch.__main__", "grpo_core.training.trainer"): _JOB_FIRST,
    ("grpo_core.launch.__main__", "grpo_core.checkpoint"): _JOB_FIRST,
    ("grpo_core.rollout.worker", "grpo_core.rollout.scheduler"):
        "the spawned rollout process imports worker.py to start; its heartbeat thread beats while _run loads the "
        "scheduler and the reward code (seconds on a loaded machine), which at module level would run before it",
    ("grpo_core.vllm_plugin.gloo_engine", "grpo_core.sync.wire.address"): _PLUGIN,
    ("grpo_core.vllm_plugin.gloo_engine", "grpo_core.sync.wire.gated_store"): _PLUGIN,
    ("grpo_core.vllm_plugin.receiver", "grpo_core.storage.store"): _PLUGIN,
    ("grpo_core.vllm_plugin.receiver", "grpo_core.sync.wire.patch_store"): _PLUGIN,
    ("grpo_core.tiny.build", "grpo_core.tiny.tokenizer"): _TINY_PATH,
    ("grpo_core.tiny.build", "grpo_core.tiny.warmup"): _TINY_PATH,
    ("grpo_core.tiny.build", "grpo_core.tiny.evaluate"): _TINY_PATH,
    ("flows.cli", "flows.train_flow"): _GRPO_COMMAND,
    ("flows.cli", "flows.deploy"): _GRPO_COMMAND,
    ("flows.cli", "flows.heldout"): _GRPO_COMMAND,
    ("flows.cli", "grpo_core.launch.job"): _GRPO_COMMAND,
    ("flows.cli", "grpo_core.tracking.run_view"): _GRPO_COMMAND,
    ("flows.cli", "grpo_core.tracking.ui"): _GRPO_COMMAND,
}
"""``(importer, imported)``: why the importer imports it inside a function."""


def deferred(root: Path | None = None) -> dict[tuple[str, str], list[str]]:
    """Each deferred ``(importer, imported)`` pair of the tree, with the ``function:line`` places it is made."""
    found: dict[tuple[str, str], list[str]] = {}
    for imp in all_imports(root) if root else all_imports():
        if imp.deferred:
            found.setdefault((imp.importer, imp.imported), []).append(f"{imp.function}:{imp.line}")
    return found


def test_only_the_listed_imports_are_deferred():
    found = deferred()
    unlisted = {f"{a} -> {b}": places for (a, b), places in found.items() if (a, b) not in ALLOWED}
    assert not unlisted, ("import these at the top of their module, or list them in ALLOWED with the reason they "
                          f"must wait (a package that is optional, a process that must start first): {unlisted}")


def test_every_listed_import_is_still_deferred():
    stale = sorted(f"{a} -> {b}" for a, b in set(ALLOWED) - set(deferred()))
    assert not stale, f"no longer deferred (or gone): remove them from ALLOWED: {stale}"


def test_every_reason_is_written_out():
    assert all(len(reason) > 40 for reason in ALLOWED.values())


def test_the_scan_finds_a_deferred_import(tmp_path):
    (tmp_path / "grpo_core").mkdir()
    (tmp_path / "grpo_core" / "__init__.py").write_text("")
    (tmp_path / "grpo_core" / "a.py").write_text(
        "import grpo_core.b\n\nclass A:\n    def f(self):\n        from grpo_core.b import x\n")
    (tmp_path / "grpo_core" / "b.py").write_text("x = 1\n")
    assert deferred(tmp_path) == {("grpo_core.a", "grpo_core.b"): ["A.f:5"]}
