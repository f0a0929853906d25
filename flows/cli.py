"""The ``grpo`` command.

    grpo demo --output-dir DIR       the embedded default: tiny model, CPU vLLM server, MLflow under DIR
    grpo demo --model tiny:arithmetic-hybrid   the same with a Qwen3.5 hybrid (or tiny:arithmetic-vlm)
    grpo train JOB.yaml              the same flow from a job file (see examples/)
    grpo ui [DIR | STORE]            MLflow's UI for a run's store on a free port; prints the run's links
    grpo deploy [--file prefect.yaml]   register the deployments with a Prefect server
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:  # imported where used: the CLI's --help does not load the trainer's modules
    from grpo_core.launch.job import JobConfig

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


def _job_from_yaml(path: str, output_dir: str | None, server_url: str | None = None) -> JobConfig:
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
    print_mlflow_links(summary, out)
    print(f"summary: {Path(out) / 'summary.json'}")
    if summary.get("picture"):
        print(f"picture: {summary['picture']}")
    print(heldout_line(summary))
    return 0


def print_mlflow_links(summary: dict, output_dir: str | None = None) -> None:
    """Where to see the run: for a file or database store, the command (by its full path, so it runs in any shell)
    that serves its UI and prints the links; for a tracking server, the links themselves ("Model training" mode)."""
    import mlflow

    from grpo_core.tracking.run_view import ui_command
    from grpo_core.tracking.ui import print_links

    uri, run_id = summary["mlflow_tracking_uri"], summary["mlflow_run_id"]
    print(f"\nMLflow run {run_id} in {uri}")
    serve = ui_command(uri, output_dir or uri)
    if serve:
        print(f"  open it in MLflow's UI (serves it on a free port, prints the links; Ctrl-C stops it):\n    {serve}")
    else:
        print_links(uri, mlflow.MlflowClient(uri), run_id)


def cmd_train(args: argparse.Namespace) -> int:
    from flows.heldout import heldout_line

    job = _job_from_yaml(args.config, args.output_dir, args.server_url)
    summary = _run(job)
    print(json.dumps(summary, indent=2))
    from flows.train_flow import local_run_dir

    print_mlflow_links(summary, str(local_run_dir(job)))
    if summary.get("eval_accuracy_before") is not None:
        print(heldout_line(summary))
    return 0


def ui_target(target: str) -> tuple[str, str | None]:
    """``grpo ui``'s argument as (the store, the run to link to): a run's output folder (its ``summary.json``
    names both), or a store's URI (``sqlite:///...``; the links then go to its newest run)."""
    folder = Path(target)
    if (folder / "summary.json").is_file():
        summary = json.loads((folder / "summary.json").read_text())
        return summary["mlflow_tracking_uri"], summary["mlflow_run_id"]
    if (folder / "mlflow.db").is_file():
        return f"sqlite:///{(folder / 'mlflow.db').absolute()}", None
    if "://" in target:
        return target, None
    raise SystemExit(f"grpo ui: {target} is neither a run's output folder (with summary.json or mlflow.db) nor a "
                     "store URI (sqlite:///PATH/mlflow.db)")


def newest_run(client, store: str) -> str | None:  # noqa: ANN001
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, order_by=["attributes.start_time DESC"], max_results=1) if experiments else []
    return runs[0].info.run_id if runs else None


KEEP_VIEW_NOTE = (
    "The links open MLflow's \"Model training\" pages and the experiment's headline columns. MLflow's UI keeps both "
    "in the browser only: to keep them after a reload and from its home page, click \"Override saved view\" in the "
    "banner of the page the experiment's link opens, and \"Model training\" at the top left of the home page (the "
    "first link above), once each.")
"""What ``grpo ui`` says once, after the links: MLflow's UI (3.17) keeps the workflow type and an experiment's columns
in the browser's local storage only, which no link or tag sets (tests/test_mlflow_browser.py shows both clicks keep
them)."""


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def cmd_ui(args: argparse.Namespace) -> int:
    import signal
    import time

    import mlflow

    from grpo_core.tracking.ui import MLflowUI, print_links

    store, run_id = ui_target(args.target)
    client = mlflow.MlflowClient(store)
    run_id = run_id or newest_run(client, store)
    print(f"starting MLflow's UI for {store} ...", flush=True)
    # SIGTERM ends the command as Ctrl-C does, so the UI's process group is stopped either way.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        with MLflowUI(store, port=args.port, log_file=args.log_file) as ui:
            # The home page without the workflow parameter: there, one click on "Model training" is kept by the browser.
            print(f"MLflow's UI: {ui.address}/#/experiments", flush=True)
            if run_id:
                print(f"run {run_id}:", flush=True)
                print_links(ui.address, client, run_id)
            print(KEEP_VIEW_NOTE, flush=True)
            print("Ctrl-C stops it.", flush=True)
            while ui.proc is not None and ui.proc.poll() is None:
                time.sleep(1)
            print(f"MLflow's UI exited with {ui.proc.returncode if ui.proc else None}", flush=True)
            return 1
    except KeyboardInterrupt:
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
    ui = sub.add_parser("ui", help="serve MLflow's UI for a run's store on a free port and print the run's links")
    ui.add_argument("target", nargs="?", default="outputs/demo",
                    help="a run's output folder (default outputs/demo) or a store URI (sqlite:///PATH/mlflow.db)")
    ui.add_argument("--port", type=int, default=0, help="serve on this port (default: a free one)")
    ui.add_argument("--log-file", default=None, help="write the UI server's own output here")
    ui.set_defaults(func=cmd_ui)
    deploy = sub.add_parser("deploy", help="register prefect.yaml's deployments")
    deploy.add_argument("--file", default="prefect.yaml")
    deploy.add_argument("--name", action="append", help="only these deployments")
    deploy.set_defaults(func=cmd_deploy)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
