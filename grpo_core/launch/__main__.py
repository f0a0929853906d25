"""Training-process entry point: ``python -m grpo_core.launch JOB.json --server-url URL [...]``.

The Prefect flow starts this as a child process (under ``torchrun`` for several ranks), so that a
killed trainer (preemption) leaves the flow alive to restart it. The job file is parsed before
anything heavy is imported, so a bad config fails in a second. Rank 0 writes ``--result`` (JSON:
the per-step metric history and where training stopped).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from grpo_core.launch import write_failure
from grpo_core.launch.job import JobConfig, import_string, lora_config, resolve_dataset, resolve_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m grpo_core.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("job", help="JobConfig as a JSON file")
    parser.add_argument("--server-url", required=True,
                        help="vLLM server base URL; a fleet's servers' URLs joined by commas")
    parser.add_argument("--model-path", help="resolved model folder (default: resolve job.model here)")
    parser.add_argument("--mlflow-run-id", help="continue logging into this MLflow run")
    parser.add_argument("--tracking-uri", help="MLflow tracking URI")
    parser.add_argument("--result", help="where rank 0 writes the result JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    job = JobConfig.model_validate_json(Path(args.job).read_text())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore", "urllib3", "vllm"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    from grpo_core.ranks import DistInfo
    from grpo_core.tracking.tracker import MLflowTracker, NullTracker
    from grpo_core.training.collector import NoLearningSignalError
    from grpo_core.training.trainer import AsyncGRPOTrainer

    urls = [u for u in args.server_url.split(",") if u]
    config = job.trainer_config(vllm_server_base_url=urls[0] if len(urls) == 1 else urls)
    model_path = args.model_path or resolve_model(job.model)
    if job.trainer.environment is None:
        data = resolve_dataset(job.dataset, job.trainer.seed)
        train_dataset = data["train"] if "train" in data else data
        eval_dataset = data["eval"] if config.eval_strategy != "no" and "eval" in data else None
        reward_funcs = [import_string(name) for name in job.reward_funcs]
    else:  # the trainer builds both from the environment the config names
        train_dataset = eval_dataset = None
        reward_funcs = []
    dist = DistInfo.from_env()
    tracker = NullTracker()
    if dist.is_main and config.report_to == "mlflow":
        run_id = args.mlflow_run_id
        if run_id is None and config.resume_from_checkpoint:
            from grpo_core.checkpoint import saved_run_id

            # Resumed by hand (not by the flow): keep logging into the run the checkpoint belongs to.
            run_id = saved_run_id(config.output_dir, config.resume_from_checkpoint)
        tracker = MLflowTracker(args.tracking_uri, job.tracking.experiment, config.run_name, run_id=run_id,
                                flush_timeout_s=config.tracking_flush_timeout_s)
    trainer_cls = AsyncGRPOTrainer
    if job.loop_cls:
        # The job's rollout stages, as a script would set them on a trainer subclass.
        trainer_cls = type("JobTrainer", (AsyncGRPOTrainer,), {"loop_cls": import_string(job.loop_cls)})
    trainer = trainer_cls(
        model=model_path,
        reward_funcs=reward_funcs,
        args=config,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=lora_config(job.peft_config) if job.peft_config else None,
        tools=[import_string(name) for name in job.tools] or None,
        environment_factory=import_string(job.environment_factory) if job.environment_factory else None,
        tracker=tracker,
    )
    status = "FAILED"
    try:
        history = trainer.train()
        status = "FINISHED"
    except Exception as err:
        if dist.is_main and args.result:
            # the flow reads it: whether to resume (a resume would start from the same policy and stop the same
            # way on no learning signal), and the error to name when it gives up
            write_failure(args.result, trainer.global_step, err, resumable=not isinstance(err, NoLearningSignalError))
        raise
    finally:
        if dist.is_main and args.result and status == "FINISHED":
            Path(args.result).write_text(
                json.dumps({"global_step": trainer.global_step, "history": history}, indent=None)
            )
        # A failed process leaves the run RUNNING: the flow decides whether it resumes or fails.
        if status == "FINISHED":
            tracker.close("FINISHED")
        else:
            tracker.flush()  # what the failed attempt logged still reaches the run
    return 0


if __name__ == "__main__":
    sys.exit(main())
