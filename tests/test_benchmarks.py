"""Every benchmark script runs: its CPU smoke mode, on the tiny models, writes a report with its provenance.

A benchmark reaches the library the way a user does, so a change to the library that breaks a benchmark fails
here, not on the next GPU run. ``SMOKES`` names each script's smoke command; a script under ``benchmarks/``
that is in none of ``SMOKES``, ``RUN_BY`` (a helper another smoke starts or imports) and ``LIBRARY`` fails
``test_every_benchmark_has_a_smoke``. Scripts that read a running vLLM server get the session's server
(``--server-url``); the others need no server and run in the fast tier.

The smokes run in children of one fork server that imported torch, transformers and the trainer once: on two
cores a fresh interpreter spends seconds of CPU on those imports, per script.

    .venv/bin/python -m pytest -q -m benchmark tests/test_benchmarks.py
"""

from __future__ import annotations

import ast
import json
import multiprocessing
import os
import resource
import runpy
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"

pytestmark = pytest.mark.benchmark


@dataclass(frozen=True)
class Smoke:
    """One script's smoke run: ``python -m MODULE *argv`` from the repository root."""

    argv: tuple[str, ...] = ("--smoke",)
    """Arguments; ``--out`` (a file in the test's folder) is added where ``writes`` is true."""
    writes: bool = True
    """Whether the script takes ``--out`` and writes a JSON report there (the device checks only print)."""
    server: bool = False
    """Whether it reads a running server: it gets ``--server-url`` of the session's server."""
    timeout_s: float = 900
    """Wall-clock bound: the slowest smoke takes under a minute on two idle cores, and several on a shared machine."""
    failures: Callable[[Any], list[str]] | None = None
    """What went wrong inside a run that the script records instead of raising (a subprocess that failed, say)."""
    broken: str | None = None
    """Why the script fails today, where it does: the smoke is a strict xfail (it fails the run once it passes, so
    the mark goes when the script is mended)."""


def run_errors(*names: str) -> Callable[[Any], list[str]]:
    """The ``error`` of each run under ``report["runs"]`` (of those ``names``, where given)."""

    def errors(report: Any) -> list[str]:
        runs = report.get("runs", {})
        items = runs.items() if isinstance(runs, dict) else enumerate(runs)
        return [f"{k}: {r['error'][:300]}" for k, r in items
                if (not names or k in names) and isinstance(r, dict) and r.get("error")]

    return errors


def runs_with_steps(report: Any) -> list[str]:
    """Runs that failed or recorded no step (a contender whose step hook was never called)."""
    return [f"{r.get('name')}: {r.get('error') or 'no step recorded'}"[:300] for r in report.get("runs", [])
            if r.get("error") or not r.get("steps")]


SMOKES: dict[str, Smoke] = {
    "benchmarks.device.check_logprob_grad": Smoke(writes=False),
    "benchmarks.models.logprob_kernels": Smoke(),
    "benchmarks.models.grad_accumulation": Smoke(),
    "benchmarks.device.check_split_kernels": Smoke(writes=False),
    "benchmarks.models.logprob_head": Smoke(),
    "benchmarks.models.moe_experts": Smoke(),
    "benchmarks.models.moe_training": Smoke(("--smoke", "--steps", "1")),
    "benchmarks.models.qwen35_speed": Smoke(("--smoke", "--steps", "1", "--warmup", "0", "--gdn-kernels", "triton,flash_qla",
                                             "--gdn-convs", "torch,auto", "--experts", "grouped_mm,grpo_grouped_mm",
                                             "--graph-breaks", "nested,outer", "--weight-gathers", "per_pass,per_step")),
    "benchmarks.packing.gather_grad_sum": Smoke(),
    "benchmarks.packing.gdn_tree_packing": Smoke(("--smoke", "--repeats", "1")),
    "benchmarks.packing.tree_packing": Smoke(("--smoke", "--repeats", "1", "--heads", "fused")),
    "benchmarks.sync.fleet_push": Smoke(),
    # Two trainer ranks (gloo) and a receiver process: the distributed gather and the bucketed send.
    "benchmarks.sync.nccl_sync": Smoke(("--smoke", "--trainer-ranks", "2", "--repeats", "1", "--warmup", "0", "--bw-iters", "1",
                                        "--variants", "bucketed:64,per_param"),
                                       failures=run_errors()),
    "benchmarks.sync.sparse_push_gpu": Smoke(),
    "benchmarks.sync.sparse_share": Smoke(),
    "benchmarks.sync.sync_projection": Smoke(),
    "benchmarks.sync.lora_sync": Smoke(server=True),
    "benchmarks.sync.probe_rounding": Smoke(server=True),
    "benchmarks.sync.weight_sync_trust": Smoke(server=True),
    # Eager against the fp64 reference: each compiled mode costs a minute or two of CPU to compile (129 s for layers).
    "benchmarks.trainer.compile_numerics": Smoke(("--smoke", "--modes", "eager")),
    "benchmarks.trainer.fsdp_mfu": Smoke(("--smoke", "--configs", "16384:ac,16384:ac:freemb", "--mismatch-metrics", "both")),
    "benchmarks.trainer.trainer_loop": Smoke(("launch", "--smoke"), failures=run_errors()),
    "benchmarks.trainer.mismatch_cost": Smoke(),
    "benchmarks.trainer.cpu_share": Smoke(server=True, failures=run_errors()),
    "benchmarks.staleness.eval_beside": Smoke(server=True),
    "benchmarks.rollout.fleet_throughput": Smoke(server=True),
    "benchmarks.rollout.rollout_throughput": Smoke(server=True),
    "benchmarks.rollout.sampler_logprobs": Smoke(server=True),
    "benchmarks.rollout.server_start": Smoke(server=True),
    # The session server serves the arithmetic weights, which call no tool: the smoke shows the rollout loop runs on
    # both paths; tests/integration/test_token_path.py counts episodes on the tools model's weights.
    "benchmarks.rollout.token_path_mismatch": Smoke(server=True, failures=lambda report: [
        f"{name}: no rollout drawn" for name, found in report.items()
        if name != "provenance" and not found.get("rollouts")]),
    # TRL's contenders need benchmarks/.venv-trl (TRL is not in the project's lock): ours only in the suite.
    "benchmarks.peers.peer_trl": Smoke(("--smoke", "--contenders", "ours_async,ours_sync"), server=True,
                                       failures=runs_with_steps),
    # TRL's runs need TRL (benchmarks/.venv-trl; not in the project's lock): ours is checked here.
    "benchmarks.peers.peer_trl_gpu": Smoke(failures=run_errors("ours")),
    # The whole-run driver against the session's server: four steps, the trainer killed at step 3 and resumed.
    "benchmarks.device.e2e_gpu": Smoke(("--smoke",), server=True, failures=lambda report: [
        problem for problem, bad in (
            (f"exit {report['run']['exit_code']}", report["run"]["exit_code"] != 0),
            ("the trainer was not killed", not report["run"]["killed"].get("pid")),
            (f"ledger {report.get('ledger')}", (report.get("ledger") or {}).get("attempts") != 2
             or report["ledger"]["prompts_trained_twice_in_final_model"] != 0),
            (f"steps missing from MLflow: {report.get('missing_steps')}", report.get("missing_steps") != []),
            (f"read error {report.get('read_error')}", report.get("read_error") is not None)) if bad]),
}

# Helpers that a smoke above runs (as a subprocess) or imports: covered by that smoke.
RUN_BY: dict[str, str] = {
    "benchmarks.sync.nccl_sync_receiver": "benchmarks.sync.nccl_sync",
    "benchmarks.sync.sparse_push_gpu_receiver": "benchmarks.sync.sparse_push_gpu",
    "benchmarks.peers.peer_trl_contenders": "benchmarks.peers.peer_trl",
    "benchmarks.peers.peer_gpu_runs": "benchmarks.peers.peer_trl_gpu",
    "benchmarks.peers.peer_gpu_stream": "benchmarks.peers.peer_trl_gpu",
    "benchmarks.peers.peer_gpu_probes": "benchmarks.peers.peer_trl_gpu",
    "benchmarks.peers.peer_gpu_report": "benchmarks.peers.peer_trl_gpu",
    "benchmarks.models.qwen35_summary": "benchmarks.models.qwen35_speed",
}

# Shared code and tools that measure nothing: their own tests cover them.
LIBRARY = {"benchmarks.bench_io", "benchmarks.index", "benchmarks.profiling",
           "benchmarks.device.cuda_carry",  # the packed GPU set's lists and check (tests/test_cuda_install.py)
           "benchmarks.staleness.long_tail"}  # the long-tailed task of scripts/staleness_runs.py (tests/test_waste.py)


def benchmark_modules() -> list[str]:
    return sorted(".".join(p.relative_to(REPO).with_suffix("").parts) for p in BENCHMARKS.rglob("*.py")
                  if p.name != "__init__.py" and "results" not in p.parts)


def test_every_benchmark_has_a_smoke() -> None:
    modules = benchmark_modules()
    missing = [m for m in modules if m not in SMOKES and m not in RUN_BY and m not in LIBRARY]
    assert not missing, f"benchmarks without a smoke run: {missing}; add each to SMOKES in {Path(__file__).name}"
    stale = sorted((set(SMOKES) | set(RUN_BY) | LIBRARY) - set(modules))
    assert not stale, f"smoke entries for scripts that no longer exist: {stale}"


@pytest.mark.parametrize("helper", sorted(RUN_BY))
def test_helpers_are_reached_by_their_smoke(helper: str) -> None:
    """A helper counts as covered only where its runner names it (imports it or starts it as a module)."""
    runner = RUN_BY[helper]
    reached = {runner}
    frontier = [runner]
    while frontier:  # what the runner names, and what those name in turn
        source = (REPO / Path(*frontier.pop().split("."))).with_suffix(".py").read_text()
        for name in benchmark_modules():
            if name not in reached and (name in source or f"import {name.rsplit('.', 1)[1]}" in source):
                reached.add(name)
                frontier.append(name)
    assert helper in reached, f"{helper} is not imported or started by {runner} (nor by what it imports)"


def trainer_subclasses_with_private_overrides(paths: list[Path]) -> list[str]:
    """``file: Class._method`` for each class that derives from ``AsyncGRPOTrainer`` (directly or through another
    class in ``paths``) and defines a single-underscore method: an override of the trainer's internals."""
    trees = {path: ast.parse(path.read_text()) for path in paths}
    classes = [(path, node) for path, tree in trees.items() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]

    def base_names(node: ast.ClassDef) -> set[str]:
        return {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases if isinstance(b, (ast.Name, ast.Attribute))}

    trainers = {"AsyncGRPOTrainer"}
    grew = True
    while grew:
        new = {node.name for _, node in classes if base_names(node) & trainers} - trainers
        trainers |= new
        grew = bool(new)
    found = []
    for path, node in classes:
        if node.name == "AsyncGRPOTrainer" or not base_names(node) & trainers:
            continue
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("_") \
                    and not item.name.startswith("__"):
                where = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
                found.append(f"{where}: {node.name}.{item.name}")
    return found


def test_override_check_finds_a_private_override(tmp_path: Path) -> None:
    """The check itself: an override through a subclass of a subclass is found, a public method and a dunder
    are not."""
    sample = tmp_path / "sample.py"
    sample.write_text("from grpo_core import AsyncGRPOTrainer\n\nclass A(AsyncGRPOTrainer):\n    def run(self): ...\n"
                      "    def __init__(self): ...\n\nclass B(A):\n    def _step(self): ...\n")
    assert trainer_subclasses_with_private_overrides([sample]) == ["sample.py: B._step"]


def test_no_class_outside_the_library_overrides_a_private_trainer_method() -> None:
    paths = sorted([*BENCHMARKS.rglob("*.py"), *(REPO / "tests").rglob("*.py")])
    found = trainer_subclasses_with_private_overrides(paths)
    assert not found, "private trainer methods overridden (use the constructor's public arguments):\n" + "\n".join(found)


def _run_smoke(module: str, argv: list[str], log: str) -> None:
    """In a fork-server child: the script as ``python -m module *argv`` from the repository root, its output
    to ``log``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(REPO)
    sys.path.insert(0, str(REPO))
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    finally:  # CPU seconds of the script and the processes it waited for: the smoke's cost on a shared machine
        own, waited = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        Path(f"{log}.cpu").write_text(str(own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime))


@pytest.fixture(scope="module")
def smoke_context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    # The first transformers model module a process imports brings in the shared modeling code (about 5 s with
    # bytecode cached, 12 s without); imported here once, the smokes' children start with it.
    models = [f"transformers.models.{m}.modeling_{m}" for m in ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe")]
    ctx.set_forkserver_preload(["torch", "transformers", "grpo_core.training.trainer", "benchmarks.bench_io", *models])
    return ctx


def run_smoke(ctx: multiprocessing.context.BaseContext, module: str, smoke: Smoke, tmp_path: Path,
              server_url: str | None) -> Path | None:
    out = tmp_path / f"{module.rsplit('.', 1)[1]}.json"
    argv = [*smoke.argv, *(["--out", str(out)] if smoke.writes else []),
            *(["--server-url", server_url] if server_url else [])]
    log = tmp_path / "smoke.log"
    child = ctx.Process(target=_run_smoke, args=(module, argv, str(log)))
    began = time.monotonic()
    child.start()
    child.join(smoke.timeout_s)
    if child.is_alive():
        child.kill()
        child.join()
    cpu = Path(f"{log}.cpu")
    print(f"smoke {module}: {time.monotonic() - began:.1f} s wall, "
          f"{float(cpu.read_text()) if cpu.exists() else float('nan'):.1f} s CPU (load {os.getloadavg()[0]:.1f})")
    text = log.read_text(errors="replace") if log.exists() else ""
    assert child.exitcode == 0, f"python -m {module} {' '.join(argv)} ended with {child.exitcode}:\n{text[-6000:]}"
    return out if smoke.writes else None


def check_report(out: Path | None, module: str) -> None:
    if out is None:
        return
    assert out.exists(), f"{module} wrote no report at {out}"
    report = json.loads(out.read_text())
    failures = SMOKES[module].failures
    problems = failures(report) if failures else []
    assert not problems, f"{module} recorded failed runs:\n" + "\n".join(problems)
    provenance = report.get("provenance") if isinstance(report, dict) else None
    assert provenance and provenance["command"].startswith(f"python -m {module}"), f"{module}: {provenance}"
    assert provenance["commit"], f"{module}: no commit in {provenance}"
    assert {"python", "torch", "device"} <= set(provenance["environment"]), provenance


def smoke_params(server: bool) -> list:
    return [pytest.param(m, marks=pytest.mark.xfail(strict=True, reason=s.broken) if s.broken else ())
            for m, s in sorted(SMOKES.items()) if s.server == server]


@pytest.mark.parametrize("module", smoke_params(server=False))
def test_smoke(module: str, smoke_context, tmp_path: Path) -> None:
    check_report(run_smoke(smoke_context, module, SMOKES[module], tmp_path, None), module)


@pytest.mark.integration
@pytest.mark.parametrize("module", smoke_params(server=True))
def test_smoke_on_the_session_server(module: str, smoke_context, vllm_server, tmp_path: Path) -> None:
    check_report(run_smoke(smoke_context, module, SMOKES[module], tmp_path, vllm_server.base_url), module)


def test_documented_figures_are_the_ones_their_json_holds() -> None:
    """The tables between the figures markers are what ``python -m benchmarks.index`` writes from the JSON now;
    ``benchmarks/README.md`` has the markers (README.md once it carries them)."""
    from benchmarks import index

    figures = index.table()
    marked = [d for d in index.DOCUMENTS if index.has_markers(d.read_text())]
    assert BENCHMARKS / "README.md" in marked, "benchmarks/README.md lost its figures markers"
    stale = [str(d.relative_to(REPO)) for d in marked if index.render(d, d.read_text(), figures) != d.read_text()]
    assert not stale, f"figures in {stale} differ from their JSON: run python -m benchmarks.index"


def test_index_names_a_document_without_markers(tmp_path: Path) -> None:
    from benchmarks import index

    with pytest.raises(ValueError, match="needs one '<!-- figures -->' line"):
        index.render(REPO / "README.md", "# no markers\n", "| table |")
    doc = REPO / "benchmarks" / "README.md"
    assert index.render(doc, "a\n<!-- figures -->\nold\n<!-- /figures -->\nb\n", "| [f](benchmarks/results/f.json) |") \
        == "a\n<!-- figures -->\n| [f](results/f.json) |\n<!-- /figures -->\nb\n"


def test_the_hybrids_bound_comes_from_the_delta_part_and_the_dense_rate() -> None:
    """``qwen35_summary.kernel_bound``: the step's FLOPs at the dense model's rate plus the delta rule's measured time,
    scaled to the step's tokens, once per GDN layer (the delta rule's FLOPs leave the first term); a workload without
    a delta row gets no bound."""
    from benchmarks.models import qwen35_summary

    dense = {"model": "d", "workload": "ratio~1", "packing": "tree", "step_flops": 100.0, "fwd_bwd_s": 1.0,
             "trained_tokens_per_s": 50.0, "params": 10}
    hybrid = {"model": "h", "workload": "ratio~1", "packing": "tree", "step_flops": 130.0, "fwd_bwd_s": 3.0,
              "step_gdn_flops": 10.0, "gdn_layers": 3, "forwarded_tokens_per_step": 2000, "trained_tokens_per_step": 60, "params": 20,
              "gdn_backend": "fla/triton"}
    speed = [dense, hybrid, {**dense, "workload": "ratio~3.4"}, {**hybrid, "workload": "ratio~3.4"}]
    report = {"delta": {"rows": [{"workload": "ratio~1", "tokens": 1000, "tree_ms": 100.0}]}}
    bound = qwen35_summary.kernel_bound(report, speed, "d", "h")
    assert set(bound) == {"ratio~1"}
    b = bound["ratio~1"]
    # rest (130 - 10 delta-rule FLOPs) / 100 = 1.2 s; delta 3 layers x 0.1 s x 2000 / 1000 tokens = 0.6 s; 60 tokens / 1.8 s x 20 / (50 x 10)
    assert b["rest_s"] == pytest.approx(1.2) and b["delta_s"] == pytest.approx(0.6)
    assert b["bound_s"] == pytest.approx(1.8) and b["delta_share"] == pytest.approx(0.2)
    assert b["per_param"] == pytest.approx(60 / 1.8 * 20 / 500)


def test_fsdp_mfu_pairs_kept_and_freed_weights_that_differ_in_nothing_else() -> None:
    """``fsdp_mfu.keep_weights_comparison``: a ``:keepmb`` config over its ``:freemb`` twin (same budget, compile,
    attention ...), time and peak memory; a config with no twin, or a failed one, is left out."""
    from benchmarks.trainer import fsdp_mfu

    def row(keep: bool, budget: int, fwd_bwd_s: float, peak: float, **other) -> dict:
        return {"token_budget": budget, "compile": "layers", "keep_weights_between_micro_batches": keep,
                "fwd_bwd_s": fwd_bwd_s, "step_s": fwd_bwd_s + 0.1, "peak_allocated_gib": peak, **other}

    results = [row(True, 16384, 0.9, 66.0), row(False, 16384, 1.0, 60.0), row(True, 32768, 2.0, 70.0),
               row(False, 32768, 2.5, 70.0, compile="none"), row(False, 8192, 1.0, 1.0, error="OOM")]
    (pair,) = fsdp_mfu.keep_weights_comparison(results)
    assert pair["token_budget"] == 16384
    assert pair["fwd_bwd_ratio"] == pytest.approx(0.9) and pair["peak_ratio"] == pytest.approx(1.1)


def test_the_moe_figure_is_the_default_configs_with_every_weight_schedule_listed() -> None:
    """``qwen35_summary.summarize`` with ``--weight-gathers per_pass,per_micro_batch,per_step``: the MoE figures are
    the one-rank default's (``per_micro_batch``: weights kept between micro-batches), and every schedule is listed."""
    from benchmarks.models import qwen35_summary
    from grpo_core.models.moe.experts import DEFAULT_EXPERTS

    def row(shape: str, gathers: str, mfu: float) -> dict:
        return {"model": shape, "experts_implementation": DEFAULT_EXPERTS, "weight_gathers": gathers,
                "world_size": 1, "mfu_fwd_bwd": mfu}

    (moe, _), (a3b, _) = qwen35_summary.MOE[False]
    rows = [row(moe, "per_pass", 0.20), row(moe, "per_micro_batch", 0.24), row(moe, "per_step", 0.26),
            row(a3b, "per_pass", 0.31), row(a3b, "per_micro_batch", 0.33)]
    summary = qwen35_summary.summarize({"moe": rows}, smoke=False)
    assert summary["qwen3_5_moe_mfu"] == 0.24 and summary["qwen3_30b_a3b_mfu"] == 0.33
    assert summary["moe_mfu_by_weight_gathers"] == {
        "per_pass": {"qwen3_5_moe_mfu": 0.20, "qwen3_30b_a3b_mfu": 0.31},
        "per_micro_batch": {"qwen3_5_moe_mfu": 0.24, "qwen3_30b_a3b_mfu": 0.33},
        "per_step": {"qwen3_5_moe_mfu": 0.26}}


def test_moe_rows_of_fewer_layers_never_make_the_shapes_figure() -> None:
    """``--moe-layers`` runs the MoE shapes shallower to fit a smaller card: those rows compare settings within their
    run, and the summary's figures stay the shapes' own depth's (none where only shallower rows exist)."""
    from benchmarks.models import qwen35_summary
    from grpo_core.models.moe.experts import DEFAULT_EXPERTS

    (moe, moe_layers), (a3b, a3b_layers) = qwen35_summary.MOE[False]
    rows = [{"model": a3b, "layers": a3b_layers // 2, "experts_implementation": DEFAULT_EXPERTS,
             "weight_gathers": "per_micro_batch", "world_size": 1, "mfu_fwd_bwd": 0.45},
            {"model": moe, "layers": moe_layers, "experts_implementation": DEFAULT_EXPERTS,
             "weight_gathers": "per_micro_batch", "world_size": 1, "mfu_fwd_bwd": 0.31}]
    summary = qwen35_summary.summarize({"moe": rows}, smoke=False)
    assert summary["qwen3_30b_a3b_mfu"] is None and "qwen3_30b_a3b_mfu" not in summary["met"]
    assert summary["qwen3_5_moe_mfu"] == 0.31


def test_the_summary_takes_the_default_graph_breaks_and_lists_both_settings() -> None:
    """``qwen35_summary.summarize`` with ``--graph-breaks nested,outer``: each setting's ratio pairs the models compiled
    with it, and the headline ratio is the default config's setting (``resolve_graph_breaks("auto")``)."""
    from benchmarks.models import qwen35_summary
    from grpo_core.models.fsdp import resolve_graph_breaks

    def row(model: str, breaks: str, tokens_per_s: float, params: int) -> dict:
        return {"model": model, "workload": "ratio~1", "packing": "tree", "compile_graph_breaks": breaks,
                "trained_tokens_per_s": tokens_per_s, "params": params, "gdn_backend": "fla/flash_qla",
                "mfu_fwd_bwd": 0.5, "step_flops": 1.0, "fwd_bwd_s": 1.0}

    dense, hybrid = qwen35_summary.PAIRS[False]
    speed = [row(dense, "nested", 100.0, 10), row(hybrid, "nested", 90.0, 10),
             row(dense, "outer", 80.0, 10), row(hybrid, "outer", 40.0, 10)]
    summary = qwen35_summary.summarize({"speed": speed}, smoke=False)
    assert summary["hybrid_per_param_vs_dense_by_graph_breaks"] == {"nested": {"ratio~1": pytest.approx(0.9)},
                                                                    "outer": {"ratio~1": pytest.approx(0.5)}}
    expected = 0.9 if resolve_graph_breaks("auto") == "nested" else 0.5
    assert summary["hybrid_per_param_vs_dense"] == {"ratio~1": pytest.approx(expected)}
    # one setting: no comparison, and its rows are the figure
    single = qwen35_summary.summarize({"speed": speed[2:]}, smoke=False)
    assert "hybrid_per_param_vs_dense_by_graph_breaks" not in single
    assert single["hybrid_per_param_vs_dense"] == {"ratio~1": pytest.approx(0.5)}


def test_graph_break_sites_name_the_line_a_compiled_function_breaks_at() -> None:
    """``profiling.graph_break_sites``: the profile's record of where compiled layers break, by user-code line."""
    import inspect

    import torch

    from benchmarks.profiling import graph_break_sites

    @torch.compiler.disable
    def opaque(x):
        return x + 1

    def layer(x):
        return opaque(x.sin()).cos()

    line = inspect.getsourcelines(layer)[1] + 1
    torch._dynamo.reset()
    with graph_break_sites() as sites:
        torch.compile(layer, backend="eager")(torch.randn(3))
    torch._dynamo.reset()
    assert dict(sites) == {f"{__file__}:{line}": 1}


def test_a_host_wait_is_placed_by_its_ops_and_the_frames_outside_torch() -> None:
    """``profiling.wait_site`` on a profiler-like event chain: the ops it ran under, innermost first (three at most),
    then the nearest recorded Python frames that are not torch's own."""
    from types import SimpleNamespace

    from benchmarks import profiling

    root = SimpleNamespace(name="layer", stack=["/x/torch/nn/module.py(1): call", "/x/app/layer.py(9): run"],
                           cpu_parent=None)
    mid = SimpleNamespace(name="aten::copy_", stack=[], cpu_parent=root)
    op = SimpleNamespace(name="aten::to", stack=[], cpu_parent=mid)
    wait = SimpleNamespace(name="cudaStreamSynchronize", stack=[], cpu_parent=op)
    assert profiling.wait_site(wait) == "aten::to < aten::copy_ < layer @ /x/app/layer.py(9): run"
    assert profiling.wait_site(SimpleNamespace(cpu_parent=None)) == "(no op)"


def test_a_host_wait_in_a_backward_is_placed_by_its_autograd_node_and_shapes() -> None:
    """A wait deep in a backward (autograd's thread: no Python frames) names the three innermost ops, the autograd
    node it ran in, and the innermost op's input shapes."""
    from types import SimpleNamespace

    from benchmarks import profiling

    def op(name, parent, shapes=None):
        return SimpleNamespace(name=name, stack=[], cpu_parent=parent, input_shapes=shapes)

    node = op("autograd::engine::evaluate_function: ToCopyBackward0", None)
    chain = op("aten::copy_", op("aten::_to_copy", op("aten::to", op("ToCopyBackward0", node))), [[16], [16]])
    wait = SimpleNamespace(name="cudaStreamSynchronize", stack=[], cpu_parent=chain)
    assert profiling.wait_site(wait) == ("aten::copy_ < aten::_to_copy < aten::to < ... < "
                                         "autograd::engine::evaluate_function: ToCopyBackward0 [[16], [16]]")


def test_a_kernel_is_placed_by_the_ops_that_launched_it() -> None:
    """``profiling.launch_sites``: each named kernel's launching ops (the CPU events the profiler attaches it to),
    most frequent first; kernels not asked for are left out."""
    from types import SimpleNamespace

    from benchmarks import profiling

    def op(name, parent=None, kernels=(), shapes=None):
        return SimpleNamespace(name=name, stack=[], cpu_parent=parent, input_shapes=shapes,
                               kernels=[SimpleNamespace(name=k) for k in kernels])

    backward = op("autograd::engine::evaluate_function: CompiledFunctionBackward")
    forward = op("layer.py(7): forward")
    events = [op("aten::mm", backward, ["gemm_align1"], [[7, 8], [8, 16]]),
              op("aten::mm", backward, ["gemm_align1"], [[7, 8], [8, 16]]),
              op("aten::mm", forward, ["gemm_align1", "gemm_align8"], [[8, 8], [8, 16]]),
              op("aten::copy_", forward, ["copy"])]
    sites = profiling.launch_sites(events, {"gemm_align1"})
    assert list(sites) == ["gemm_align1"]
    assert sites["gemm_align1"] == [
        {"site": "aten::mm < autograd::engine::evaluate_function: CompiledFunctionBackward [[7, 8], [8, 16]]",
         "calls": 2},
        {"site": "aten::mm [[8, 8], [8, 16]] @ layer.py(7): forward", "calls": 1}]


def test_a_host_wait_is_placed_by_the_python_frames_a_real_profile_records() -> None:
    """On a real (CPU) profile with ``with_stack``, the profiler records Python frames as parent events: a copy made
    in a function of this file is placed there, innermost frame first."""
    from types import SimpleNamespace

    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks import profiling

    def build_plan(x):
        return x.to(torch.float64)

    with profile(activities=[ProfilerActivity.CPU], with_stack=True, record_shapes=True) as prof:
        build_plan(torch.ones(3))
    copy = next(e for e in prof.events() if e.name == "aten::copy_")
    site = profiling.wait_site(SimpleNamespace(name="cudaStreamSynchronize", cpu_parent=copy))
    assert site.startswith("aten::copy_ < aten::_to_copy < aten::to [[3], [3], []]")
    assert "test_benchmarks.py(" in site.split(" @ ")[1].split(" | ")[0] and "build_plan" in site


def test_misaligned_matmuls_names_an_operand_led_by_an_odd_row_length() -> None:
    """``profiling.misaligned_matmuls``: a bf16 operand whose leading dimension is 7 rows (14 bytes) is named with
    its shape and strides; the same product on 8 rows is not."""
    import torch

    from benchmarks import profiling

    w = torch.randn(8, 16, dtype=torch.bfloat16)

    def product(rows: int):
        return lambda: torch.randn(8, rows, dtype=torch.bfloat16).t() @ w  # [rows, 8] with leading dimension rows

    assert profiling.misaligned_matmuls(product(8)) == []
    assert profiling.misaligned_matmuls(product(7)) == [
        {"op": "mm.default", "operands": [[[7, 8], [1, 7]], [[8, 16], [16, 1]]], "calls": 1}]

    # in a backward, the node that ran the matmul is named: the input's gradient here, from a gradient led by 7 rows
    x = torch.randn(8, 7, dtype=torch.bfloat16).t().requires_grad_()  # [7, 8], led by 7 rows
    grad = torch.randn(7, 16, dtype=torch.bfloat16).t().contiguous().t()  # [7, 16], also led by 7 rows
    found = profiling.misaligned_matmuls(lambda: (x @ w).backward(grad))
    assert [f.get("backward_of") for f in found] == [None, "MmBackward0"]
    assert any(7 in stride for _, stride in found[1]["operands"])


def test_the_tree_speedup_pairs_flat_and_tree_rows_of_separate_calls() -> None:
    """``qwen35_summary.tree_speedup_over_flop_ideal``: a row's own figure where flat and tree ran in one process,
    else (tree tokens/s / flat tokens/s) / (flat FLOPs / tree FLOPs) from the flat row of the same model, workload and
    kernels; none from a flat row of other kernels, or without one."""
    from benchmarks.models import qwen35_summary

    def row(packing: str, tokens_per_s: float, flops: float, kernel: str = "fla/flash_qla") -> dict:
        return {"model": "h", "workload": "ratio~3.4", "packing": packing, "gdn_backend": kernel,
                "compile_graph_breaks": "nested", "trained_tokens_per_s": tokens_per_s, "step_flops": flops}

    tree = row("tree", 300.0, 1.0)
    assert qwen35_summary.tree_speedup_over_flop_ideal([tree, row("flat", 100.0, 3.2)], tree) == pytest.approx(3.0 / 3.2)
    assert qwen35_summary.tree_speedup_over_flop_ideal([tree, row("flat", 100.0, 3.2, "fla/triton")], tree) is None
    assert qwen35_summary.tree_speedup_over_flop_ideal([tree], tree) is None
    own = {**tree, "speedup_over_flop_ideal": 0.99}
    assert qwen35_summary.tree_speedup_over_flop_ideal([own, row("flat", 100.0, 3.2)], own) == 0.99
