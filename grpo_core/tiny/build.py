"""Build the tiny model folder once and cache it: tokenizer, seeded model, warm-up, HF save.

The folder is named ``<variant>-<digest>`` where the digest hashes the whole ``TinySpec`` and
``CODE_VERSION``; it is written to a temporary sibling and renamed into place, and counts as built
only once it holds the ``.complete`` marker. A file lock makes concurrent builders (test workers,
training ranks) wait for the first one instead of all burning CPU on the same build.

    .venv/bin/python -m grpo_core.tiny.build --variant arithmetic    # prints the folder

Variants: ``arithmetic`` (Qwen3), ``tools`` (fine-tuned from it to call a calculator),
``arithmetic-hybrid`` (a Qwen3.5 Gated DeltaNet hybrid warmed up the same way) and
``arithmetic-vlm`` (that hybrid's language model inside a Qwen3.5 vision-language model), and the
mixture-of-experts models upcycled from the dense builds: ``arithmetic-moe`` (Qwen3-MoE, from
``arithmetic``) and ``arithmetic-hybrid-moe`` (Qwen3.5-MoE, from ``arithmetic-hybrid``).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from grpo_core.tiny import tasks
from grpo_core.tiny.spec import TinySpec, default_spec
from grpo_core.waiting import announced_wait

MARKER = ".complete"
BUILD_TIME = "no time limit; the default build takes about 2 min on two cores"
BUILD_INFO = "build_info.json"


def cache_root() -> Path:
    """``$GRPO_CORE_CACHE`` if set, else ``~/.cache/grpo_core``; the tiny models live in ``tiny/`` below it."""
    return Path(os.environ.get("GRPO_CORE_CACHE") or Path.home() / ".cache" / "grpo_core")


def model_dir(spec: TinySpec, cache_dir: str | Path | None = None) -> Path:
    parent = Path(cache_dir) if cache_dir is not None else cache_root() / "tiny"
    return parent / f"{spec.variant}-{spec.digest()}"


def is_complete(path: Path, spec: TinySpec) -> bool:
    marker = path / MARKER
    return marker.is_file() and marker.read_text() == spec.to_json()


def build_tiny_model(cache_dir: str | Path | None = None, *, variant: str = "arithmetic", seed: int = 0) -> Path:
    """Return the HF folder of the tuned tiny model for ``variant``, building it on first use.

    ``cache_dir`` is the folder that holds ``<variant>-<digest>`` folders (default
    ``$GRPO_CORE_CACHE/tiny`` or ``~/.cache/grpo_core/tiny``).
    """
    return build_from_spec(default_spec(variant, seed), cache_dir)


def build_from_spec(spec: TinySpec, cache_dir: str | Path | None = None, *, verbose: bool = False) -> Path:
    """Like ``build_tiny_model`` for any spec (tests use smaller ones)."""
    final = model_dir(spec, cache_dir)
    if is_complete(final, spec):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            with announced_wait(f"another process to finish building the tiny model {final.name}", None,
                                f"if no other build runs, remove {lock.name}", limit_text=BUILD_TIME):
                fcntl.flock(lock, fcntl.LOCK_EX)
        if is_complete(final, spec):  # another process finished it while we waited
            return final
        if final.exists():  # debris of an interrupted manual copy; never of ours, which renames atomically
            shutil.rmtree(final)
        # Holding the lock, any temporary folder of this name is left over from a killed build.
        for stale in final.parent.glob(f".{final.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            with announced_wait(f"the tiny model {spec.variant} to build into {final}", None,
                                "it is built once and then reused from that folder (GRPO_CORE_CACHE moves it)",
                                limit_text=BUILD_TIME):
                _build_into(spec, tmp, cache_dir, verbose=verbose)
            (tmp / MARKER).write_text(spec.to_json())
            # mkdtemp makes the folder private; a server running as another user must still read it.
            for path in (tmp, *tmp.iterdir()):
                path.chmod(0o755 if path.is_dir() else 0o644)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _build_into(spec: TinySpec, out: Path, cache_dir: str | Path | None, *, verbose: bool) -> None:
    # Heavy imports here so that reading a cached folder path stays cheap.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from grpo_core.tiny.tokenizer import train_tokenizer
    from grpo_core.tiny.warmup import add_vision_tower, encode_pool, init_model, torch_threads, upcycle, warmup_train

    start = time.perf_counter()
    info: dict[str, Any] = {"spec": json.loads(spec.to_json())}
    train, held = tasks.split_problems(spec.task.max_operand, spec.task.ops, spec.task.eval_fraction, spec.task.split_seed)
    log_every = 50 if verbose else 0
    base_spec = spec.base()
    if base_spec is not None:
        # Variants that continue from another one reuse its (cached) build and its tokenizer.
        base = build_from_spec(base_spec, cache_dir, verbose=verbose)
        info["base"] = base.name
        start = time.perf_counter()
    with torch_threads(spec.num_threads):
        if base_spec is None:
            tokenizer = train_tokenizer(spec.task, spec.tokenizer, spec.seed)
            info["tokenizer_seconds"] = time.perf_counter() - start
            model = init_model(spec.model, tokenizer, spec.seed)
            stage, with_tools = spec.warmup, False
        elif spec.tools_warmup is not None:
            tokenizer = AutoTokenizer.from_pretrained(base)
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            stage, with_tools = spec.tools_warmup, True
        elif spec.model.moe is not None:  # the dense base's weights in every expert, then a short warm-up
            tokenizer = AutoTokenizer.from_pretrained(base)
            dense = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            model = upcycle(spec.model, tokenizer, dense, spec.seed)
            stage, with_tools = spec.moe_warmup, False
        else:  # the VLM: the base's warmed-up language model, a random tower, no further training
            tokenizer = AutoTokenizer.from_pretrained(base)
            model = add_vision_tower(spec.model, tokenizer, AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                     spec.seed)
            stage, with_tools = None, False
        tokenizer.save_pretrained(out)
        _portable_tokenizer_class(out)
        if stage is not None:
            pool = encode_pool(stage, tokenizer, train, with_tools=with_tools, seed=spec.seed)
            # The same chats with every answer right, for the warm-up's first clean_steps.
            clean = encode_pool(replace(stage, correct_prob=1.0), tokenizer, train, with_tools=with_tools,
                                seed=spec.seed) if stage.clean_steps else None
            t0 = time.perf_counter()
            losses = warmup_train(model, pool, stage, pad_id=tokenizer.pad_token_id, seed=spec.seed, log_every=log_every,
                                  clean_pool=clean)
            info["warmup_seconds"] = time.perf_counter() - t0
            info["final_loss"] = sum(losses[-20:]) / max(1, len(losses[-20:]))

        model.generation_config = GenerationConfig(
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )
        model.save_pretrained(out)
        # Recorded, not asserted: the numbers the warm-up was tuned to, for whoever reads the folder.
        if spec.eval_samples:
            t0 = time.perf_counter()
            info["eval"] = _quick_eval(spec, model, tokenizer, {"train": train, "eval": held})
            info["eval_seconds"] = time.perf_counter() - t0
    info["build_seconds"] = time.perf_counter() - start
    info["torch_version"] = torch.__version__
    (out / BUILD_INFO).write_text(json.dumps(info, indent=2))
    if verbose:
        print(json.dumps({k: v for k, v in info.items() if k != "spec"}, indent=2))


def _portable_tokenizer_class(out: Path) -> None:
    # transformers 5 writes its internal "TokenizersBackend" name; "PreTrainedTokenizerFast" loads the
    # same tokenizer.json there and also in transformers 4, which other tools may still use.
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2) + "\n")


def _quick_eval(spec: TinySpec, model: Any, tokenizer: Any, splits: dict[str, list[tasks.Problem]]) -> dict[str, Any]:
    from grpo_core.tiny.evaluate import sampled_eval

    out: dict[str, Any] = {}
    tools = [tasks.CALCULATOR_SCHEMA] if spec.variant == "tools" else None
    for name, problems in splits.items():
        rng = random.Random(f"quick-eval-{name}")
        chosen = [rng.choice(problems) for _ in range(spec.eval_samples)]
        prompts = [tasks.make_prompt(p, rng.randrange(len(tasks.QUESTION_TEMPLATES)), tasks.SYSTEM_PROMPT) for p in chosen]
        res = sampled_eval(model, tokenizer, prompts, [str(p.value) for p in chosen], seed=spec.seed,
                           tools=tools, max_turns=2 if tools else 1)
        out[name] = {"accuracy": res.accuracy, "format_rate": res.format_rate,
                     "tool_call_rate": res.tool_call_rate, "mean_completion_tokens": res.mean_completion_tokens, "n": len(prompts)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="Build (or find) the cached tiny model and print its folder.")
    parser.add_argument("--variant", default="arithmetic")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args()
    print(build_from_spec(default_spec(args.variant, args.seed), args.cache_dir, verbose=True))


if __name__ == "__main__":
    main()
