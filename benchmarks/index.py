"""The headline figures, read from their results JSON and written into the documents that show them.

Each ``Headline`` names a measure, the JSON under ``benchmarks/results/`` that holds it and how to read the figure
from it. ``python -m benchmarks.index`` writes the table (measure, figure, commit, file) between the markers
``<!-- figures -->`` and ``<!-- /figures -->`` of every document in ``DOCUMENTS``, so a figure in the docs is the
one its JSON holds; ``--check`` writes nothing and fails where a document's table differs from the one it would
write (tests/test_benchmarks.py runs it). A document without the markers is not written, and the run ends with an
error that names it and the markers it needs.

The commit is the report's own (``provenance.commit``, written by ``bench_io.write_report``); a report written
before the provenance existed carries the commit that added it to the repository, marked as such, written into
it once by ``--backfill`` (from ``git log``).

    python -m benchmarks.index            # rewrite the tables
    python -m benchmarks.index --check    # exit 1 where a table is stale
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.bench_io import ROOT

RESULTS = ROOT / "benchmarks" / "results"
DOCUMENTS = (ROOT / "benchmarks" / "README.md", ROOT / "README.md")
BEGIN, END = "<!-- figures -->", "<!-- /figures -->"
BACKFILLED = "git log: the commit that added this file (the run's own commit was not recorded)"


@dataclass(frozen=True)
class Headline:
    measure: str
    """What is measured, and where (device, model)."""
    file: str
    """The results JSON, relative to ``benchmarks/results/``."""
    figure: Callable[[dict[str, Any]], str]
    """The figure as shown, read from the parsed JSON."""


def _by(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    found = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    if len(found) != 1:
        raise KeyError(f"{len(found)} results match {match}")
    return found[0]


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _peer_ratios(d: dict[str, Any]) -> str:
    return ", ".join(f"{w} {s['tokens_per_s_ratio']:.2f}x" for w, s in d["summary"].items())


def _peer_memory(d: dict[str, Any]) -> str:
    s = d["summary"]["ratio~1"]
    return f"{s['peak_gib_ours']:.1f} GiB ours, {s['peak_gib_trl']:.1f} GiB TRL (ratio~1)"


def _mfu_default(d: dict[str, Any]) -> str:
    return ", ".join(f"{_pct(r['mfu_fwd_bwd'])} at {r['token_budget'] // 1024}k-token rows"
                     f"{' (activation checkpointing)' if r['activation_checkpointing'] else ''}" for r in d["results"])


def _moe_tree(d: dict[str, Any]) -> str:
    tree = _by(d["results"], workload="ratio~3.4", packing="tree")
    return f"{tree['speedup']:.2f}x the flat rows' trained tokens/s at ratio~3.4"


def _tree_speedups(d: dict[str, Any]) -> str:
    return ", ".join(f"{r['workload']} {r['speedup']:.2f}x" for r in d["results"])


def _sparse_bytes(d: dict[str, Any]) -> str:
    return ", ".join(f"lr {r['learning_rate']:g}: {_pct(r['summary']['bytes_ratio'])} of the bytes, "
                     f"{r['summary']['seconds_ratio']:.2f}x the time" for r in d["runs"])


def _nccl(d: dict[str, Any]) -> str:
    one = d["runs"]["trainer_ranks_1"]
    push = one["variants"]["push:256"]
    return (f"{one['wire_bytes'] / 1e9:.2f} GB push in {push['sync_s'] * 1e3:.0f} ms (link {one['bandwidth']['bytes_per_s'] / 1e9:.0f} "
            f"GB/s; {push['ratio']:.2f}x the bare broadcast)")


def _fleet(d: dict[str, Any]) -> str:
    return f"{d['ratio']:.2f}x the tokens/s of one server (median of {len(d['ratio_per_round'])} rounds)"


def _fleet_push(d: dict[str, Any]) -> str:
    r = d["ratio_to_spanning"]
    return f"per-server in turn {r['per_server_seq']:.2f}x, in parallel {r['per_server_par']:.2f}x the spanning group's time"


def _trainer_loop(d: dict[str, Any]) -> str:
    diffs = d["comparison"]["abs_diff_2rank_vs_1rank"]
    return f"2 ranks against 1: largest loss difference {max(diffs):.1e} over {len(diffs)} steps"


def _qwen35(d: dict[str, Any]) -> str:
    s = d["summary"]
    per_param = ", ".join(f"{w} {v:.2f}x" for w, v in s["hybrid_per_param_vs_dense"].items())
    tree = ", ".join(f"{w} {v['hybrid']:.2f}" for w, v in s["tree_speedup_over_flop_ideal"].items()
                     if v.get("hybrid") is not None)
    return (f"hybrid per parameter / dense {per_param}"
            + (f"; hybrid tree speed-up / FLOP-ideal {tree}" if tree else "")
            + f"; MoE MFU Qwen3.5 {_pct(s['qwen3_5_moe_mfu'])}, 30B-A3B {_pct(s['qwen3_30b_a3b_mfu'])}"
            f"; log-prob gap {s['hybrid_logprob_gap_vs_dense']:.2f}x dense's")


def _keep_weights(d: dict[str, Any]) -> str:
    pairs = d["keep_weights_vs_free"]
    times = ", ".join(f"{p['fwd_bwd_ratio']:.3f}x" for p in pairs)
    peaks = ", ".join(f"{p['peak_ratio']:.4f}x" for p in pairs)
    return f"weights kept between micro-batches / freed: fwd+bwd time {times}; peak memory {peaks}"


def _logprob_kernels(d: dict[str, Any]) -> str:
    stats, grad = d["stats"], d["grad"]
    return (f"statistics {stats['triton_chunk_stats']['ms']:.2f} ms against compiled {stats['compiled']['ms']:.2f} ms; "
            f"gradient {grad['8192/2048/4']['ms']:.2f} ms against one program a row "
            f"{grad['row/4096/8 inline']['ms']:.2f} ms ({grad['8192/2048/4']['tb_s']:.2f} TB/s)")


def _grad_kernels(d: dict[str, Any]) -> str:
    on, off = d["runs"]
    return (f"with the kernels {on['moe'][0]['mfu_fwd_bwd']:.1%} MFU against FSDP2's own {off['moe'][0]['mfu_fwd_bwd']:.1%}; "
            f"fwd+bwd {d['fwd_bwd_on_over_off']:.2f}x")


def _e2e_gpu(d: dict[str, Any]) -> str:
    m, ledger, killed = d["metric_medians"], d["ledger"], d["run"]["killed"]
    last = d["steps_logged"]  # the steps MLflow holds; a gap below the last one is a missing step under it
    gaps = [s for s in d["missing_steps"] if s <= last]
    return (f"{ledger['steps_kept']} steps, trainer killed at step {killed['at_step']} and resumed by the flow: "
            f"{ledger['prompts_trained_twice_in_final_model']} prompts trained twice, MLflow steps 1-{last} with "
            f"{len(gaps)} missing; median step {m['perf/step_s']:.2f} s, push "
            f"{m['sync/seconds']:.2f} s + check {m['sync/check_s']:.3f} s, generation "
            f"{m['rollout/generated_tok_s']:,.0f} tokens/s")


HEADLINES: tuple[Headline, ...] = (
    Headline("Ours ÷ TRL trained tokens/s, Qwen3-1.7B, one H200, by packing ratio", "peer_trl_gpu.json", _peer_ratios),
    Headline("Peak GPU memory, ours against TRL, Qwen3-1.7B", "peer_trl_gpu.json", _peer_memory),
    Headline("Training MFU, default config, Qwen3-1.7B, one H200", "fsdp_mfu_default.json", _mfu_default),
    Headline("Tree packing speed-up over flat rows, Qwen3-1.7B, one H200", "tree_packing_default.json", _tree_speedups),
    Headline("MoE tree packing, Qwen3-30B-A3B shape (8 layers), one H200", "moe_qwen3_30b_a3b.json", _moe_tree),
    Headline("Qwen3.5 family, default config, one H200, 16k-token rows (hybrid 2.39B against Qwen3-1.7B; MoE shapes "
             "of 4 and 8 layers)",
             "qwen35_speed.json", _qwen35),
    Headline("FSDP2 on one GPU keeping the bf16 weights between micro-batches, Qwen3-1.7B, one H100, 8k rows",
             "fsdp_keep_weights_h100.json", _keep_weights),
    Headline("Log-prob head's passes over 15k x 152k bf16 logits with 8 top ids, one H100", "logprob_kernels_h100.json",
             _logprob_kernels),
    Headline("One rank's fp32 gradient accumulation kernels, Qwen3-30B-A3B shape at 4 layers, one H100",
             "moe_qwen3_30b_a3b_4layers_grad_kernels_h100.json", _grad_kernels),
    Headline("Sparse (delta) push against dense, Qwen3-1.7B, one H200", "sparse_push_gpu.json", _sparse_bytes),
    Headline("NCCL weight push, Qwen3-1.7B bf16, 2 x H200", "nccl_sync.json", _nccl),
    Headline("Fleet of two CPU servers against one", "fleet_throughput.json", _fleet),
    Headline("Push to a fleet of two (gloo, CPU)", "fleet_push.json", _fleet_push),
    Headline("Multi-rank trainer loop reproduces one rank (CPU recording, H200)", "trainer_loop.json", _trainer_loop),
    Headline("The whole run on one H100: a flow-started vLLM 0.25 CUDA server and the trainer, tiny model, gloo push "
             "(bounded by device time)", "e2e_gpu_h100_resume.json", _e2e_gpu),
)


def commit_of(report: dict[str, Any]) -> str:
    prov = report.get("provenance") or {}
    commit = prov.get("commit")
    if not commit:
        return "unknown"
    mark = "" if prov.get("commit_source") is None else " (added)"
    dirty = "+" if prov.get("dirty") else ""
    return f"`{commit[:10]}`{dirty}{mark}"


def table() -> str:
    rows = ["| Measure | Figure | Commit | File |", "|---|---|---|---|"]
    for h in HEADLINES:
        report = json.loads((RESULTS / h.file).read_text())
        rows.append(f"| {h.measure} | {h.figure(report)} | {commit_of(report)} | "
                    f"[{h.file}](benchmarks/results/{h.file}) |")
    return "\n".join(rows)


def has_markers(text: str) -> bool:
    return text.count(BEGIN) == 1 and text.count(END) == 1 and text.index(BEGIN) < text.index(END)


def render(document: Path, text: str, figures: str) -> str:
    """``text`` with ``figures`` between the markers; links made relative to ``document``'s folder."""
    if not has_markers(text):
        raise ValueError(f"{document.relative_to(ROOT)}: needs one '{BEGIN}' line and one '{END}' line after it, "
                         "where the figures table goes")
    results = Path(os.path.relpath(RESULTS, document.parent)).as_posix()
    figures = figures.replace("](benchmarks/results/", f"]({results}/")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{figures}\n{END}{tail}"


def backfill() -> list[Path]:
    """Give each results JSON (a dict) without provenance the commit that added it, from ``git log``; also the
    command and environment it recorded under its own keys. Returns the files written."""
    written = []
    for path in sorted(RESULTS.rglob("*.json")):
        report = json.loads(path.read_text())
        if not isinstance(report, dict) or "provenance" in report:
            continue
        added = subprocess.run(["git", "log", "--diff-filter=A", "--format=%H", "--", str(path.relative_to(ROOT))],
                               cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
        report["provenance"] = {"commit": added[-1] if added else None, "commit_source": BACKFILLED, "dirty": None,
                                "command": report.get("command"), "environment": report.get("env")}
        text = path.read_text()
        indent = 2 if re.match(r"\{\n  \"", text) else 1
        path.write_text(json.dumps(report, indent=indent) + ("\n" if text.endswith("\n") else ""))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 where a document's table is stale")
    ap.add_argument("--backfill", action="store_true", help="first add provenance from git log to JSONs without it")
    args = ap.parse_args(argv)
    if args.backfill:
        for path in backfill():
            print(f"backfilled {path.relative_to(ROOT)}")
    figures = table()
    stale, unmarked = [], []
    for document in DOCUMENTS:
        text = document.read_text()
        if not has_markers(text):
            unmarked.append(f"{document.relative_to(ROOT)}: no '{BEGIN}' ... '{END}' markers, so no figures written")
            continue
        new = render(document, text, figures)
        if new != text:
            stale.append(str(document.relative_to(ROOT)))
            if not args.check:
                document.write_text(new)
    print(figures)
    if args.check and stale:
        print(f"stale figures in {', '.join(stale)}: run python -m benchmarks.index", file=sys.stderr)
    for line in unmarked:
        print(line, file=sys.stderr)
    return 1 if (args.check and stale) or unmarked else 0


if __name__ == "__main__":
    sys.exit(main())
