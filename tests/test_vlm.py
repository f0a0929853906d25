"""Vision-language models trained on text: tiny random Qwen3.5 and Qwen3-VL, fp32, CPU, no server.

* ``load_policy`` loads the class the checkpoint names (a whole ``*ForConditionalGeneration``), where
  ``AutoModelForCausalLM`` would drop the vision tower of Qwen3.5;
* after optimizer steps on packed text rows the tower's and projector's parameters are bit-identical,
  have no gradient and no optimizer state, while the language model moved;
* packed rows of these models equal each sample forwarded alone (M-RoPE with text positions);
* weight sync leaves the tower out: checked on ``ModelWeightSource`` and on the wire, through the
  gloo transfer engines of both sides (trainer and an in-process vLLM-side receiver);
* two FSDP2 ranks: the tower is a unit of its own, stays sharded and unchanged, and steps equal
  the one-process steps, with and without activation checkpointing (which recomputes the GDN layers);
* prompts with images are refused.

Run: ``.venv/bin/python -m pytest tests/test_vlm.py``.
"""

from __future__ import annotations

import json
import os
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from grpo_core.data.inputs import ImageInputError, refuse_images
from grpo_core.models.attention import tree as ta
from grpo_core.models.loading import load_policy
from grpo_core.models.vision import frozen_tower_prefixes, vision_towers
from grpo_core.packing.collator import pack_row
from grpo_core.packing.planner import plan_step
from grpo_core.vllm_server.process import free_port
from tests.child_processes import run_ranks
from tests.test_packing_trie import make_sample

VOCAB = 64
TOWER = "model.visual."


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_vlm(kind: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random ``*ForConditionalGeneration`` (Qwen3.5: GDN hybrid text model; Qwen3-VL: deepstack)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                head_dim=64, max_position_embeddings=512, tie_word_embeddings=False)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2)
    torch.manual_seed(seed)
    if kind == "qwen3_5":
        config = Qwen3_5Config(text_config=dict(text, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                                                linear_key_head_dim=32, linear_value_head_dim=32,
                                                layer_types=["linear_attention"] * 3 + ["full_attention"]),
                               vision_config=vision)
        model = Qwen3_5ForConditionalGeneration(config)
    else:
        config = Qwen3VLConfig(text_config=dict(text, num_hidden_layers=2), vision_config=dict(vision, deepstack_visual_indexes=[0, 1]))
        model = Qwen3VLForConditionalGeneration(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    return model


KINDS = ["qwen3_5", "qwen3_vl"]


def samples(seed: int = 0):
    """A prompt with forked completions (two levels), and a second prompt."""
    rng = np.random.default_rng(seed)
    tok = lambda n: list(rng.integers(0, VOCAB, n))  # noqa: E731
    prompt, stem = tok(9), tok(4)
    out = [make_sample(prompt + stem + tok(n), 4 + n, advantage=float(rng.normal())) for n in (3, 6)]
    out += [make_sample(prompt + tok(5), 5, advantage=float(rng.normal()))]
    out += [make_sample(tok(6) + tok(7), 7, group_id=1, advantage=float(rng.normal()))]
    return out


def row_loss(model, row) -> torch.Tensor:
    packed = pack_row(row)
    logits = model(**packed.model_inputs(), logits_to_keep=packed.logit_index).logits[0]
    logprobs = torch.log_softmax(logits, -1).gather(-1, packed.target_ids[:, None])[:, 0]
    return -(logprobs * packed.advantages).sum() / packed.num_trained


def trainable_optimizer(model) -> torch.optim.Optimizer:
    """As the trainer builds it: AdamW over the parameters that require gradients."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def tower_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith(TOWER)}


# ------------------------------------------------------------------------------------------ loading
def test_checkpoints_load_with_their_own_class(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_vlm("qwen3_5")
    model.save_pretrained(tmp_path)
    loaded, path = load_policy(str(tmp_path), torch.device("cpu"))
    assert type(loaded).__name__ == "Qwen3_5ForConditionalGeneration" and path == str(tmp_path)
    assert any(n.startswith(TOWER) for n, _ in loaded.named_parameters())
    # What loading through AutoModelForCausalLM would have given: the text model, no tower.
    text_only = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert not any(n.startswith(TOWER) for n, _ in text_only.named_parameters())
    # An in-memory model gets its class name in the config, so a checkpoint of it can be served.
    fresh, _ = load_policy(tiny_vlm("qwen3_vl"), torch.device("cpu"))
    assert fresh.config.architectures == ["Qwen3VLForConditionalGeneration"]


@pytest.mark.parametrize("kind", KINDS)
def test_tower_and_projector_are_frozen(kind):
    model, _ = load_policy(tiny_vlm(kind), torch.device("cpu"))
    names = [n for n, _ in vision_towers(model)]
    assert names == ["model.visual"]
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    expected = {n for n, _ in model.named_parameters() if n.startswith(TOWER)}
    assert frozen == expected and any(".merger." in n for n in frozen)
    if kind == "qwen3_vl":
        assert any("deepstack_merger_list" in n for n in frozen)
    assert frozen_tower_prefixes(model) == (TOWER,)


# ------------------------------------------------------------------------------------------ training
@pytest.mark.parametrize("kind", KINDS)
def test_steps_leave_the_tower_bit_identical(kind):
    model, _ = load_policy(tiny_vlm(kind), torch.device("cpu"))
    ta.enable_tree_attention(model, backend="reference", linear_backend="reference")
    optimizer = trainable_optimizer(model)
    before = tower_state(model)
    language = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith(TOWER)}
    for step in range(3):
        plan = plan_step(samples(step), world_size=1, gradient_accumulation_steps=1, token_budget=1000)
        optimizer.zero_grad()
        row_loss(model, plan.rows[0]).backward()
        optimizer.step()
    params = dict(model.named_parameters())
    for name, value in before.items():
        assert torch.equal(params[name], value), name
        assert params[name].grad is None, name
        assert params[name] not in optimizer.state, name
    moved = [n for n, v in language.items() if not torch.equal(params[n], v)]
    assert len(moved) == len(language), "every language-model parameter takes part in a text row"
    assert len(optimizer.state) == len(language)


@pytest.mark.parametrize("kind", KINDS)
def test_packed_rows_equal_samples_alone(kind):
    """Text rows with M-RoPE: depth as the position of all three axes is plain RoPE."""
    import copy

    model, _ = load_policy(tiny_vlm(kind), torch.device("cpu"))
    alone = copy.deepcopy(model)
    alone.set_attn_implementation("sdpa")
    ta.enable_tree_attention(model, backend="reference", linear_backend="reference")
    batch = samples()
    plan = plan_step(batch, world_size=1, gradient_accumulation_steps=1, token_budget=1000)
    packed = pack_row(plan.rows[0])
    with torch.no_grad():
        logits = model(**packed.model_inputs(), logits_to_keep=packed.logit_index).logits[0]
        got = torch.log_softmax(logits, -1).gather(-1, packed.target_ids[:, None])[:, 0]
        expected = []
        for s in batch:
            ids = torch.as_tensor(s.token_ids, dtype=torch.long)
            trained = np.flatnonzero(s.completion_mask)
            out = torch.log_softmax(alone(input_ids=ids[None], use_cache=False).logits[0], -1)
            expected.append(out[trained - 1].gather(-1, ids[trained][:, None])[:, 0])
    # fp32: Qwen3.5's GDN layers round differently chunked (tests/test_gated_delta.py measures 2e-5).
    assert (got - torch.cat(expected)).abs().max() <= (1e-5 if kind == "qwen3_vl" else 1e-4)


# ------------------------------------------------------------------------------------------ weight sync
def test_weight_source_leaves_the_tower_out():
    from grpo_core.sync.source import ModelWeightSource

    model, _ = load_policy(tiny_vlm("qwen3_5"), torch.device("cpu"))
    source = ModelWeightSource(model, wire_dtype=torch.bfloat16)
    names = [m.name for m in source.metadata()]
    assert [n for n, _ in source] == names
    assert not any(n.startswith(TOWER) for n in names)
    assert set(names) == {n for n, p in model.named_parameters() if p.requires_grad}
    # A tower someone unfreezes is trained, so it is sent.
    model.model.visual.requires_grad_(True)
    assert any(m.name.startswith(TOWER) for m in ModelWeightSource(model).metadata())


class _Receiver:
    """The vLLM side of the gloo transfer in this process: the worker engine with a recording model."""

    def __init__(self):
        from grpo_core.vllm_plugin.gloo_engine import GlooWeightTransferEngine

        self.received: dict[str, torch.Tensor] = {}
        model = SimpleNamespace(load_weights=lambda weights: self.received.update(weights))
        config = SimpleNamespace(model_config=None, parallel_config=SimpleNamespace(data_parallel_index=0, world_size=1, rank=0))
        self.engine = GlooWeightTransferEngine(None, config, torch.device("cpu"), model)
        self.update_infos: list[dict] = []

    # the trainer engine's client: what the HTTP routes would do on the server
    def init_weight_transfer_engine(self, init_info: dict, timeout: float | None = None) -> None:
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def start_weight_update(self, timeout: float | None = None) -> None:
        pass  # the server's layerwise-reload bookkeeping needs a vLLM model; not what is checked here

    def update_weights(self, update_info: dict, timeout: float | None = None) -> None:
        self.update_infos.append(update_info)
        self.engine.update_weights(update_info)

    def finish_weight_update(self, weight_version=None, timeout: float | None = None) -> None:
        pass


def test_no_tower_tensor_goes_on_the_wire():
    from grpo_core.sync.send.gloo_trainer import GlooTrainerInitInfo, GlooTrainerWeightTransferEngine
    from grpo_core.sync.source import ModelWeightSource

    model, _ = load_policy(tiny_vlm("qwen3_vl"), torch.device("cpu"))
    receiver = _Receiver()
    info = GlooTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=free_port(), world_size=2)
    sender = GlooTrainerWeightTransferEngine.trainer_init(info, client=receiver, source=ModelWeightSource(model))
    try:
        done = threading.Event()
        threading.Thread(target=lambda: (sender.send_weights(), done.set()), daemon=True).start()
        assert done.wait(60), "the transfer did not finish"
    finally:
        sender.shutdown()
        receiver.engine.shutdown()
    sent = receiver.update_infos[0]["names"]
    assert not any(n.startswith(TOWER) for n in sent)
    assert set(receiver.received) == set(sent) == {n for n, p in model.named_parameters() if p.requires_grad}
    params = dict(model.named_parameters())
    assert all(torch.equal(receiver.received[n], params[n].detach()) for n in sent)
    assert sender.bytes_sent == sum(params[n].numel() * params[n].element_size() for n in sent)


# ------------------------------------------------------------------------------------------ FSDP2
def _two_ranks(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from grpo_core.models.fsdp import FSDPSettings, full_state_dict, shard_policy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    steps = [plan_step(samples(s), world_size=2, gradient_accumulation_steps=1, token_budget=1000) for s in range(2)]
    model, _ = load_policy(tiny_vlm("qwen3_5"), torch.device("cpu"))
    ta.enable_tree_attention(model, backend="reference", linear_backend="reference")
    before = tower_state(model)
    model = shard_policy(model, FSDPSettings(), torch.device("cpu"))
    # The same with activation checkpointing: the recompute runs the patched GDN functions again.
    recomputed, _ = load_policy(tiny_vlm("qwen3_5"), torch.device("cpu"))
    ta.enable_tree_attention(recomputed, backend="reference", linear_backend="reference")
    recomputed = shard_policy(recomputed, FSDPSettings(activation_checkpointing=True), torch.device("cpu"))
    runs = [(trainable_optimizer(model), model, lambda plan: [plan.microbatches[0][rank]]),
            (trainable_optimizer(recomputed), recomputed, lambda plan: [plan.microbatches[0][rank]])]
    if rank == 0:  # the same steps in one process, both ranks' rows
        reference, _ = load_policy(tiny_vlm("qwen3_5"), torch.device("cpu"))
        ta.enable_tree_attention(reference, backend="reference", linear_backend="reference")
        runs.append((trainable_optimizer(reference), reference, lambda plan: plan.microbatches[0]))
    for plan in steps:
        for opt, m, rows in runs:
            opt.zero_grad()
            for row in rows(plan):
                row_loss(m, row).backward()
            opt.step()
    optimizer = runs[0][0]
    tower = model.model.visual
    local = {n: p.to_local().numel() for n, p in model.named_parameters() if n.startswith(TOWER)}
    full = full_state_dict(model)
    full_ac = full_state_dict(recomputed)
    result = {"tower_unit": isinstance(tower, FSDPModule), "tower_local": sum(local.values()),
              "tower_full": sum(t.numel() for t in before.values()),
              "tower_in_optimizer": any(p in optimizer.state for p in tower.parameters())}
    if rank == 0:
        ref = dict(reference.named_parameters())
        result["tower_unchanged"] = all(torch.equal(full[n], before[n]) for n in before)
        result["max_rel"] = max(float((full[n] - ref[n]).norm() / ref[n].norm()) for n in ref)
        result["max_rel_ac"] = max(float((full_ac[n] - ref[n]).norm() / ref[n].norm()) for n in ref)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def test_two_fsdp_ranks_keep_the_tower_sharded_and_frozen(tmp_path):
    run_ranks(_two_ranks, (free_port(), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["tower_unit"] and not r["tower_in_optimizer"]
        assert r["tower_local"] * 2 <= r["tower_full"] + 64, "each rank holds about half the tower"
    assert ranks[0]["tower_unchanged"]
    # 2 sharded ranks = 1 process, up to reduction order; with activation checkpointing too.
    assert ranks[0]["max_rel"] < 1e-5 and ranks[0]["max_rel_ac"] < 1e-5, ranks[0]


# ------------------------------------------------------------------------------------------ prompts
def test_prompts_with_images_are_refused():
    text = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "2+2?"}]}]
    refuse_images(text, row={"prompt": text, "images": []})
    with_image = text + [{"role": "user", "content": [{"type": "image", "image": "cat.png"}, {"type": "text", "text": "?"}]}]
    with pytest.raises(ImageInputError, match="message 2 .*'image'"):
        refuse_images(with_image)
    with pytest.raises(ImageInputError, match="'image_url'"):
        refuse_images([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}])
    with pytest.raises(ImageInputError, match="'images' column"):
        refuse_images(text, row={"prompt": text, "images": ["cat.png"]})
