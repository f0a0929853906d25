"""The stale-sample policy table (docs/staleness.md), read from the MLflow experiment ``scripts/staleness_runs.py``
logs to, as a user compares runs.

One row per finished run tagged ``staleness.policy``, in the order setting, policy, seed:

- discarded: the share of generated tokens (of groups with a learning signal) dropped as stale, over the run
  (``training.waste.run_waste`` of its per-step ``waste/*`` counts);
- trained ÷ generated: the mean length of trained completions over that of generated ones, over the run;
- staleness: ``sample/staleness_mean`` averaged over steps, and the samples trained past ``max_staleness``;
- held-out before and after: ``heldout_accuracy`` at step 0 and at the last step, with their 95% intervals over
  problems (``heldout_accuracy_ci95_low``/``_high``);
- step s: the median of ``perf/step_s`` over the run's steps;
- the command that reproduces the row.

    python scripts/staleness_table.py --tracking-uri sqlite:///$PWD/outputs/staleness/mlflow.db
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grpo_core.tracking.run_view import HELDOUT_ACCURACY, HELDOUT_CI95  # noqa: E402
from grpo_core.training.waste import run_waste  # noqa: E402

SETTING_ORDER = ("demo", "long_tail")
POLICY_ORDER = ("drop", "keep")


def by_step(client: Any, run_id: str, key: str) -> dict[int, float]:
    """A metric's value at each step; a step logged twice (a resumed run) keeps its last value."""
    values: dict[int, float] = {}
    for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp):
        values[m.step] = m.value
    return values


def heldout(client: Any, run_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The held-out accuracy before (the first step logged) and after (the last), each with its interval."""
    accuracy = by_step(client, run_id, HELDOUT_ACCURACY)
    low, high = (by_step(client, run_id, key) for key in HELDOUT_CI95)
    if not accuracy:
        return {}, {}
    first, last = min(accuracy), max(accuracy)
    return ({"mean": accuracy[first], "low": low.get(first), "high": high.get(first)},
            {"mean": accuracy[last], "low": low.get(last), "high": high.get(last)})


def run_row(client: Any, run: Any) -> dict[str, Any]:
    run_id = run.info.run_id
    tags, params = run.data.tags, run.data.params
    waste = run_waste(lambda key: sorted(by_step(client, run_id, key).items()))
    staleness = list(by_step(client, run_id, "sample/staleness_mean").values())
    step_s = list(by_step(client, run_id, "perf/step_s").values())
    late = by_step(client, run_id, "sample/late_kept")
    before, after = heldout(client, run_id)
    row = {
        "setting": tags.get("staleness.setting"), "policy": tags.get("staleness.policy"),
        "seed": int(params.get("seed", "0")), "steps": len(step_s), "run_id": run_id,
        "discarded_share": waste["waste_discarded_share"], "discarded_tokens": waste["waste_discarded_tokens"],
        "generated_tokens": waste["waste_generated_tokens"], "length_ratio": waste["waste_length_ratio"],
        "trained_length": waste["waste_trained_length_mean"], "generated_length": waste["waste_generated_length_mean"],
        "staleness_mean": statistics.fmean(staleness) if staleness else None, "late_kept": sum(late.values()),
        "heldout_before": before, "heldout_after": after,
        "step_s_median": statistics.median(step_s) if step_s else None,
    }
    row["command"] = command(row, params)
    return row


def command(row: dict[str, Any], params: dict[str, str]) -> str:
    parts = ["python scripts/staleness_runs.py", f"--policy {row['policy']}", f"--setting {row['setting']}"]
    if row["seed"]:
        parts.append(f"--seed {row['seed']}")
    if params.get("max_steps") and params["max_steps"] != "120":
        parts.append(f"--max-steps {params['max_steps']}")
    return " ".join(parts)


def fmt(value: Any, style: str = ".3f") -> str:
    return "n/a" if value is None else format(value, style)


def accuracy_text(value: dict[str, Any]) -> str:
    if not value:
        return "n/a"
    return f"{value['mean']:.3f} [{fmt(value.get('low'), '.2f')}, {fmt(value.get('high'), '.2f')}]"


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| setting | policy | steps | discarded tokens | trained ÷ generated length | staleness mean | late kept | "
             "held-out before | held-out after | step s (median) | command |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['setting']} | {r['policy']} | {r['steps']} | {fmt(r['discarded_share'], '.1%')} "
            f"({int(r['discarded_tokens'])} of {int(r['generated_tokens'])}) | {fmt(r['length_ratio'])} "
            f"({fmt(r['trained_length'], '.1f')} / {fmt(r['generated_length'], '.1f')}) | {fmt(r['staleness_mean'], '.2f')} "
            f"| {int(r['late_kept'])} | {accuracy_text(r['heldout_before'])} | {accuracy_text(r['heldout_after'])} "
            f"| {fmt(r['step_s_median'], '.2f')} | `{r['command']}` |")
    return "\n".join(lines)


def sort_key(row: dict[str, Any]) -> tuple:
    return (SETTING_ORDER.index(row["setting"]) if row["setting"] in SETTING_ORDER else len(SETTING_ORDER),
            POLICY_ORDER.index(row["policy"]) if row["policy"] in POLICY_ORDER else len(POLICY_ORDER), row["seed"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tracking-uri", required=True)
    parser.add_argument("--experiment", default="stale-sample-policies")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)

    import mlflow

    client = mlflow.MlflowClient(args.tracking_uri)
    experiment = client.get_experiment_by_name(args.experiment)
    if experiment is None:
        raise SystemExit(f"no experiment {args.experiment!r} in {args.tracking_uri}; run scripts/staleness_runs.py first")
    runs = client.search_runs([experiment.experiment_id], filter_string="tags.`staleness.policy` != ''",
                              max_results=1000)
    rows = sorted((run_row(client, run) for run in runs if run.info.status == "FINISHED"), key=sort_key)
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
