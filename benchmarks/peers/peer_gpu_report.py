"""``peer_trl_gpu.py``'s summary per workload, its table and its plot.

Per workload (its first step is the warm-up; the rest are timed): trained tokens/s = trained tokens of the
timed steps / their summed wall time; the median step time; the largest peak allocated memory of the timed
steps; the first step's losses against the fp32 reference. TRL's best run is its fastest configuration that
ran. The first-step tolerance is derived from bf16 noise measured on the same batch: noise = the larger of
|ours (bf16) - fp32 reference| and |reference in bf16 - fp32 reference|; two bf16 evaluations each within the
noise of fp32 can differ by twice it, so tolerance = 2 x noise.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any
from benchmarks.bench_io import write_report


def _workload_steps(report: dict[str, Any]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for row in report["stream"]["rows"]:
        out.setdefault(row["workload"], []).append(row["step"] - 1)
    return out


def _run_figures(run: dict[str, Any], idx: list[int], tokens: list[int]) -> dict[str, Any] | None:
    steps = run.get("steps") or []
    if "error" in run or len(steps) <= max(idx):
        return None
    timed = idx[1:]
    times = [steps[i]["time_s"] for i in timed]
    peaks = [steps[i]["peak_gib"] for i in timed if steps[i]["peak_gib"] is not None]
    fwd_bwd = [steps[i]["fwd_bwd_s"] for i in timed if steps[i].get("fwd_bwd_s") is not None]
    return {"tokens_per_s": sum(tokens[i] for i in timed) / sum(times), "step_s_median": statistics.median(times),
            "tokens_per_s_median": statistics.median(tokens[i] / steps[i]["time_s"] for i in timed),
            "fwd_bwd_s_median": statistics.median(fwd_bwd) if fwd_bwd else None,
            "step_s": times, "peak_gib": max(peaks) if peaks else None,
            "losses": [steps[i]["loss"] for i in idx],
            "packing_ratio": statistics.mean(steps[i].get("packing_ratio") or 0.0 for i in idx),
            "logged_trained_tokens": [steps[i].get("trained_tokens") for i in idx]}


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    tokens = [row["trained_tokens"] for row in report["stream"]["rows"]]
    trl_runs = {k: v for k, v in report["runs"].items() if k.startswith("trl_gc_")}
    summary: dict[str, Any] = {}
    for name, idx in _workload_steps(report).items():
        ours = _run_figures(report["runs"].get("ours", {"error": "not run"}), idx, tokens)
        trl = {k: _run_figures(v, idx, tokens) for k, v in trl_runs.items()}
        ran = {k: v for k, v in trl.items() if v is not None}
        best = max(ran, key=lambda k: ran[k]["tokens_per_s"]) if ran else None
        entry: dict[str, Any] = {
            "steps_timed": len(idx) - 1, "trained_tokens_per_step": [tokens[i] for i in idx],
            "packing_ratio": ours["packing_ratio"] if ours else None,
            "tokens_per_s_ours": ours["tokens_per_s"] if ours else None,
            "tokens_per_s_trl": ran[best]["tokens_per_s"] if best else None, "trl_best_run": best,
            "tokens_per_s_ratio": ours["tokens_per_s"] / ran[best]["tokens_per_s"] if ours and best else None,
            # The same from each step's own rate (median of the timed steps): less moved by one slow step.
            "tokens_per_s_ratio_median_steps": (ours["tokens_per_s_median"] / ran[best]["tokens_per_s_median"]
                                                if ours and best else None),
            # Forward+backward alone, as each trainer times it itself (TRL: its training_step calls).
            "fwd_bwd_s_ours": ours["fwd_bwd_s_median"] if ours else None,
            "fwd_bwd_s_trl": ran[best]["fwd_bwd_s_median"] if best else None,
            "step_s_ours": ours["step_s_median"] if ours else None,
            "step_s_trl": ran[best]["step_s_median"] if best else None,
            "peak_gib_ours": ours["peak_gib"] if ours else None,
            "peak_gib_trl": ran[best]["peak_gib"] if best else None,
            "trl_runs": {k: ({kk: v[kk] for kk in ("tokens_per_s", "tokens_per_s_median", "step_s_median",
                                                   "fwd_bwd_s_median", "peak_gib")}
                             if v else {"error": trl_runs[k].get("error")}) for k, v in trl.items()},
        }
        stream_tokens = [tokens[i] for i in idx]  # the same rows on both sides: each logs the stream's counts
        entry["same_trained_tokens_logged"] = {
            k: (v["logged_trained_tokens"] == stream_tokens if v else None)
            for k, v in {"ours": ours, **trl}.items()}
        if ours and best:
            entry["first_step"] = _first_step(report, name, ours, ran[best])
            entry["max_abs_loss_diff_all_steps"] = max(abs(a - b) for a, b in zip(ours["losses"], ran[best]["losses"]))
        summary[name] = entry
    return summary


def _first_step(report: dict[str, Any], name: str, ours: dict[str, Any], trl: dict[str, Any]) -> dict[str, Any]:
    ref = report.get("reference", {}).get(name, {})
    lo, lt = ours["losses"][0], trl["losses"][0]
    out = {"loss_ours": lo, "loss_trl": lt, "abs_diff": abs(lo - lt),
           "loss_fp32_reference": ref.get("fp32"), "loss_bf16_reference": ref.get("bf16")}
    if ref.get("fp32") is not None:
        noise = max(abs(lo - ref["fp32"]), abs(ref["bf16"] - ref["fp32"]))
        out.update(bf16_noise=noise, tolerance=2 * noise, within_tolerance=abs(lo - lt) <= 2 * noise,
                   abs_diff_trl_vs_fp32=abs(lt - ref["fp32"]), abs_diff_ours_vs_fp32=abs(lo - ref["fp32"]))
    return out


def table(report: dict[str, Any]) -> str:
    lines = ["| workload | packing ratio | trained tok/s ours | trained tok/s TRL (best run) | ours / TRL (median of "
             "steps) | step s ours / TRL | fwd+bwd s ours / TRL | peak GiB ours / TRL (TRL, checkpointing on) "
             "| first-step loss ours / TRL / fp32 | abs diff (tolerance) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, p=0: "–" if v is None else f"{v:,.{p}f}"  # noqa: E731
    for name, s in report["summary"].items():
        f = s.get("first_step", {})
        lean = s["trl_runs"].get("trl_gc_on", {}).get("peak_gib")
        lines.append(
            f"| {name} | {fmt(s['packing_ratio'], 2)} | {fmt(s['tokens_per_s_ours'])} | {fmt(s['tokens_per_s_trl'])} "
            f"({s['trl_best_run']}) | **{fmt(s['tokens_per_s_ratio'], 2)}** ({fmt(s['tokens_per_s_ratio_median_steps'], 2)}) "
            f"| {fmt(s['step_s_ours'], 3)} / {fmt(s['step_s_trl'], 3)} | {fmt(s['fwd_bwd_s_ours'], 3)} / "
            f"{fmt(s['fwd_bwd_s_trl'], 3)} | {fmt(s['peak_gib_ours'], 1)} / {fmt(s['peak_gib_trl'], 1)} ({fmt(lean, 1)}) | "
            f"{fmt(f.get('loss_ours'), 5)} / {fmt(f.get('loss_trl'), 5)} / {fmt(f.get('loss_fp32_reference'), 5)} | "
            f"{fmt(f.get('abs_diff'), 5)} ({fmt(f.get('tolerance'), 5)}) |")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["summary"])
    ran = lambda k: any(s["trl_runs"].get(k, {}).get("tokens_per_s") for s in report["summary"].values())  # noqa: E731
    runs = ["ours"] + sorted(k for k in report["runs"] if k.startswith("trl_gc_") and ran(k))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(runs)
    for j, run in enumerate(runs):
        rate, peak = [], []
        for n in names:
            s = report["summary"][n]
            fig_run = {"tokens_per_s": s["tokens_per_s_ours"], "peak_gib": s["peak_gib_ours"]} if run == "ours" \
                else s["trl_runs"].get(run, {})
            rate.append((fig_run.get("tokens_per_s") or 0) / 1e3)
            peak.append(fig_run.get("peak_gib") or 0)
        xs = [i + (j - (len(runs) - 1) / 2) * width for i in range(len(names))]
        label = "ours (default)" if run == "ours" else f"TRL, gradient checkpointing {run.split('_')[2]}"
        axes[0].bar(xs, rate, width, label=label)
        axes[1].bar(xs, peak, width, label=label)
    for ax, title in zip(axes, ("trained tokens/s (thousands)", "peak allocated GiB")):
        ax.set_xticks(range(len(names)), names)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Qwen3-1.7B shape, token_budget {report['token_budget']}, one {report['env']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report_main(args: Any) -> None:
    report = json.loads(Path(args.json).read_text())
    report["summary"] = summarize(report)  # derived from the raw figures: recomputed with this code
    if args.rows_check:
        report["stream"]["cpu_row_check"] = json.loads(Path(args.rows_check).read_text())
    if args.merge_probes:
        report["probes"] = json.loads(Path(args.merge_probes).read_text())
    if args.merge_attempts:
        smoke = json.loads(Path(args.merge_attempts).read_text())
        report["cpu_smoke_attempts"] = {
            "probes": smoke.get("probes", {}).get("attempts"),
            "sdpa_swapped_losses": [s["loss"] for s in smoke["runs"].get("trl_sdpa_swapped", {}).get("steps", [])],
            "kernel_losses": [s["loss"] for s in smoke["runs"].get("trl_gc_on", {}).get("steps", [])],
            "ours_losses": [s["loss"] for s in smoke["runs"].get("ours", {}).get("steps", [])],
            "command": smoke.get("command"), "env": smoke.get("env")}
    write_report(args.json, report, default=str)  # keeps the provenance of the run it reports
    plot(report, args.plot or str(Path(args.json).with_suffix(".png")))
    print(table(report))
