"""One row of the stale-sample policy table (docs/staleness.md): one training run, one command.

Trains the tiny arithmetic model through the job flow, as a user runs it (the flow starts the CPU server, evaluates
the held-out prompts before and after training and tracks the run in MLflow), with one ``stale_samples`` policy in
one setting. Every run goes to one experiment (``--experiment``), named ``<setting>-<policy>-seed<seed>``, with the
settings as params and the tags ``staleness.policy`` and ``staleness.setting``; ``scripts/staleness_table.py``
reads the table back from there.

    python scripts/staleness_runs.py --policy keep --setting long_tail --tracking-uri sqlite:///$PWD/outputs/staleness/mlflow.db
    python scripts/staleness_runs.py --policy drop --setting demo --max-steps 3 --no-eval   # a quick check

Settings: ``demo`` (flows/cli.py ``DEMO_TRAINER``) and ``long_tail``: the demo's, with answers up to 64 tokens, half
the prompts answered at length (``benchmarks.staleness.long_tail``: sampled with ``min_tokens``, and paid for length
by ``long_answer_reward`` beside the demo's rewards), so that completion lengths have a heavy tail.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

POLICIES = ("drop", "keep")
SETTINGS = ("demo", "long_tail")
LONG_TAIL_TRAINER = {"max_completion_length": 64}
"""Where the long-tailed setting's trainer departs from the demo's: room for the long answers its reward asks for."""
LONG_TAIL_REWARDS = ["grpo_core.rewards:accuracy_reward", "grpo_core.rewards:format_reward",
                     "benchmarks.staleness.long_tail:long_answer_reward"]
"""The demo's rewards (accuracy first: the held-out accuracy is the first function's mean) and the long-answer one."""
LONG_TAIL_LOOP = "benchmarks.staleness.long_tail:LongTailLoop"
"""The rollout loop that samples the long-answer prompts at length (training and held-out evaluation alike)."""


def job_data(policy: str, setting: str, seed: int, max_steps: int | None, output_dir: str, name: str, evaluate: bool,
             experiment: str, tracking_uri: str | None) -> dict[str, Any]:
    """The job of one row (a ``JobConfig`` mapping)."""
    from flows.cli import DEMO_TRAINER

    trainer: dict[str, Any] = {**DEMO_TRAINER, "output_dir": output_dir, "seed": seed, "run_name": name,
                               "stale_samples": policy, "do_eval": evaluate}
    job: dict[str, Any] = {"trainer": trainer}
    if setting == "long_tail":
        trainer.update(LONG_TAIL_TRAINER)
        job["reward_funcs"] = LONG_TAIL_REWARDS
        job["loop_cls"] = LONG_TAIL_LOOP
    if max_steps:
        trainer["max_steps"] = max_steps
    # The table's columns, as tags the run gets when it is created.
    job["tracking"] = {"experiment": experiment, "tracking_uri": tracking_uri,
                       "tags": {"staleness.policy": policy, "staleness.setting": setting}}
    return job


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", choices=POLICIES, required=True)
    parser.add_argument("--setting", choices=SETTINGS, default="demo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=None, help="override the setting's step count")
    parser.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation before and after")
    parser.add_argument("--experiment", default="stale-sample-policies", help="the MLflow experiment of the table")
    parser.add_argument("--tracking-uri", default=None,
                        help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else a SQLite store in the run folder)")
    parser.add_argument("--output-dir", default="outputs/staleness")
    parser.add_argument("--server-url", default=None, help="a running vLLM server to train against")
    args = parser.parse_args(argv)

    from flows.cli import _run, print_mlflow_links
    from grpo_core.launch.job import JobConfig

    name = f"{args.setting}-{args.policy}-seed{args.seed}"
    output_dir = str((Path(args.output_dir) / name).absolute())
    job = job_data(args.policy, args.setting, args.seed, args.max_steps, output_dir, name, not args.no_eval,
                   args.experiment, args.tracking_uri)
    if args.server_url:
        job["server"] = {"managed": False, "base_url": args.server_url}
    summary = _run(JobConfig.model_validate(job))
    print(json.dumps(summary, indent=2))
    print_mlflow_links(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
