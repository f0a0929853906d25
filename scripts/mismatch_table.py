"""The correction-mode table (docs/mismatch.md), read from the MLflow experiment that ``scripts/mismatch_runs.py``
logs to, as a user compares runs.

One row per finished run tagged ``mismatch.*``, in the order variant, routing replay, setting, mode:

- reward: the mean reward of the first and last 10% of logged steps, and their difference (the gain);
- held-out: ``heldout_accuracy`` at step 0 and at the last step (the flow evaluates before and after), and the gain;
- k3: ``mismatch/k3_token``, the per-token KL estimate sampler ‖ trainer, averaged over steps (staleness 0 alone in
  ``k3@0``: the engines' gap without the policy's drift);
- masked, truncated: ``mismatch/masked_token_share`` and ``mismatch/truncated_token_share`` averaged over steps;
- max gap: the largest ``mismatch/max_token_gap`` of the run, in nats;
- route diff: ``mismatch/route_mismatch_share`` averaged over steps (MoE runs with sampler routes);
- replay: routing replay as it ran (``on, no routes``: asked for, but the server returned no routes to replay;
  a CPU server cannot, so the trainer routed every token itself);
- ended: ``finished``; ``stopped at step N: no learning signal`` for a run the trainer stopped because its
  policy collapsed (``no_signal_patience_steps``); ``stopped at step N: <what>`` for a run that ended on another
  error the trainer named (the server's log-probs outside the push check's tolerance, after the flow's resumes);
  or ``stopped by hand at step N`` for a run someone ended with a ``failure`` tag that says so and why (status
  KILLED); such runs are rows of the table too (not a run tagged ``superseded_by``: its row was run again);
- the command that reproduces the row.

    python scripts/mismatch_table.py --tracking-uri sqlite:///outputs/mismatch/mlflow.db
    python scripts/mismatch_table.py --tracking-uri sqlite:///outputs/mismatch/mlflow.db --json table.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grpo_core.tracking.run_view import HELDOUT_ACCURACY  # noqa: E402

MODE_ORDER = ("none", "token_mask", "token_truncate", "sequence_mask", "sequence_truncate")
AVERAGED = {"k3": "mismatch/k3_token", "k3@0": "mismatch/k3_token/staleness_0",
            "masked": "mismatch/masked_token_share", "truncated": "mismatch/truncated_token_share",
            "route diff": "mismatch/route_mismatch_share"}


def edge_means(values: list[float]) -> tuple[float, float]:
    """Means of the first and the last 10% of a run's values (at least one value each)."""
    k = max(1, round(0.1 * len(values)))
    return statistics.fmean(values[:k]), statistics.fmean(values[-k:])


def history(client: Any, run_id: str, key: str) -> list[float]:
    """A metric's values in step order; a step logged twice (a resumed run) keeps its last value."""
    by_step: dict[int, float] = {}
    for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp):
        by_step[m.step] = m.value
    return [by_step[s] for s in sorted(by_step)]


def run_row(client: Any, run: Any) -> dict[str, Any]:
    tags, run_id = run.data.tags, run.info.run_id
    rewards = history(client, run_id, "reward")
    first, last = edge_means(rewards) if rewards else (math.nan, math.nan)
    heldout = history(client, run_id, HELDOUT_ACCURACY)
    row: dict[str, Any] = {
        "variant": tags["mismatch.variant"], "routing_replay": tags["mismatch.routing_replay"] == "True",
        "routes_returned": run.data.params.get("grpo.server.return_routed_experts") == "True",
        "setting": tags["mismatch.setting"], "mode": tags["mismatch.mode"], "run": run.info.run_name,
        "status": run.info.status, "steps": len(rewards),
        "reward_first": first, "reward_last": last, "reward_gain": last - first,
        "heldout_before": heldout[0] if len(heldout) >= 2 else None,
        "heldout_after": heldout[-1] if len(heldout) >= 2 else None,
        "heldout_gain": heldout[-1] - heldout[0] if len(heldout) >= 2 else None,
    }
    for label, key in AVERAGED.items():
        values = [v for v in history(client, run_id, key) if math.isfinite(v)]
        row[label] = statistics.fmean(values) if values else None
    gaps = history(client, run_id, "mismatch/max_token_gap")
    row["max gap"] = max(gaps) if gaps else None
    row["command"] = command(row, run.data.params)
    failure = tags.get("failure", "")
    stopped = trainer_stop(failure)
    row["ended"] = ("finished" if run.info.status == "FINISHED" else
                    f"stopped at step {stopped[0]}: {ERROR_TEXT.get(stopped[1], stopped[1])}" if stopped else
                    failure.split(":")[0] if failure.startswith(STOPPED_BY_HAND) else run.info.status.lower())
    return row


ERROR_TEXT = {"NoLearningSignalError": "no learning signal",
              "ServedWeightsMismatch": "the server's log-probs left the push check's tolerance"}
"""What a trainer error that ended a row says about the row (the class name where none is given)."""


def trainer_stop(failure: str) -> tuple[str, str] | None:
    """``(step, error class)`` of a ``failure`` tag in which the flow names the trainer's error (``... training
    stopped at step N: SomeError: ...``), else None."""
    match = re.search(r"stopped at step (\d+): (\w+):", failure)
    return (match.group(1), match.group(2)) if match else None


STOPPED_BY_HAND = "stopped by hand"
"""How a ``failure`` tag starts on a run someone ended that the table still shows (a collapse that crawled on)."""


def in_table(run: Any) -> bool:
    """Finished runs; runs the trainer stopped on an error it named (a collapse with no learning signal left, a
    server whose log-probs left the push check's tolerance: results of the row, not failures to run it); and runs
    ended by hand whose ``failure`` tag says so and why. A run tagged ``superseded_by`` (the row run again) is not."""
    tags = run.data.tags
    failure = tags.get("failure", "")
    if "superseded_by" in tags:
        return False
    return (run.info.status == "FINISHED" or (run.info.status == "FAILED" and trainer_stop(failure) is not None)
            or (run.info.status == "KILLED" and failure.startswith(STOPPED_BY_HAND)))


def command(row: dict[str, Any], params: dict[str, str]) -> str:
    """The ``scripts/mismatch_runs.py`` call that trains this row again."""
    parts = ["python scripts/mismatch_runs.py", f"--model tiny:{row['variant']}", f"--mode {row['mode']}",
             f"--setting {row['setting']}"]
    if not row["routing_replay"]:
        parts.append("--no-routing-replay")
    if params.get("seed", "0") != "0":
        parts.append(f"--seed {params['seed']}")
    return " ".join(parts)


def sort_key(row: dict[str, Any]) -> tuple:
    mode = MODE_ORDER.index(row["mode"]) if row["mode"] in MODE_ORDER else len(MODE_ORDER)
    return row["variant"], not row["routing_replay"], row["setting"] != "demo", mode


def fmt(value: Any, style: str = ".3f") -> str:
    """``style``: a format spec, or ``%`` for a share as a percentage."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if style == "%":
        return f"{100 * value:.2f}%"
    return format(value, style) if isinstance(value, float) else str(value)


def replay_text(row: dict[str, Any]) -> str:
    """Routing replay as it ran: asked for, and whether the server returned routes to replay (a CPU server cannot:
    the trainer then routes every token itself, as with replay off)."""
    if "moe" not in row["variant"]:
        return "–"  # no experts to route: the setting does nothing
    if not row["routing_replay"]:
        return "off"
    return "on" if row["routes_returned"] else "on, no routes"


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| variant | replay | setting | mode | steps | reward first → last (gain) | held-out before → after "
            "(gain) | k3 | k3@0 | masked | truncated | max gap | route diff | ended |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        held = (f"{fmt(r['heldout_before'])} → {fmt(r['heldout_after'])} ({r['heldout_gain']:+.3f})"
                if r["heldout_gain"] is not None else "–")
        lines.append(
            f"| {r['variant']} | {replay_text(r)} | {r['setting']} | {r['mode']} | {r['steps']} "
            f"| {fmt(r['reward_first'])} → {fmt(r['reward_last'])} ({r['reward_gain']:+.3f}) | {held} "
            f"| {fmt(r['k3'], '.2e')} | {fmt(r['k3@0'], '.2e')} | {fmt(r['masked'], '%')} | {fmt(r['truncated'], '%')} "
            f"| {fmt(r['max gap'], '.2f')} | {fmt(r['route diff'], '%')} | {r['ended']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI"),
                        help="where the runs are (default: MLFLOW_TRACKING_URI)")
    parser.add_argument("--experiment", default="mismatch-corrections")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--commands", action="store_true", help="list each row's command under the table")
    args = parser.parse_args(argv)
    if not args.tracking_uri:
        parser.error("--tracking-uri (or MLFLOW_TRACKING_URI) names the store the runs were logged to")
    import mlflow

    client = mlflow.MlflowClient(args.tracking_uri)
    experiment = client.get_experiment_by_name(args.experiment)
    if experiment is None:
        known = sorted(e.name for e in client.search_experiments())
        print(f"no experiment {args.experiment!r} at {args.tracking_uri}; experiments there: {known}", file=sys.stderr)
        return 2
    runs = client.search_runs([experiment.experiment_id], filter_string="tags.`mismatch.mode` != ''",
                              max_results=1000)
    rows = sorted((run_row(client, r) for r in runs if in_table(r)), key=sort_key)
    if not rows:
        print(f"experiment {args.experiment!r} has no finished or collapsed run tagged mismatch.mode", file=sys.stderr)
        return 2
    print(markdown(rows))
    if args.commands:
        print()
        for r in rows:
            print(f"    {r['command']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
