"""The tiny mixture-of-experts variants on the CPU vLLM server: weight sync, routing replay, learning.

``tiny:arithmetic-moe`` (Qwen3-MoE, served in fp32) and ``tiny:arithmetic-hybrid-moe`` (Qwen3.5-MoE:
Gated DeltaNet + MoE, served in bf16) each get one server, started as the flow starts it (options from
the model, ``grpo_core.vllm_server.model_needs``). What the CPU build can and cannot give:

* it samples them, and a push of the trainer's weights, fused expert tensors under the trainer's own
  names (``mlp.experts.gate_up_proj`` ``[experts, 2 * width, hidden]``), reaches it: the checkpoint's own
  weights leave its log-probs bit-identical, changed ones move it to the trainer's within bf16 rounding;
* it cannot return routes: ``--enable-return-routed-experts`` needs vLLM's V2 model runner, which needs
  Triton, and the CPU build refuses to start with the flag. So a run against it warns once, naming the
  flag, and trains with the trainer's own routing (``test_run_without_routes_warns_once_and_trains``);
* routing replay is checked on the server's own rollouts (tokens and log-probs it sampled) with routes
  in the reply format vLLM documents (base64 ``.npy`` ``[tokens - 1, layers, k]``) computed by a stand-in
  sampler, the policy's forward in the server's dtype: they go through the rollout code (reply parsing,
  the multi-turn sequence, tree packing) into the routers, and the experts every completion position
  was dispatched to are those routes, read back from the routers. The log-prob gap to the server is
  measured with and without replay, at staleness 0 (reported; ``-s`` prints it);
* (``long``) each variant learns at the demo's settings, on its tuned build (``tiny:<variant>``); the checks
  above use the short check builds of ``tests/tiny_variants.py``.
"""

from __future__ import annotations

import base64
import copy
import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from grpo_core.config import AsyncGRPOConfig
from grpo_core.tiny import build_tiny_model
from grpo_core.vllm_server.model_needs import model_server_options
from grpo_core.vllm_server.process import RETURN_ROUTED_EXPERTS, ServerOptions, VLLMServerSpec
from tests.integration.test_hybrid_models import (
    Served,
    push_and_follow,
    sampled_sequences,
    server_logprobs,
    serving,
    serving_check_builds,
)
from tests.integration.test_hybrid_models import LEARN_STEPS, MARGIN, learning_run

pytestmark = pytest.mark.integration

VARIANTS = ["arithmetic-moe", "arithmetic-hybrid-moe"]


@pytest.fixture(scope="module")
def check_servers(server_logs: Path) -> Iterator[dict[str, Served]]:
    with serving_check_builds(VARIANTS, "build:moe", server_logs / "moe-check") as servers:
        yield servers


@pytest.fixture(scope="module")
def tuned_servers(server_logs: Path) -> Iterator[dict[str, Served]]:
    """The variants as users get them (``tiny:<variant>``), for the learning runs."""
    with serving({v: str(build_tiny_model(variant=v)) for v in VARIANTS}, server_logs / "moe-tuned") as servers:
        yield servers




def load(path: str) -> torch.nn.Module:
    from grpo_core.models.loading import load_policy

    model, _ = load_policy(path, torch.device("cpu"))
    return model.eval()


@pytest.mark.parametrize("variant", VARIANTS)
def test_server_options_come_from_the_model(check_servers: dict[str, Served], variant: str) -> None:
    served = check_servers[variant]
    assert served.spec.dtype == ("bfloat16" if "hybrid" in served.variant else "float32")
    assert RETURN_ROUTED_EXPERTS not in served.spec.flags()  # the CPU build refuses it (module docstring)
    gpu = model_server_options(served.path, ServerOptions(), cuda=True)
    # dtype None: the server follows the trainer's dtype, which VLLMServerSpec.for_run fills in.
    assert gpu.return_routed_experts and RETURN_ROUTED_EXPERTS in VLLMServerSpec(
        model=served.path, return_routed_experts=gpu.return_routed_experts, dtype=gpu.dtype or "bfloat16").flags()


# ---- weight sync: fused expert tensors under the trainer's names ------------------------------------------------
# The CPU experts kernel packs its weights on the first load only; the gloo engine packs them again after every
# reload (grpo_core/vllm_plugin/expert_repack.py). Without that, a push of the loaded weights moved the server's log-probs by
# 8.96 nats. The experts are moved far enough (3x their RMS) that a push that did not land could not pass the check.
@pytest.mark.parametrize("variant", VARIANTS)
def test_sync_follows_the_trainer(check_servers: dict[str, Served], variant: str) -> None:
    served = check_servers[variant]
    model = load(served.path)
    seqs = sampled_sequences(served.path, served.url)
    as_loaded = server_logprobs(served.url, seqs)
    report: dict[str, float] = {"sequences": len(seqs)}
    control = push_and_follow(served, model, seqs, as_loaded, [("experts", "mlp.experts.", 3.0), ("all", None, 0.05)],
                              report)
    print(json.dumps({served.variant: report}))
    sent = {name for update in control.updates for name in update["names"]}
    assert sent == {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in sent)


# ---- routing replay on the server's rollouts --------------------------------------------------------------------
def npy_b64(array: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, array)
    return base64.b64encode(buf.getvalue()).decode()


def server_rollouts(served: Served, prompts: int = 6, n: int = 4) -> list[tuple[list[int], dict]]:
    """``(prompt ids, choice)`` pairs sampled by the server at temperature 1, as the rollout worker asks."""
    from transformers import AutoTokenizer

    from grpo_core.tiny import arithmetic_dataset

    tok = AutoTokenizer.from_pretrained(served.path)
    out = []
    for row in arithmetic_dataset()["train"].select(range(prompts)):
        prompt = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        reply = httpx.post(f"{served.url}/inference/v1/generate", timeout=300, json={
            "token_ids": prompt, "sampling_params": {"max_tokens": 24, "n": n, "temperature": 1.0, "logprobs": 0}}).json()
        assert all(c.get("routed_experts") is None for c in reply["choices"])  # the CPU build returns none
        out += [(prompt, choice) for choice in reply["choices"]]
    return out


def with_stand_in_routes(rollouts: list[tuple[list[int], dict]], sampler: torch.nn.Module) -> list[tuple[list[int], dict]]:
    """Each choice with ``routed_experts`` as vLLM sends them, from ``sampler``'s own routing of the tokens."""
    from grpo_core.models.moe.routing import RoutingReplay

    replay = RoutingReplay.install(sampler, sampler.config.num_hidden_layers)
    out = []
    with torch.no_grad():
        for prompt, choice in rollouts:
            ids = prompt + choice["token_ids"]
            sampler(input_ids=torch.tensor([ids[:-1]]), use_cache=False)
            routes = replay.own_topk().numpy().astype(np.uint8)
            out.append((prompt, {**choice, "routed_experts": npy_b64(routes)}))
    replay.clear()
    return out


def samples_of(rollouts: list[tuple[list[int], dict]]):
    """RolloutSamples through the rollout worker's own code: reply parsing, turn record, sequence, routes."""
    from grpo_core.rollout.reconcile import reconcile_turns
    from grpo_core.rollout.routes import sequence_routes
    from grpo_core.rollout.types import RolloutSample, TurnRecord
    from grpo_core.vllm_server.replies import check_routes, parse_generate_choice

    samples = []
    for i, (prompt, choice) in enumerate(rollouts):
        parsed = parse_generate_choice(choice, 0)
        if parsed.routed_experts is not None:
            check_routes(parsed.routed_experts, len(prompt) + len(parsed.token_ids))
        turn = TurnRecord(prompt, parsed.token_ids, parsed.logprobs, routed_experts=parsed.routed_experts)
        (seq,) = reconcile_turns([turn], fork_threshold_tokens=8).sequences
        samples.append(RolloutSample(
            token_ids=seq.token_ids, completion_mask=seq.completion_mask, sampler_logprobs=seq.sampler_logprobs,
            advantage=1.0, reward=0.0, group_id=i // 4, row_index=i // 4, epoch=0, rollout_id=str(i), policy_version=0,
            routed_experts=sequence_routes(seq, [turn])))
    return samples


def replayed_forward(model: torch.nn.Module, samples, replay_on: bool) -> tuple[torch.Tensor, dict]:
    """Trained-token log-probs of tree rows (fp32, the trainer's forward) and, per sample, the experts each
    forwarded position was dispatched to and the routers' own top-k."""
    from grpo_core.models.attention import tree as ta
    from grpo_core.models.moe.policy import MoEPolicy
    from grpo_core.packing.collator import pack_row
    from grpo_core.packing.planner import plan_step

    ta.enable_tree_attention(model, backend="reference", linear_backend="reference")
    moe = MoEPolicy.for_model(model, replay=replay_on)
    plan = plan_step(samples, world_size=1, gradient_accumulation_steps=1, token_budget=100_000)
    (row,) = plan.rows
    packed = pack_row(row)
    moe.before_forward(packed.routes)
    with torch.no_grad():
        logits = model(**packed.model_inputs(), logits_to_keep=packed.logit_index).logits[0]
    logprobs = torch.log_softmax(logits.double(), -1).gather(-1, packed.target_ids[:, None])[:, 0]
    layers = [m.layer for m in moe.routing.layers]
    dispatched = torch.stack(moe.routing.dispatched(), 1)  # [positions, moe layers, k]
    own = moe.routing.own_topk()[:, layers]
    per_sample = {}
    for i, sample in enumerate(row.samples):
        at = np.concatenate([seg.offset + np.arange(used) for seg, used in row.sample_segments(i)])
        per_sample[i] = (dispatched[at], own[at], sample)
    moe.after_backward()
    order = np.argsort(packed.sample_index.numpy(), kind="stable")
    return logprobs[torch.as_tensor(order)], per_sample


@pytest.mark.parametrize("variant", VARIANTS)
def test_replay_dispatches_every_completion_token_to_the_sampler_routes(check_servers: dict[str, Served],
                                                                       variant: str) -> None:
    served = check_servers[variant]
    rollouts = server_rollouts(served)
    model = load(served.path)
    sampler = copy.deepcopy(model).to(torch.bfloat16 if served.spec.dtype == "bfloat16" else torch.float32)
    samples = samples_of(with_stand_in_routes(rollouts, sampler))
    server = torch.cat([torch.as_tensor(s.sampler_logprobs[s.completion_mask], dtype=torch.float64) for s in samples])
    report: dict[str, float] = {"samples": len(samples), "completion_tokens": int(len(server))}
    for replay_on in (False, True):
        logprobs, per_sample = replayed_forward(copy.deepcopy(model), samples, replay_on)
        checked = mismatched = 0
        for _, (dispatched, own, sample) in per_sample.items():
            first = int(np.flatnonzero(sample.completion_mask)[0]) - 1  # the position that predicts the first answer token
            theirs = torch.as_tensor(sample.routed_experts[first : len(dispatched)].astype(np.int64)).sort(-1).values
            used = dispatched[first:].sort(-1).values
            mine = own[first:].sort(-1).values
            checked += len(theirs)
            mismatched += int((mine != theirs).any(-1).any(-1).sum())
            if replay_on:
                assert torch.equal(used, theirs), f"sample {sample.rollout_id}: a completion position went to other experts"
            else:
                assert torch.equal(used, mine)
        gap = (logprobs - server).abs()
        label = "replay" if replay_on else "own_routing"
        report |= {f"{label}_gap_mean": gap.mean().item(), f"{label}_gap_max": gap.max().item()}
        report["routing_mismatch"] = mismatched / checked
    print(json.dumps({served.variant: report}))
    assert report["completion_tokens"] > 50


# ---- a server without routes -------------------------------------------------------------------------------------
def test_run_without_routes_warns_once_and_trains(check_servers: dict[str, Served], tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """On the Qwen3-MoE variant's server (the check is the same for both)."""
    from grpo_core.rewards import accuracy_reward, format_reward
    from grpo_core.tiny import arithmetic_dataset
    from grpo_core.training.trainer import AsyncGRPOTrainer

    served = check_servers[VARIANTS[0]]
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "run"), vllm_server_base_url=served.url, report_to="none",
                           bf16=False, max_steps=2, per_device_train_batch_size=16, num_generations=4,
                           max_completion_length=24, learning_rate=1e-4, save_strategy="no", seed=0)
    caplog.set_level(logging.WARNING, logger="grpo_core.server_checks")
    trainer = AsyncGRPOTrainer(model=served.path, reward_funcs=[accuracy_reward, format_reward],
                               train_dataset=arithmetic_dataset()["train"], args=args)
    history = trainer.train()
    warnings = [r.getMessage() for r in caplog.records if "routing_replay" in r.getMessage()]
    assert len(warnings) == 1 and RETURN_ROUTED_EXPERTS in warnings[0], warnings
    assert len(history) == 2 and trainer.moe is not None and not trainer.moe.replay
    assert all("sampling/routing_mismatch" not in h for h in history)


# ---- learning: the hybrid module's run and margin (120 steps at the demo's settings, +0.15 reward) ---------------
@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_learns_on_its_server(tuned_servers: dict[str, Served], variant: str, tmp_path: Path) -> None:
    first, last, history = learning_run(tuned_servers[variant], tmp_path)
    assert len(history) == LEARN_STEPS
    assert last >= first + MARGIN, f"{variant}: reward {first:.3f} -> {last:.3f}"
