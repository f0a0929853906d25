"""The Qwen3.5 tiny variants served by the CPU vLLM build in bf16: weight sync, log-probs, learning.

``tiny:arithmetic-hybrid`` (Gated DeltaNet hybrid) and ``tiny:arithmetic-vlm`` (the same language
model inside a vision-language model) each get a server started the way the flow starts it: its
options come from the model (``grpo_core.vllm_server.model_needs``: bf16, and ``--language-model-only`` for
the VLM). The trainer stays in fp32, so its log-probs and the server's differ by bf16 rounding;
the tests measure that gap on the server as it loaded the checkpoint, and hold every sync to it:

* pushing the checkpoint's own weights leaves the server's log-probs bit-identical (the layerwise
  reload, the re-packing of the CPU build's conv weights and the re-tied LM head reproduce what
  loading from disk gave); after pushing changed weights, the server follows the trainer within
  the measured bf16 gap, also when only the short-convolution weights changed;
* the VLM's sync carries no tensor under the vision tower's names (recorded on the wire);
* the mismatch metrics (docs/mismatch.md) of a short run against the hybrid's bf16 server reach a real MLflow
  server at every step, with their headline copy, and show the bf16 gap at staleness 0;
* (``long``) each variant, as users get it, learns the arithmetic task on its server: the mean reward
  of the last 10% of steps beats the first 10% by ``MARGIN``.

The sync checks hold for any weights, so they run on the variants with a short warm-up
(``tests/tiny_variants.py``), built in the background while the unit tests run; both variants'
servers start side by side. The learning runs build and serve the tuned variants.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from grpo_core.config import AsyncGRPOConfig
from grpo_core.tiny import build_tiny_model
from grpo_core.vllm_server.control import VLLMControlClient
from grpo_core.vllm_server.model_needs import model_server_options
from grpo_core.vllm_server.process import ServerOptions, VLLMServer, VLLMServerSpec
from tests.startup import BACKGROUND
from tests.tiny_variants import build_check_variant

pytestmark = pytest.mark.integration

VARIANTS = ["arithmetic-hybrid", "arithmetic-vlm"]
TOWER = "model.visual."


@dataclass
class Served:
    variant: str
    path: str
    spec: VLLMServerSpec
    server: VLLMServer

    @property
    def url(self) -> str:
        return self.server.base_url


def start_served(variant: str, path: str, log_dir: Path, options: ServerOptions) -> Served:
    """A CPU server for one variant with ``options`` and what its model asks for (as the flow's server_spec)."""
    config = AsyncGRPOConfig(output_dir=str(log_dir / "unused"))
    spec = VLLMServerSpec.for_run(path, config, model_server_options(path, options, cuda=False))
    return Served(variant, path, spec, VLLMServer(spec, log_dir / variant).start(timeout_s=900))


@contextmanager
def serving(paths: dict[str, str], log_dir: Path, options: ServerOptions | None = None) -> Iterator[dict[str, Served]]:
    """Both variants' servers, started side by side (each start is mostly waiting on its own processes)."""
    with ThreadPoolExecutor(len(paths)) as pool:
        futures = {v: pool.submit(start_served, v, path, log_dir, options or ServerOptions()) for v, path in paths.items()}
    started = {v: f.result() for v, f in futures.items() if f.exception() is None}
    try:
        for f in futures.values():
            if f.exception() is not None:
                raise f.exception()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the servers' workers take the other core
        yield started
        torch.set_num_threads(threads)
    finally:
        for served in started.values():
            served.server.stop()


@contextmanager
def serving_check_builds(variants: list[str], build_job: str, log_dir: Path) -> Iterator[dict[str, Served]]:
    """``variants`` as the checks build them (a short warm-up: tests/tiny_variants.py), served side by side;
    waits first for the background ``build_job`` (tests/startup.py) where the run began one. The checks generate a
    few hundred tokens, so their servers run eagerly: compiling took 60-93 s of each start here
    (``ServerOptions.enforce_eager``); the learning runs' servers compile, as a user's do."""
    if BACKGROUND.has(build_job):
        BACKGROUND.result(build_job, timeout_s=1800)
    with serving({v: str(build_check_variant(v)) for v in variants}, log_dir, ServerOptions(enforce_eager=True)) as servers:
        yield servers


@pytest.fixture(scope="module")
def check_servers(server_logs: Path) -> Iterator[dict[str, Served]]:
    with serving_check_builds(VARIANTS, "build:hybrid", server_logs / "check") as servers:
        yield servers


@pytest.fixture(params=VARIANTS)
def served(request: pytest.FixtureRequest, check_servers: dict[str, Served]) -> Served:
    return check_servers[request.param]


@pytest.fixture(scope="module")
def tuned_servers(server_logs: Path) -> Iterator[dict[str, Served]]:
    """The variants as users get them (``tiny:<variant>``, the tuned warm-up), for the learning runs."""
    with serving({v: str(build_tiny_model(variant=v)) for v in VARIANTS}, server_logs / "tuned") as servers:
        yield servers


@pytest.fixture(params=VARIANTS)
def served_tuned(request: pytest.FixtureRequest, tuned_servers: dict[str, Served]) -> Served:
    return tuned_servers[request.param]


def test_server_options_come_from_the_model(served: Served) -> None:
    assert served.spec.dtype == "bfloat16"
    assert served.spec.language_model_only == (served.variant == "arithmetic-vlm")
    assert "--language-model-only" in served.spec.flags() or served.variant != "arithmetic-vlm"


# ---- log-probs ------------------------------------------------------------------------------------------
def sampled_sequences(path: str, url: str, prompts: int = 8, n: int = 4, seed: int = 0) -> list[tuple[list[int], int]]:
    """Completions the server samples at temperature 1 for a few arithmetic prompts, as token ids and
    the index of the first completion token: the tokens training meets. Seeded, so a failure can be re-run on the
    same tokens."""
    from transformers import AutoTokenizer

    from grpo_core.tiny import arithmetic_dataset

    tok = AutoTokenizer.from_pretrained(path)
    rows = arithmetic_dataset()["train"].select(range(prompts))
    out = []
    for row in rows:
        prompt = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        reply = httpx.post(f"{url}/inference/v1/generate", timeout=300, json={
            "token_ids": prompt, "sampling_params": {"max_tokens": 24, "n": n, "temperature": 1.0, "seed": seed}}).json()
        out += [(prompt + choice["token_ids"], len(prompt)) for choice in reply["choices"]]
    return out


def server_logprobs(url: str, seqs: list[tuple[list[int], int]]) -> torch.Tensor:
    """The server's log-prob of every answer token, all sequences concatenated."""
    out = []
    for ids, start in seqs:
        reply = httpx.post(f"{url}/inference/v1/generate", timeout=300, json={
            "token_ids": ids, "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}}).json()
        entries = reply["prompt_logprobs"]
        out += [entries[t][str(ids[t])]["logprob"] for t in range(start, len(ids))]
    return torch.tensor(out, dtype=torch.float64)


@torch.no_grad()
def trainer_logprobs(model: torch.nn.Module, seqs: list[tuple[list[int], int]]) -> torch.Tensor:
    out = []
    for ids, start in seqs:
        logp = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].double().log_softmax(-1)
        out += [logp[t - 1, ids[t]] for t in range(start, len(ids))]
    return torch.stack(out)


class RecordingControl(VLLMControlClient):
    """The control client, keeping every ``/update_weights`` payload: what went on the wire."""

    def __init__(self, base_url: str):
        super().__init__(base_url)
        self.updates: list[dict[str, Any]] = []

    def update_weights(self, update_info: Any, **kwargs: Any) -> None:
        self.updates.append(update_info)
        super().update_weights(update_info, **kwargs)


def perturb(model: torch.nn.Module, scale: float, only: str | None = None, seed: int = 0) -> None:
    """Add seeded noise of ``scale`` times each trainable tensor's RMS (to names containing ``only``)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and (only is None or only in name):
                rms = p.pow(2).mean().sqrt().clamp_min(1e-3)
                p.add_(scale * rms * torch.randn(p.shape, generator=gen))


def bf16_rounding(model: torch.nn.Module, seqs: list[tuple[list[int], int]], trainer: torch.Tensor) -> torch.Tensor:
    """Per token, how far the trainer's own forward moves in bf16: the scale of the server's rounding."""
    return (trainer_logprobs(copy.deepcopy(model).to(torch.bfloat16), seqs) - trainer).abs()


def within_rounding(server: torch.Tensor, trainer: torch.Tensor, rounding: torch.Tensor) -> tuple[bool, dict[str, float]]:
    """Server and trainer agree as bf16 allows: mean gap within 2x, 90th percentile within 3x the trainer's own bf16
    gap. The largest gap is reported, not held to a bound: one token whose experts a 16-bit router picks differently
    moves by up to 2 nats with the right weights on the server (benchmarks/sync/probe_rounding.py), which is why the
    push check itself reads the mean (fleet/verify.py).

    Measured on these tiny models (sampled completion tokens, seeds 0-5 of ``sampled_sequences``, as loaded and
    after each perturbation's push): server gap / trainer's bf16 gap on the mean 0.89-1.11 (hybrid, VLM) and 0.40-1.27
    (hybrid MoE); on the 90th percentile 0.93-1.21 and 0.60-1.76; on the largest token up to 1.11 and 3.19 (the hybrid
    MoE's largest failed a 3x bound in a CI run: 1.60 nats against 3 x 0.495).
    """
    gap = (server - trainer).abs()
    stats = {"gap_mean": gap.mean().item(), "gap_p90": gap.quantile(0.9).item(), "gap_max": gap.max().item(),
             "bf16_mean": rounding.mean().item(), "bf16_p90": rounding.quantile(0.9).item(),
             "bf16_max": rounding.max().item()}
    return bool(gap.mean() <= 2 * rounding.mean() and gap.quantile(0.9) <= 3 * rounding.quantile(0.9)), stats


def push_and_follow(served: Served, model: torch.nn.Module, seqs: list[tuple[list[int], int]], as_loaded: torch.Tensor,
                    perturbations: list[tuple[str, str | None, float]], report: dict[str, Any]) -> RecordingControl:
    """Push the loaded weights (the server's log-probs stay bit-identical), then each ``(label, names containing,
    scale)`` perturbation in turn (the server follows the trainer within bf16 rounding), then the loaded weights
    again (bit-identical). Figures go into ``report``; returns the control client that recorded the wire."""
    from grpo_core.sync.protocol import ProtocolWeightSync
    from grpo_core.sync.source import ModelWeightSource

    loaded = {n: p.detach().clone() for n, p in model.named_parameters()}
    control = RecordingControl(served.url)
    sync = ProtocolWeightSync(control, ModelWeightSource(model), backend="gloo")
    try:
        sync.push(1)  # the checkpoint's own weights
        assert torch.equal(server_logprobs(served.url, seqs), as_loaded), "a push of the loaded weights changed the server"
        for label, only, scale in perturbations:
            perturb(model, scale, only)
            trainer = trainer_logprobs(model, seqs)
            sync.push(2)
            server = server_logprobs(served.url, seqs)
            rounding = bf16_rounding(model, seqs, trainer)
            ok, stats = within_rounding(server, trainer, rounding)
            moved = (server - as_loaded).abs().mean().item()
            report |= {f"{label}_moved_mean": moved, **{f"{label}_{k}": v for k, v in stats.items()}}
            # A push that did not land leaves the server where it was, so its gap to the trainer is ``moved``; the
            # check below allows a mean gap of 2x the bf16 rounding, so a move of twice that (4x) cannot pass it
            # unnoticed. (Measured: the conv-only perturbation moves the hybrid's server by 0.060, 14x its bf16
            # rounding of 0.0044; the earlier 20x bar failed on it though the push had landed.)
            assert moved > 4 * rounding.mean().item(), f"{label}: the push hardly moved the server ({report})"
            assert ok, f"{label}: server and trainer differ beyond bf16 rounding ({report})"
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(loaded[name])
        sync.push(3)
        assert torch.equal(server_logprobs(served.url, seqs), as_loaded), "restoring the loaded weights did not restore the server"
    finally:
        sync.close()
    return control


def test_sync_follows_the_trainer_within_bf16_rounding(served: Served) -> None:
    from grpo_core.models.loading import load_policy

    model, _ = load_policy(served.path, torch.device("cpu"))
    model.eval()
    seqs = sampled_sequences(served.path, served.url)
    # As the server loaded the checkpoint (no sync yet): the gap is bf16 rounding alone.
    as_loaded = server_logprobs(served.url, seqs)
    trainer = trainer_logprobs(model, seqs)
    ok, report = within_rounding(as_loaded, trainer, bf16_rounding(model, seqs, trainer))
    report = {"tokens": len(trainer), **report}
    assert ok, f"the server's bf16 gap as loaded is not the trainer's bf16 rounding ({report})"

    # Only the short convolutions (prepacked by the CPU build), then everything.
    control = push_and_follow(served, model, seqs, as_loaded, [("conv", "conv1d", 1.0), ("all", None, 0.05)], report)
    print(json.dumps({served.variant: report}))

    # What went on the wire: every trainable tensor, nothing of a vision tower.
    sent = {name for update in control.updates for name in update["names"]}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert sent == trainable
    tower = [n for n, _ in model.named_parameters() if n.startswith(TOWER)]
    assert bool(tower) == (served.variant == "arithmetic-vlm")
    assert not any(n.startswith(TOWER) for n in sent)


# ---- mismatch metrics --------------------------------------------------------------------------------------------
MISMATCH_METRICS = ("mismatch/k1_token", "mismatch/k3_token", "mismatch/k1_seq", "mismatch/k3_seq",
                    "mismatch/masked_token_share", "mismatch/masked_seq_share", "mismatch/truncated_token_share",
                    "mismatch/truncated_seq_share", "mismatch/max_token_gap")


def test_mismatch_metrics_reach_mlflow(check_servers: dict[str, Served], mlflow_server: str, tmp_path: Path) -> None:
    """Two steps against the hybrid's bf16 server, tracked in a real MLflow server: every step holds the mismatch
    metrics, overall and per staleness, and the headline copy; the fp32 trainer against the bf16 server shows a
    gap at staleness 0 (the weights the server loaded). A sequence-level mode, so that the rows' sample indices
    reach the loss too."""
    import mlflow

    from grpo_core.rewards import accuracy_reward, format_reward
    from grpo_core.tiny import arithmetic_dataset
    from grpo_core.tracking.run_view import headline_name
    from grpo_core.tracking.tracker import MLflowTracker
    from grpo_core.training.trainer import AsyncGRPOTrainer

    served = check_servers["arithmetic-hybrid"]
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "run"), vllm_server_base_url=served.url, report_to="mlflow", max_steps=2,
        learning_rate=1e-4, num_generations=4, per_device_train_batch_size=16, max_completion_length=16,
        save_strategy="no", num_sampler_logprobs=4, max_staleness=1, bf16=False,
        vllm_importance_sampling_mode="sequence_truncate",
    )
    tracker = MLflowTracker(mlflow_server, "test-mismatch", "hybrid-bf16-server")
    trainer = AsyncGRPOTrainer(served.path, [accuracy_reward, format_reward],
                               train_dataset=arithmetic_dataset()["train"], args=args, tracker=tracker)
    history = trainer.train()
    tracker.close()
    client = mlflow.MlflowClient(mlflow_server)
    for name in (*MISMATCH_METRICS, headline_name("mismatch/k3_token")):
        steps = [m.step for m in client.get_metric_history(tracker.run_id, name)]
        assert steps == [1, 2], f"{name}: logged at steps {steps}"
    # step 1 trains samples of the pushed version 0 only; step 2 may train some one update old
    assert 1 in [m.step for m in client.get_metric_history(tracker.run_id, "mismatch/k3_token/staleness_0")]
    first = history[0]  # samples of the weights the server loaded: the gap is the server's bf16 against fp32
    assert first["mismatch/k3_token/staleness_0"] > 0 and first["mismatch/max_token_gap/staleness_0"] > 0
    # the same k3 sum over the step's sequences (k3_seq) and over its more numerous tokens (k3_token)
    assert first["mismatch/k3_seq"] >= first["mismatch/k3_token"] > 0
    assert client.get_metric_history(tracker.run_id, "mismatch/k3_token")[0].value == pytest.approx(
        first["mismatch/k3_token"])


# ---- learning ----------------------------------------------------------------------------------------------------
# The demo's own settings (flows/cli.py DEMO_TRAINER: lr 2e-4, 120 steps). Measured on a 2-core CPU
# (fresh clone, `bash scripts/test.sh -m long tests/integration/test_hybrid_models.py -k learns`, 24 min for
# both): reward of the first 12 steps -> last 12, hybrid 1.246 -> 1.462 (+0.216), VLM 1.210 -> 1.427
# (+0.217). Shorter runs do not show it: 60 steps at lr 1e-3 dip and recover (+0.046, +0.003); 60 steps
# at 4e-4: -0.009 and +0.088. At ~12 min per variant these runs are `long`: outside the CI run, like the soak.
LEARN_STEPS = 120
LEARN_RATE = 2e-4
MARGIN = 0.15


def learning_run(served: Served, tmp_path: Path) -> tuple[float, float, list[dict[str, float]]]:
    """``LEARN_STEPS`` steps at the demo's settings against ``served``: the mean reward of the first and last
    tenth of the steps (12 of 120), and the history. Prints both with step 1's sampler/trainer gap."""
    from flows.cli import DEMO_TRAINER
    from grpo_core.rewards import accuracy_reward, format_reward
    from grpo_core.tiny import arithmetic_dataset
    from grpo_core.training.trainer import AsyncGRPOTrainer

    settings = {**DEMO_TRAINER, "max_steps": LEARN_STEPS, "learning_rate": LEARN_RATE, "save_strategy": "no", "seed": 0}
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "run"), vllm_server_base_url=served.url, report_to="none", **settings)
    trainer = AsyncGRPOTrainer(model=served.path, reward_funcs=[accuracy_reward, format_reward],
                               train_dataset=arithmetic_dataset()["train"], args=args)
    history = trainer.train()

    rewards = np.array([h["reward"] for h in history])
    (tmp_path / "rewards.json").write_text(json.dumps(rewards.tolist()))
    k = max(1, int(np.ceil(0.1 * len(rewards))))
    first, last = float(rewards[:k].mean()), float(rewards[-k:].mean())
    # Step 1 trains on samples of the weights the server loaded: their sampler/trainer gap is the bf16 one.
    print(json.dumps({served.variant: {"reward_first": first, "reward_last": last, "steps": len(history),
                                        "logprob_diff_step1": history[0].get("sampling/logprob_diff_mean"),
                                        "masked_step1": history[0].get("sampling/masked_mean"),
                                        # a 16-bit server's push check: its worst mean probe gap over what it
                                        # accepted (1 = at its limit; above it, further sequences settled it; an fp32
                                        # server's check bounds the largest gap)
                                        "verify_mean_over_tolerance_max": max(
                                            (h["sync/verify_logprob_diff_mean"] / h["sync/verify_tolerance"] for h in history
                                             if "sync/verify_tolerance" in h), default=None),
                                        "verify_reprobes": sum(h.get("sync/verify_reprobes", 0) for h in history),
                                        "per_step": np.round(rewards, 3).tolist()}}))
    return first, last, history


@pytest.mark.long
@pytest.mark.slow
def test_variant_learns_on_its_server(served_tuned: Served, tmp_path: Path) -> None:
    first, last, history = learning_run(served_tuned, tmp_path)
    assert len(history) == LEARN_STEPS
    assert last >= first + MARGIN, f"{served_tuned.variant}: reward {first:.3f} -> {last:.3f}"
