"""The ``grpo`` command.

    grpo demo --output-dir DIR       the embedded default: tiny model, CPU vLLM server, MLflow under DIR
    grpo demo --model tiny:arithmetic-hybrid   the same with a Qwen3.5 hybrid (or tiny:arithmetic-vlm)
    grpo train JOB.yaml              the same flow from a job file (see examples/)
    grpo deploy [--file prefect.yaml]   register the deployments with a Prefect server
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import yaml

# The demo must finish in minutes on two cores; these values were measured to learn within that.
DEMO_TRAINER = {
    "bf16": False,  # the CPU server samples in fp32; the trainer's log-probs match it in fp32
    "max_steps": 120,
    "learning_rate": 2e-4,
    "num_generations": 8,
    "per_device_train_batch_size": 64,
    "max_completion_length": 24,
    "max_staleness": 2,
    "num_sampler_logprobs": 8,
    "num_generations_eval": 16,  # 16 x 100 held-out prompts: each problem's accuracy from 80 samples
    "save_steps": 40,
    "logging_steps": 1,
    "token_budget": 4096,
}


def _job_from_yaml(path: str, output_dir: str | None, server_url: str | None = None) -> "JobConfig":  # noqa: F821
    from grpo_core.launch.job import JobConfig

    data = yaml.safe_load(Path(path).read_text()) or {}
    if output_dir:
        data.setdefault("trainer", {})["output_dir"] = output_dir
    if server_url:
        # A server that is already running: the flow neither starts nor stops it.
        data["server"] = {**data.get("server", {}), "managed": False, "base_url": server_url}
    return JobConfig.model_validate(data)


def _run(job) -> dict:  # noqa: ANN001
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # The temporary API server a flow starts when no PREFECT_API_URL is set gets 20 s by default; on a
    # loaded two-core machine (a CPU vLLM server beside it) it needs more.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    from flows.train_flow import grpo_train

    return grpo_train(job)


def cmd_demo(args: argparse.Namespace) -> int:
    from flows.heldout import heldout_line
    from grpo_core.launch.job import JobConfig

    out = str(Path(args.output_dir).absolute())
    trainer = {**DEMO_TRAINER, "output_dir": out, "seed": args.seed}
    if args.max_steps:
        trainer["max_steps"] = args.max_steps
    # The model decides its server's settings (bf16 for Gated DeltaNet layers on CPU, no vision tower).
    job = JobConfig.model_validate({"trainer": trainer, **({"model": args.model} if args.model else {})})
    summary = _run(job)
    print(json.dumps(summary, indent=2))
    print_mlflow_links(summary)
    print(f"summary: {Path(out) / 'summary.json'}")
    if summary.get("picture"):
        print(f"picture: {summary['picture']}")
    print(heldout_line(summary))
    return 0


def print_mlflow_links(summary: dict) -> None:
    """Where to see the run: the command that serves the UI of the store (a file or a database) and the links
    that open the run and its experiment's runs (not MLflow's GenAI views)."""
    import mlflow

    from grpo_core.tracking.run_view import experiment_url, run_url, ui_command

    uri, run_id = summary["mlflow_tracking_uri"], summary["mlflow_run_id"]
    experiment_id = mlflow.MlflowClient(uri).get_run(run_id).info.experiment_id
    print(f"\nMLflow run {run_id} in {uri}")
    if serve := ui_command(uri):
        print(f"  serve the UI:   {serve}")
    print(f"  the run:        {run_url(uri, experiment_id, run_id)}")
    print(f"  its charts:     {run_url(uri, experiment_id, run_id, 'model-metrics')}")
    print(f"  the experiment: {experiment_url(uri, experiment_id)}")


def cmd_train(args: argparse.Namespace) -> int:
    from flows.heldout import heldout_line

    summary = _run(_job_from_yaml(args.config, args.output_dir, args.server_url))
    print(json.dumps(summary, indent=2))
    print_mlflow_links(summary)
    if summary.get("eval_accuracy_before") is not None:
        print(heldout_line(summary))
    return 0


def cmd_deploy(args: argparse.Namespace) -> int:
    from flows.deploy import deploy_all

    deploy_all(args.file, names=args.name or None)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grpo", description="Asynchronous GRPO training.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the embedded default end to end on this machine")
    demo.add_argument("--output-dir", default="outputs/demo")
    demo.add_argument("--max-steps", type=int, default=None, help="override the demo's step count")
    demo.add_argument("--seed", type=int, default=0,
                      help="the trainer's seed; it also orders the prompts, so one seed gives the same held-out prompts")
    demo.add_argument("--model", default=None,
                      help="another model, e.g. tiny:arithmetic-hybrid (Gated DeltaNet) or tiny:arithmetic-vlm (vision-language)")
    demo.set_defaults(func=cmd_demo)
    train = sub.add_parser("train", help="run a job from a YAML file")
    train.add_argument("config")
    train.add_argument("--output-dir", default=None)
    train.add_argument("--server-url", default=None, help="train against this running vLLM server instead of starting one")
    train.set_defaults(func=cmd_train)
    deploy = sub.add_parser("deploy", help="register prefect.yaml's deployments")
    deploy.add_argument("--file", default="prefect.yaml")
    deploy.add_argument("--name", action="append", help="only these deployments")
    deploy.set_defaults(func=cmd_deploy)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
