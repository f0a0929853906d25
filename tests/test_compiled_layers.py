"""Compiled decoder layers (``compile_mode="layers"``) where kernels from outside PyTorch break their graphs, CPU.

On a GPU, tree attention's kernels, the delta rule's and the short convolution's are ``torch.compiler.disable``d,
so a compiled layer's graph breaks around each. Here the CPU backends are wrapped the same way, which reproduces
those breaks with the real compiler (Inductor), the real autograd of the compiled graphs and transformers' layers.

What is checked, with both settings of ``AsyncGRPOConfig.compile_graph_breaks``:

* ``outer`` (PyTorch's default): the graph ends where transformers' Gated DeltaNet layer calls the convolution, so
  what crosses the break is its transposed view ``[1, C, U]``; the backward receives that view's gradient copied
  channel-first, and the input projection's two backward matmuls read an operand whose leading dimension is the row's
  length ``U`` (on a GPU, ``U`` not a multiple of 8 makes cuBLAS take slow unaligned kernels: measured as two such
  matmuls per layer and row, 11.5% of the hybrid's kernel time on an H100). The test asserts that this happens, so
  that the check below can be seen to detect it.
* ``nested``: no backward matmul reads such an operand, fewer graphs are compiled, and loss gradients and outputs are
  those of the eager model.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from grpo_core.config import AsyncGRPOConfig, ConfigError
from grpo_core.models import fsdp
from grpo_core.models.attention import gated_delta as gd
from grpo_core.models.attention import short_conv
from grpo_core.models.attention import tree as ta
from grpo_core.packing.collator import pack_row
from grpo_core.packing.planner import plan_step
from tests.test_checkpoint import model_path, train_rows  # noqa: F401 - fixtures
from tests.test_packing_trie import make_sample

needs_nested = pytest.mark.skipif(not fsdp.nested_graph_breaks_supported(),
                                  reason="this PyTorch has no nested graph breaks")


def tiny_hybrid() -> torch.nn.Module:
    config = Qwen3_5TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=128, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
    )
    torch.manual_seed(0)
    return Qwen3_5ForCausalLM(config)


def tree_row(completions: tuple[int, int], prompt_len: int):
    prompt = list(range(1, prompt_len))
    samples = [make_sample(prompt + [7 + i] * n, n, group_id=0) for i, n in enumerate(completions)]
    return pack_row(plan_step(samples, world_size=1, gradient_accumulation_steps=1, token_budget=10_000).rows[0])


def step(model: torch.nn.Module, row) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    logits = model(**row.model_inputs(), logits_to_keep=row.logit_index).logits
    logits.float().pow(2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def matmuls_led_by(length: int, run, trace_path) -> list[tuple[list, list]]:
    """``(shapes, strides)`` of the 2-D matmuls ``run()`` makes that read an operand with a stride of ``length`` (a
    leading dimension equal to the row's length), from a profile with shapes recorded."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        run()
    prof.export_chrome_trace(str(trace_path))
    found = []
    for event in json.loads(trace_path.read_text())["traceEvents"]:
        args = event.get("args", {})
        dims, strides = args.get("Input Dims"), args.get("Input Strides")
        if event.get("name") != "aten::mm" or not strides:
            continue
        if any(isinstance(s, list) and len(s) == 2 and length in s for s in strides[:2]):
            found.append((dims[:2], strides[:2]))
    return found


@needs_nested
def test_nested_graph_breaks_give_the_input_projection_a_row_major_gradient(monkeypatch, tmp_path):
    base = tiny_hybrid()
    ta.enable_tree_attention(base, backend="varlen_emulated", linear_backend="reference")
    # The kernels opaque to the compiler, as on a GPU (the delta rule's ``run_segment_tree`` always is).
    monkeypatch.setattr(ta, "_active", ta.Backend("opaque", torch.compiler.disable(ta._active.run, recursive=True), False))
    monkeypatch.setattr(short_conv, "_active", short_conv.ConvBackend(
        "opaque", torch.compiler.disable(short_conv._torch_conv, recursive=True), False))
    monkeypatch.setattr(gd, "_active", gd.GDN_BACKENDS["reference"])
    eager = copy.deepcopy(base)
    rows = [tree_row((9, 30), 25), tree_row((5, 12), 33), tree_row((6, 13), 40)]
    lengths = [r.model_inputs()["input_ids"].shape[-1] for r in rows]
    assert lengths[-1] % 8 and lengths[-1] not in (16, 32, 64, 128), lengths  # a stride no layer width could be

    seen = {}
    for setting in ("outer", "nested"):
        torch._dynamo.reset()  # compiled frames are kept per code object, across models: start each setting afresh
        torch._dynamo.utils.counters.clear()
        model = copy.deepcopy(base)
        fsdp.compile_layers(model, pointwise_only=False, nested_graph_breaks=setting == "nested")
        for row in rows:
            out, grads = step(model, row)
            ref_out, ref_grads = step(eager, row)
            torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-4)
            assert grads.keys() == ref_grads.keys()
            for name in grads:
                torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=1e-3, msg=name)
        led = matmuls_led_by(lengths[-1], lambda: step(model, rows[-1]), tmp_path / f"{setting}.json")
        seen[setting] = (led, torch._dynamo.utils.counters["stats"]["unique_graphs"])
    torch._dynamo.reset()

    outer_led, outer_graphs = seen["outer"]
    nested_led, nested_graphs = seen["nested"]
    # outer: the input projection (64 -> 128 channels) reads its gradient with the row's length as leading dimension,
    # in the product for its input's gradient and in the one for its weight's
    channels = base.config.linear_num_key_heads * 16 * 2 + base.config.linear_num_value_heads * 16
    assert len(outer_led) == 2 * 2, outer_led  # two GDN layers, two products each
    assert all(channels in dims[0] + dims[1] for dims, _ in outer_led), outer_led
    assert nested_led == [], nested_led
    assert nested_graphs < outer_graphs, (nested_graphs, outer_graphs)


def test_compile_graph_breaks_resolves_per_pytorch_and_names_the_field(monkeypatch):
    with pytest.raises(ConfigError, match="compile_graph_breaks"):
        AsyncGRPOConfig(compile_graph_breaks="inner")
    cuda_layers = lambda mode: fsdp.FSDPSettings.from_config(  # noqa: E731
        AsyncGRPOConfig(compile_graph_breaks=mode), bf16=True, device_type="cuda")
    assert cuda_layers("outer").nested_graph_breaks is False
    assert cuda_layers("auto").nested_graph_breaks is fsdp.nested_graph_breaks_supported()
    # settings built directly (the benchmarks') take the default config's choice
    assert fsdp.FSDPSettings().nested_graph_breaks is fsdp.nested_graph_breaks_supported()

    monkeypatch.setattr(fsdp, "nested_graph_breaks_supported", lambda: False)
    assert cuda_layers("auto").nested_graph_breaks is False
    with pytest.raises(ValueError, match="compile_graph_breaks='nested'.*'outer'"):
        cuda_layers("nested")
    with pytest.raises(ValueError, match="nested_graph_breaks=True"):
        fsdp.FSDPSettings(compile="layers", nested_graph_breaks=True)


def test_a_trainer_with_compiled_layers_records_its_graph_breaks_and_trains_as_eager(model_path, train_rows,  # noqa: F811
                                                                                     tmp_path):
    """The trainer with ``compile_mode="layers"`` on the CPU (Inductor, the tiny model, fp64): it tags
    ``resolved.compile_graph_breaks`` with what ``auto`` became, and a micro-batch's loss and gradients through its
    compiled layers are the eager trainer's. A trainer that compiles nothing has no such tag."""
    from tests.test_logprob_head import make_trainer, packed_row

    eager = make_trainer(model_path, train_rows, tmp_path / "eager")
    compiled = make_trainer(model_path, train_rows, tmp_path / "compiled", compile_mode="layers")
    assert "resolved.compile_graph_breaks" not in eager.tracker.tags
    assert compiled.tracker.tags["resolved.compile_mode"] == "layers"
    assert compiled.tracker.tags["resolved.compile_graph_breaks"] == fsdp.resolve_graph_breaks("auto")
    packed = packed_row(eager.vocab_size)
    results = []
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for trainer in (eager, compiled):
        loss, _ = trainer.micro_batch.run(packed, packed.num_trained + 3, packed.num_tokens)
        results.append((float(loss), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the compiled trainer's layers did compile
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-9, abs=1e-12)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-7, atol=1e-10, msg=name)
    torch._dynamo.reset()


def test_a_compiler_error_under_nested_graph_breaks_names_the_setting():
    """``with_nested_graph_breaks``: the setting is on inside the call and off after it, a call may run inside
    another, and an error of the compiler's own keeps its type and gains a note naming ``compile_graph_breaks``;
    other errors pass untouched."""
    import torch._dynamo
    from torch._dynamo.exc import InternalTorchDynamoError

    seen = []

    def inner(x):
        seen.append(torch._dynamo.config.nested_graph_breaks)
        if x == "fail":
            raise InternalTorchDynamoError("the compiler gave up")
        if x == "bad":
            raise ValueError("not the compiler's")
        return x

    call = fsdp.with_nested_graph_breaks(inner)
    outer = fsdp.with_nested_graph_breaks(lambda x: call(x))
    assert outer("ok") == "ok" and seen == [True]
    assert torch._dynamo.config.nested_graph_breaks is False
    with pytest.raises(InternalTorchDynamoError) as raised:
        call("fail")
    assert any("compile_graph_breaks='outer'" in note for note in raised.value.__notes__)
    with pytest.raises(ValueError) as other:
        call("bad")
    assert not getattr(other.value, "__notes__", None)
    assert torch._dynamo.config.nested_graph_breaks is False
