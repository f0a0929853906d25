"""The fixed rollout stream that ``peer_trl_gpu.py`` and ``sparse_share.py`` feed to the trainers.

Groups of 8 samples share a prompt (except at ratio ~1, where every prompt is its own); each sample has
a group-normalised advantage, a sampler log-prob per completion token and a policy version that gives
it a staleness of 2 to 4 weight updates when it is trained (less in the first steps). Workloads follow one another in the
stream; each contributes ``rows`` rows of ``token_budget`` tokens, one row per optimizer step.

Both trainers plan rows themselves, from the same samples in the same order. The stream is accepted
only if this project's planner and TRL's ``TokenBudgetBatcher`` (when TRL is importable) close the same
rows with the same samples: a seed whose rows differ anywhere (a placement within a few tokens of the
budget, where the two tries count shared tokens one apart) is skipped for the next.

Also here: the model folder both trainers load (a Qwen3-shaped policy with random weights and a small
offline tokenizer), and the objective computed sample by sample in fp32 and bf16 (the reference the
first-step losses are compared with).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpo_core import RolloutSample
from grpo_core.packing.planner import Planner  # grpo_core internals: this line only

SHAPES = {  # Qwen3 dense shapes (config.json of the public checkpoints)
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True),
}
EPSILON, EPSILON_HIGH = 0.2, 0.28  # the clip both trainers are given
GROUP = 8
STALENESS = (2, 4)  # a group's staleness when trained, in weight updates (both trainers' max_staleness is 4)


@dataclass(frozen=True)
class Workload:
    name: str
    prompt: tuple[int, int]  # prompt length range [lo, hi)
    completion: tuple[int, int]
    shared_prompt: bool = True


WORKLOADS = [  # packing ratios of about 1, 3.4 and 6 at token_budget 16384, groups of 8
    Workload("ratio~1", (256, 257), (128, 1024), shared_prompt=False),
    Workload("ratio~3.4", (2048, 2816), (128, 1024)),
    Workload("ratio~6", (3072, 3328), (64, 256)),
]
SMOKE_WORKLOADS = [  # token_budget 1024, tiny model
    Workload("ratio~1", (32, 33), (16, 96), shared_prompt=False),
    Workload("ratio~3.4", (200, 280), (16, 100)),
    Workload("ratio~6", (300, 330), (6, 26)),
]
SMOKE_BUDGET = 1024


@dataclass
class Stream:
    samples: list[RolloutSample]  # in stream order, tail included
    rows: list[list[int]]  # the trained rows (sample indices), one per step, in order
    workload_of_row: list[str]
    token_budget: int
    seed: int
    trl_rows_checked: bool  # TRL's planner was run on the stream and closed the same rows

    def first_rows(self) -> dict[str, int]:
        """Each workload's first row (its first step)."""
        out: dict[str, int] = {}
        for i, name in enumerate(self.workload_of_row):
            out.setdefault(name, i)
        return out


def _group(w: Workload, group_id: int, vocab: int, rng: np.random.Generator) -> list[RolloutSample]:
    p = int(rng.integers(*w.prompt))
    prompt = rng.integers(3, vocab, p)  # ids 0-2 are the tokenizer's specials
    rewards = rng.normal(size=GROUP)
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    out = []
    for r in range(GROUP):
        if not w.shared_prompt:
            prompt = rng.integers(3, vocab, p)
        c = int(rng.integers(*w.completion))
        tokens = np.concatenate([prompt, rng.integers(3, vocab, c)]).astype(np.int32)
        mask = np.zeros(len(tokens), dtype=bool)
        mask[p:] = True
        # Sampler log-probs near a near-uniform policy's (-log V), so that ratios spread around 1 and some clip.
        logprobs = np.where(mask, -math.log(vocab) + rng.normal(0.0, 0.3, len(tokens)), 0.0).astype(np.float32)
        out.append(RolloutSample(
            token_ids=tokens, completion_mask=mask, sampler_logprobs=logprobs, advantage=float(advantages[r]),
            reward=float(rewards[r]), group_id=group_id, row_index=group_id, epoch=0,
            rollout_id=f"{w.name}-g{group_id}-{r}", policy_version=0, position=group_id,
        ))
    return out


def our_rows(samples: list[RolloutSample], budget: int) -> tuple[list[list[int]], list[int]]:
    """Rows this project's planner closes, one micro-batch per step on one rank (the collector's loop)."""
    planner = Planner(world_size=1, gradient_accumulation_steps=1, token_budget=budget)
    rows, current = [], []
    for i, sample in enumerate(samples):
        if not planner.offer(sample):
            planner.finish()
            rows.append(current)
            current = []
            assert planner.offer(sample)
        current.append(i)
    return rows, current


def trl_rows(samples: list[RolloutSample], budget: int) -> list[list[int]] | None:
    """Rows TRL's own planner (``TokenBudgetBatcher``, one process) closes; None where TRL is not installed."""
    try:
        from trl.experimental.async_grpo.async_grpo_trainer import TokenBudgetBatcher
    except ImportError:
        return None
    dicts = [dict(trl_fields(s, 0), index=i) for i, s in enumerate(samples)]
    batcher = TokenBudgetBatcher(dicts, num_processes=1, token_budget=budget, metrics=defaultdict(list))
    return [[d["index"] for d in rows[0].samples] for rows in batcher]


def trl_fields(s: RolloutSample, version: int) -> dict[str, Any]:
    """A sample as TRL's rollout queue carries it (``RolloutSample``'s array fields)."""
    return {"input_ids": s.token_ids.astype(np.int64), "completion_mask": s.completion_mask.astype(np.int64),
            "old_log_probs": s.sampler_logprobs, "advantage": s.advantage, "group_id": s.group_id,
            "model_version": version, "metrics": {}}


def make_stream(workloads: list[Workload], rows: int, budget: int, vocab: int, seed: int, tail_rows: int = 3,
                tries: int = 20, check_trl: bool = True) -> Stream:
    """``rows`` rows per workload, then ``tail_rows`` rows of the last one that are never trained (a planner
    closes a row only when the next sample does not fit; TRL's data loader also reads one row ahead)."""
    failures = []
    for attempt in range(tries):
        stream = _try_stream(workloads, rows, budget, vocab, seed + attempt, tail_rows)
        if not check_trl:
            return stream
        theirs = trl_rows(stream.samples, budget)
        ours, _ = our_rows(stream.samples, budget)
        if theirs is None or theirs[: len(stream.rows)] == ours[: len(stream.rows)] == stream.rows:
            stream.trl_rows_checked = theirs is not None
            return stream
        failures.append(seed + attempt)
    raise RuntimeError(f"no seed in {failures} gave the same rows in both planners")


def _try_stream(workloads: list[Workload], rows: int, budget: int, vocab: int, seed: int, tail_rows: int) -> Stream:
    rng = np.random.default_rng(seed)
    samples: list[RolloutSample] = []
    row_list: list[list[int]] = []
    names: list[str] = []
    group_id = 0
    for k, w in enumerate(workloads):
        want = rows + (tail_rows if k == len(workloads) - 1 else 0)
        mine: list[RolloutSample] = []
        while True:
            mine += _group(w, group_id, vocab, rng)
            group_id += 1
            closed, _ = our_rows(mine, budget)
            if len(closed) >= want:
                break
        # Keep exactly the samples of this workload's first `want` rows: the rest of a group cut by the
        # last row is left out, so the next workload's first sample (longer than any slack) opens a row.
        keep = [i for r in closed[:want] for i in r]
        start = len(samples)
        samples += [mine[i] for i in keep]
        for r in closed[:rows]:
            row_list.append([start + keep.index(i) for i in r])
            names.append(w.name)
    _set_versions(samples, row_list, rng)
    return Stream(samples, row_list, names, budget, seed, trl_rows_checked=False)


def _set_versions(samples: list[RolloutSample], rows: list[list[int]], rng: np.random.Generator) -> None:
    """Row r trains at step r + 1, after versions 0..r were pushed: a staleness s means version r - s.

    A group's staleness is drawn from 2-4 (capped by r), so no sample is newer than the version served when a
    trainer reads it: both read ahead of the step that trains it (our collector the sample that closes the
    previous row; TRL's data loader the whole next row), and our collector drops a sample of a version it never
    pushed."""
    staleness = {}
    for r, row in enumerate(rows):
        for i in row:
            s = staleness.setdefault(samples[i].group_id, int(rng.integers(STALENESS[0], STALENESS[1] + 1)))
            samples[i].policy_version = max(0, r - s)
    trained = {i for row in rows for i in row}
    for i, s in enumerate(samples):  # the tail (never trained): the newest version
        if i not in trained:
            s.policy_version = len(rows) - 1


# ------------------------------------------------------------------------------------------ model folder
def write_model_folder(shape: str, folder: Path, device: torch.device) -> Path:
    """A Qwen3-shaped policy with random weights (seed 0, bf16 values) and a 3-token offline tokenizer."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    config = Qwen3Config(**SHAPES[shape], rope_theta=1_000_000.0, max_position_embeddings=40960,
                         bos_token_id=1, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(folder)
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                  eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    tok.save_pretrained(folder)
    del model
    return folder


# ------------------------------------------------------------------------------------------ reference objective
def clipped_objective(logprobs: torch.Tensor, old: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of -min(r A, clip(r, 1 - eps, 1 + eps_high) A), r = exp(logprobs - old)."""
    ratio = torch.exp(logprobs - old)
    return -torch.minimum(ratio * adv, ratio.clamp(1 - EPSILON, 1 + EPSILON_HIGH) * adv).sum()


@torch.no_grad()
def reference_loss(model: torch.nn.Module, samples: list[RolloutSample], device: torch.device) -> float:
    """The row's loss with every sample forwarded alone (no packing), log-softmax in fp32."""
    total, tokens = torch.zeros((), dtype=torch.float64, device=device), 0
    for s in samples:
        ids = torch.as_tensor(s.token_ids, dtype=torch.long, device=device)
        t = torch.as_tensor(np.flatnonzero(s.completion_mask), device=device)
        logits = model(input_ids=ids[None], logits_to_keep=0).logits[0, t - 1].float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, ids[t][:, None])[:, 0]
        old = torch.as_tensor(s.sampler_logprobs[t.cpu().numpy()], device=device)
        adv = torch.full_like(old, s.advantage)
        total += clipped_objective(logprobs.float(), old, adv).double()
        tokens += len(t)
    return float(total / tokens)


def reference_losses(model_dir: Path, stream: Stream, device: torch.device) -> dict[str, dict[str, float]]:
    """fp32 and bf16 losses of each workload's first row at the initial weights (TF32 off)."""
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out: dict[str, dict[str, float]] = {name: {} for name in stream.first_rows()}
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device)
        model.eval()
        for name, r in stream.first_rows().items():
            out[name][label] = reference_loss(model, [stream.samples[i] for i in stream.rows[r]], device)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out
