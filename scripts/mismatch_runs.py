"""One row of the correction-mode table (docs/mismatch.md): one training run, one command.

Trains a tiny variant whose CPU server computes in bf16 (``tiny:arithmetic-hybrid``, the Gated DeltaNet hybrid;
``tiny:arithmetic-hybrid-moe``, Qwen3.5-MoE) with one importance-sampling correction mode at the demo's settings
or at a harsher one, through the job flow as a user runs it: the flow starts the model's server (bf16, routes
returned for an MoE model), evaluates the held-out prompts before and after training and tracks the run in
MLflow. Every run of the table goes to one experiment (``--experiment``), named
``<variant>-<mode>-<setting>[-no-replay]-seed<seed>``, with the settings as params and these tags:
``mismatch.mode``, ``mismatch.setting``, ``mismatch.routing_replay``, ``mismatch.variant``; the table is read
from there (``notebooks/compare_experiments.ipynb`` or an MLflow search on those tags).

    python scripts/mismatch_runs.py --model tiny:arithmetic-hybrid --mode token_truncate --setting harsh \\
        --tracking-uri sqlite:///outputs/mismatch/mlflow.db
    python scripts/mismatch_runs.py --model tiny:arithmetic-hybrid-moe --mode none --no-routing-replay
    python scripts/mismatch_runs.py --mode sequence_mask --max-steps 3 --no-eval   # a quick check of the script

Modes: ``none`` (``vllm_importance_sampling_correction=False``) and the four of ``vllm_importance_sampling_mode``.
Settings: ``demo`` (flows/cli.py ``DEMO_TRAINER``: lr 2e-4, staleness up to 2, 120 steps) and ``harsh``
(``HARSH``: lr 1e-3 and staleness up to 4, the same steps). ``--server-url`` trains against a server already
running (its flags must suit the model: bf16, routes for an MoE model) instead of starting one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("none", "token_mask", "token_truncate", "sequence_mask", "sequence_truncate")
HARSH = {"learning_rate": 1e-3, "max_staleness": 4}
"""Where the harsh setting departs from the demo's: a learning rate five times the demo's, and samples up to four
weight updates old (the rollout worker runs that far ahead: ``max_concurrent_rollouts`` follows ``max_staleness``)."""


def trainer_settings(mode: str, setting: str, routing_replay: bool, seed: int, max_steps: int | None,
                     output_dir: str, run_name: str, evaluate: bool) -> dict[str, Any]:
    """The trainer's settings of one run (an ``AsyncGRPOConfig`` mapping)."""
    from flows.cli import DEMO_TRAINER

    settings: dict[str, Any] = {**DEMO_TRAINER, "output_dir": output_dir, "seed": seed, "run_name": run_name,
                                "routing_replay": routing_replay, "do_eval": evaluate}
    if setting == "harsh":
        settings.update(HARSH)
    if max_steps:
        settings["max_steps"] = max_steps
    if mode == "none":
        settings["vllm_importance_sampling_correction"] = False
    else:
        settings["vllm_importance_sampling_mode"] = mode
    return settings


def run_name(variant: str, mode: str, setting: str, routing_replay: bool, seed: int) -> str:
    return f"{variant}-{mode}-{setting}{'' if routing_replay else '-no-replay'}-seed{seed}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny:arithmetic-hybrid",
                        help="a tiny variant served in bf16 on CPU: tiny:arithmetic-hybrid or tiny:arithmetic-hybrid-moe")
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--setting", choices=("demo", "harsh"), default="demo")
    parser.add_argument("--no-routing-replay", action="store_true", help="MoE models: train with the trainer's own routes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=None, help="override the setting's step count")
    parser.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation before and after")
    parser.add_argument("--experiment", default="mismatch-corrections", help="the MLflow experiment of the table")
    parser.add_argument("--tracking-uri", default=None,
                        help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else a SQLite store in the run folder)")
    parser.add_argument("--output-dir", default="outputs/mismatch")
    parser.add_argument("--server-url", default=None, help="a running vLLM server to train against")
    args = parser.parse_args(argv)

    from flows.cli import _run, print_mlflow_links
    from grpo_core.launch.job import JobConfig

    variant = args.model.removeprefix("tiny:")
    replay = not args.no_routing_replay
    name = run_name(variant, args.mode, args.setting, replay, args.seed)
    output_dir = str((Path(args.output_dir) / name).absolute())
    job: dict[str, Any] = {
        "model": args.model,
        "trainer": trainer_settings(args.mode, args.setting, replay, args.seed, args.max_steps, output_dir, name,
                                    evaluate=not args.no_eval),
        # The table's columns, as tags the run gets when it is created (a run the trainer stops carries them too).
        "tracking": {"experiment": args.experiment, "tracking_uri": args.tracking_uri,
                     "tags": {"mismatch.mode": args.mode, "mismatch.setting": args.setting,
                              "mismatch.routing_replay": str(replay), "mismatch.variant": variant}},
    }
    if args.server_url:
        job["server"] = {"managed": False, "base_url": args.server_url}
    config = JobConfig.model_validate(job)
    summary = _run(config)
    print(json.dumps(summary, indent=2))
    print_mlflow_links(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
