"""Held-out evaluation beside training, against no evaluation and against a blocking one (issue 62).

Every arm trains the demo's trainer (``flows.cli.DEMO_TRAINER``: the tiny arithmetic model, 64 samples a step) for
the same steps with the same seed, against one CPU vLLM server, one arm after the other:

- ``none``: no held-out evaluation during training;
- ``blocking``: every ``--eval-steps`` steps, the step waits for the evaluation (``eval_beside_training=False``);
- ``beside``: the same evaluations beside training (``eval_beside_training=True``): the step goes on;
- ``paired``: beside training as above, each evaluated version first evaluated blocking, on the same held-out
  prompts, right after its push; so the two evaluations of one version can be compared. Its step times are not
  compared (the blocking one stops its steps).

Per arm: the median of the steps' ``perf/step_s`` (all steps, and the steps that were not evaluation steps) and the
run's wall time; the ratios beside ÷ none and blocking ÷ none. For ``paired``, per evaluated version: the blocking
evaluation's accuracy with its 95% interval over problems (``flows.heldout``), the beside one's accuracy (the
trainer's ``eval/rewards/accuracy_reward``, logged against the version's step) and its ``eval/version_share``, and
whether the beside accuracy lies in the blocking one's interval.

On a CPU machine the evaluation's requests go to the server that generates the training rollouts, on the same
cores: beside training there, an evaluation takes compute from the rollouts, which a GPU server with room to batch
both, or a fleet member, does not. On a machine with a GPU (the recipe of benchmarks/device/pack_vllm_cuda.sh), the
started server shares the trainer's GPU as the flow places it (``gpu_placement``: its memory share, the push through
the host or CUDA IPC), and the trainer computes in bf16 as the server does.

    python -m benchmarks.staleness.eval_beside --out benchmarks/results/eval_beside.json
    python -m benchmarks.staleness.eval_beside --smoke --server-url URL --out /tmp/eval_beside.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_io import write_report

ARMS = ("none", "beside", "blocking", "paired")
ACCURACY = "eval/rewards/accuracy_reward"


def trainer_args(arm: str, url: str, work: Path, steps: int, eval_steps: int, eval_generations: int,
                 on_gpu: dict[str, Any] | None = None, samples_per_step: int | None = None) -> Any:
    """The demo's trainer for ``arm``; ``on_gpu``: the fields that differ where the server shares a GPU with it;
    ``samples_per_step``: in place of the demo's 64 (the smoke's fewer)."""
    from flows.cli import DEMO_TRAINER
    from grpo_core.config import AsyncGRPOConfig

    name, (arm, _, in_flight) = arm.replace("@", "-"), arm.partition("@")
    evaluates = arm != "none"
    batch = {"per_device_train_batch_size": samples_per_step} if samples_per_step else {}
    if in_flight:
        batch["eval_beside_prompts_in_flight"] = int(in_flight)
    return AsyncGRPOConfig(**{
        **DEMO_TRAINER, **(on_gpu or {}), **batch, "max_steps": steps, "output_dir": str(work / name), "vllm_server_base_url": url,
        "report_to": "none", "save_strategy": "no", "num_generations_eval": eval_generations,
        "eval_strategy": "steps" if evaluates else "no", "eval_steps": eval_steps,
        "eval_beside_training": arm in ("beside", "paired"),
    })


def run_arm(arm: str, url: str, model_path: str, data: Any, work: Path, steps: int, eval_steps: int,
            eval_generations: int, on_gpu: dict[str, Any] | None = None,
            samples_per_step: int | None = None) -> dict[str, Any]:
    from flows.heldout import heldout_scores
    from grpo_core.evaluation.heldout import evaluate_rewards
    from grpo_core.evaluation.intervals import interval
    from grpo_core.rewards import accuracy_reward, format_reward
    from grpo_core.training.trainer import AsyncGRPOTrainer

    args = trainer_args(arm, url, work, steps, eval_steps, eval_generations, on_gpu, samples_per_step)
    trainer = AsyncGRPOTrainer(model_path, [accuracy_reward, format_reward], args=args, train_dataset=data["train"],
                               eval_dataset=data["eval"] if arm != "none" else None)
    blocking: dict[int, dict[str, Any]] = {}
    if arm.startswith("paired"):
        start_beside = trainer.run.evaluate_step
        problems = [row["problem"] for row in data["eval"]]

        def blocking_then_beside(dataset: Any, version: int) -> dict[str, float]:
            # The server serves ``version`` now and nothing is pushed until this returns: a blocking evaluation of it.
            result = evaluate_rewards(url, trainer.processing_class, dataset, [accuracy_reward, format_reward],
                                      samples_per_prompt=args.num_eval_generations(), temperature=args.temperature,
                                      max_tokens=args.max_completion_length, config=args, version=version)
            scores = heldout_scores(result, problems)
            ci = interval(scores["problems"].values())
            blocking[version] = {"accuracy": result.accuracy, "ci95": [ci.low, ci.high]}
            return start_beside(dataset, version)

        trainer.run.evaluate_step = blocking_then_beside
    began = time.perf_counter()
    history = trainer.train()
    wall_s = time.perf_counter() - began
    steps_logged = [h for h in history if "perf/step_s" in h]
    evaluated = {int(h["step"]) for h in history if ACCURACY in h or "eval/skipped" in h}
    plain = [h["perf/step_s"] for h in steps_logged if int(h["step"]) % eval_steps != 0 or arm == "none"]
    evaluated_s = [h["eval/seconds"] for h in history if "eval/seconds" in h]
    out: dict[str, Any] = {
        "arm": arm, "steps": len(steps_logged), "wall_s": wall_s,
        "step_s_median": statistics.median(h["perf/step_s"] for h in steps_logged),
        "step_s_median_no_eval_step": statistics.median(plain) if plain else None,
        "evaluations": sorted(evaluated),
        "skipped": sum(h.get("eval/skipped", 0.0) for h in history),
        "eval_seconds_median": statistics.median(evaluated_s) if evaluated_s else None,
    }
    if arm.startswith("paired"):
        beside = {int(h["step"]): h for h in history if ACCURACY in h}
        pairs = []
        for version, b in sorted(blocking.items()):
            late = beside.get(version)
            row = {"version": version, "blocking_accuracy": b["accuracy"], "blocking_ci95": b["ci95"],
                   "beside_accuracy": late[ACCURACY] if late else None,
                   "beside_version_share": late.get("eval/version_share") if late else None}
            row["beside_within_interval"] = (late is not None and b["ci95"][0] <= late[ACCURACY] <= b["ci95"][1])
            pairs.append(row)
        out["pairs"] = pairs
    print(f"{arm:9s} {out['steps']:4d} steps  median step {out['step_s_median']:.3f} s  "
          f"(no eval step: {out['step_s_median_no_eval_step'] or float('nan'):.3f} s)  wall {wall_s:.0f} s", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120, help="steps per arm (the demo's 120)")
    parser.add_argument("--eval-steps", type=int, default=20, help="an evaluation every N steps")
    parser.add_argument("--eval-generations", type=int, default=16,
                        help="completions per held-out prompt (the demo's num_generations_eval)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"which of {ARMS}, in this order; beside@N and "
                        "paired@N evaluate N held-out prompts at once (eval_beside_prompts_in_flight)")
    parser.add_argument("--server-url", default=None, help="a running CPU server of the tiny model (else one is started)")
    parser.add_argument("--samples-per-step", type=int, default=None,
                        help="samples a step (default: the demo's per_device_train_batch_size, 64)")
    parser.add_argument("--api-server-count", type=int, default=1,
                        help="API server processes of the started server (ServerOptions.api_server_count)")
    parser.add_argument("--smoke", action="store_true", help="3 steps per arm of 16 samples (2 groups), an evaluation "
                        "every 2, 8 held-out prompts of 2 completions: checks the script")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    num_eval = 100
    if args.smoke:
        args.steps, args.eval_steps, args.eval_generations, num_eval = 3, 2, 2, 8
        args.samples_per_step = args.samples_per_step or 16

    from grpo_core.config import AsyncGRPOConfig
    from grpo_core.tiny import arithmetic_dataset, build_tiny_model
    from grpo_core.vllm_server.process import ServerOptions, VLLMServer, VLLMServerSpec

    model_path = str(build_tiny_model())
    data = arithmetic_dataset(num_eval=num_eval)
    work = Path(tempfile.mkdtemp(prefix="eval_beside-"))
    server, on_gpu = None, None
    if args.server_url is None:
        cuda = torch_cuda_available()
        config = AsyncGRPOConfig(output_dir=str(work / "server"), bf16=cuda)
        options = ServerOptions(api_server_count=args.api_server_count)
        spec = VLLMServerSpec.for_run(model_path, config, options, cuda=cuda, shared_gpu=cuda)
        if cuda:  # the trainer computes as the server does and pushes the way the flow would on a shared GPU
            on_gpu = {"bf16": True, "weight_transfer_backend": spec.weight_transfer_backend}
        server = VLLMServer(spec, work / "server").start(timeout_s=900)
    url = args.server_url or server.base_url
    report: dict[str, Any] = {"steps": args.steps, "eval_steps": args.eval_steps, "samples_per_step": args.samples_per_step,
                              "eval_generations": args.eval_generations, "eval_prompts": num_eval,
                              "device": "cuda" if on_gpu else "cpu", "trainer_on_gpu": on_gpu,
                              "api_server_count": args.api_server_count if server is not None else None, "arms": {}}
    try:
        for arm in [a for a in args.arms.split(",") if a]:
            if arm.partition("@")[0] not in ARMS:
                raise SystemExit(f"--arms: {arm!r} is none of {ARMS}")
            report["arms"][arm] = run_arm(arm, url, model_path, data, work, args.steps, args.eval_steps,
                                          args.eval_generations, on_gpu, args.samples_per_step)
            write_report(args.out, report)  # each arm kept as it ends: a time bound loses only the running one
    finally:
        if server is not None:
            server.stop()
    arms = report["arms"]
    if "none" in arms:
        base = arms["none"]["step_s_median"]
        report["ratios"] = {f"{arm}_over_none": arms[arm]["step_s_median"] / base for arm in arms
                            if arm.partition("@")[0] in ("beside", "blocking")}
        print("step time ÷ none (median of steps): " + ", ".join(f"{k} {v:.3f}" for k, v in report["ratios"].items()))
    for pair in [p for arm in arms if arm.startswith("paired") for p in arms[arm].get("pairs", [])]:
        beside = pair["beside_accuracy"]
        print(f"version {pair['version']:4d}: blocking {pair['blocking_accuracy']:.3f} "
              f"[{pair['blocking_ci95'][0]:.3f}, {pair['blocking_ci95'][1]:.3f}]  beside "
              f"{'n/a' if beside is None else f'{beside:.3f}'} (version share {pair['beside_version_share']})  "
              f"within: {pair['beside_within_interval']}")
    write_report(args.out, report)
    return 0


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    raise SystemExit(main())
