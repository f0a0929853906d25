"""Multi-turn tool episodes whose trained tokens differ from the sampled ones: message path vs token path.

Runs the rollout loop (``grpo_core.rollout.stages.AsyncRolloutLoop``) of the tiny tools model (it calls the
``calculator`` tool, ``grpo_core.tiny``) against a real CPU vLLM server until it has ``--episodes`` rollouts of
two turns or more, once per prompt-building path (``multi_turn_prompts``) and chat template:

    tiny            the tiny model's own ChatML template (re-renders a well-formed call byte for byte)
    compact_args    re-serialises tool-call arguments with compact JSON, as templates with their own
                    ``tojson`` style do (tests/test_loop_templates.py)
    drop_reasoning  drops the reasoning of earlier assistant turns, as Qwen3's template does

An episode counts as *differing* when some turn's sampled tokens are not all trained in exactly the context the
server sampled them in (``token_prompts.sampled_exactly``: the message path's REALIGN makes the re-tokenised span
context and trains the rest under a context it was not sampled in). Also counted: episodes with a non-CLEAN turn
(REALIGN or FORK; a FORK keeps the sampled tokens exact but trains the re-rendered history as a second sequence),
and turns where the token path fell back to re-rendering.

    .venv/bin/python -m benchmarks.rollout.token_path_mismatch                      # 100 episodes, own server
    .venv/bin/python -m benchmarks.rollout.token_path_mismatch --episodes 20 --server-url URL   # a server that
        # already serves the tools model's weights (tests/integration/test_token_path.py pushes them first)
    .venv/bin/python -m benchmarks.rollout.token_path_mismatch --smoke --server-url URL --out /tmp/t.json
        # the script runs: 2 episodes of one template, at most 64 rollouts per path (tests/test_benchmarks.py)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.bench_io import write_report
from grpo_core.config import AsyncGRPOConfig
from grpo_core.rollout.stages import AsyncRolloutLoop
from grpo_core.rollout.token_prompts import sampled_exactly
from grpo_core.tiny import arithmetic_dataset, build_tiny_model
from grpo_core.tiny import calculator as tiny_calculator

TEMPLATES = ("tiny", "compact_args", "drop_reasoning")
PATHS = ("messages", "tokens")


def calculator(expression: str):  # noqa: ANN201 - no return hint: the schema must be the one the model learnt
    """Evaluate an integer arithmetic expression.

    Args:
        expression: such as 7 + 5
    """
    return tiny_calculator(expression)


def template_tokenizer(tokenizer: Any, name: str) -> Any:
    if name == "tiny":
        return tokenizer
    from tests.test_loop_templates import COMPACT_ARGS_TEMPLATE, DROP_REASONING_TEMPLATE, with_template

    return with_template(tokenizer, {"compact_args": COMPACT_ARGS_TEMPLATE, "drop_reasoning": DROP_REASONING_TEMPLATE}[name])


async def count(server_url: str, tokenizer: Any, path: str, episodes: int, seed: int, concurrency: int = 32,
                max_rollouts: int = 20000) -> dict[str, float]:
    """Roll out until ``episodes`` multi-turn episodes; count the differing ones."""
    config = AsyncGRPOConfig(vllm_server_base_url=server_url, report_to="none", max_completion_length=64,
                             temperature=1.0, max_concurrent_rollouts=concurrency, multi_turn_prompts=path, seed=seed)
    rows = list(arithmetic_dataset(num_train=512, num_eval=1, seed=seed)["train"])
    loop = AsyncRolloutLoop(config, tokenizer, rows, [], server_url, emit=None, tools=[calculator])
    await loop.connect()
    found: dict[str, float] = dict(episodes=0, differing=0, not_clean=0, rollouts=0, fallback_turns=0, turns=0)
    try:
        next_row = 0
        while found["episodes"] < episodes and found["rollouts"] < max_rollouts:
            batch = [(next_row + i) % len(rows) for i in range(concurrency)]
            next_row += concurrency
            rollouts = await asyncio.gather(*(loop.generate_one(i, rows[i], 0) for i in batch))
            for rollout in rollouts:
                found["rollouts"] += 1
                if len(rollout.turns) < 2 or found["episodes"] >= episodes:
                    continue
                result = loop.reconcile(rollout)
                found["episodes"] += 1
                found["turns"] += len(rollout.turns)
                found["differing"] += not sampled_exactly(result.sequences, rollout.turns)
                found["not_clean"] += (result.stats.realign + result.stats.fork) > 0
                found["fallback_turns"] += rollout.metrics.get("rollout/token_path_fallbacks", 0.0)
    finally:
        await loop.close()
    return found


def measure(server_url: str, model_path: str, episodes: int, templates: tuple[str, ...], seed: int,
            max_rollouts: int = 20000) -> dict[str, Any]:
    from transformers import AutoTokenizer

    base = AutoTokenizer.from_pretrained(model_path)
    report: dict[str, Any] = {}
    for name in templates:
        for path in PATHS:
            found = asyncio.run(count(server_url, template_tokenizer(base, name), path, episodes, seed,
                                      max_rollouts=max_rollouts))
            report[f"{name}/{path}"] = found
            print(f"{name:15s} {path:9s} episodes {int(found['episodes']):4d}  differing {int(found['differing']):4d}  "
                  f"non-clean {int(found['not_clean']):4d}  token-path fallbacks {int(found['fallback_turns']):3d}  "
                  f"(rollouts drawn {int(found['rollouts'])})", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--templates", default=",".join(TEMPLATES))
    parser.add_argument("--server-url", default=None, help="a server serving the tools model (else one is started)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="also write the counts as JSON here")
    parser.add_argument("--smoke", action="store_true", help="2 episodes of compact_args, at most 64 rollouts per path")
    args = parser.parse_args(argv)
    model = str(build_tiny_model(variant="tools"))
    templates = tuple(t for t in args.templates.split(",") if t)
    max_rollouts = 20000
    if args.smoke:
        args.episodes, templates, max_rollouts = 2, ("compact_args",), 64
    if args.server_url:
        report = measure(args.server_url, model, args.episodes, templates, args.seed, max_rollouts)
    else:
        from grpo_core.vllm_server.process import VLLMServer, VLLMServerSpec

        with tempfile.TemporaryDirectory() as logs:
            server = VLLMServer(VLLMServerSpec(model=model, max_model_len=512, max_logprobs=20), Path(logs)).start(timeout_s=900)
            try:
                report = measure(server.base_url, model, args.episodes, templates, args.seed, max_rollouts)
            finally:
                server.stop()
    if args.out:
        write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
