"""The FLOP count of Gated DeltaNet's chunked delta rule (``grpo_core.training.perf``), CPU.

* ``F(c)`` against a count by hand for a small chunk, and a segment cut into chunks plus a rest;
* the products that ``F`` counts are the ones the reference scan runs: PyTorch's FLOP counter over
  ``chunked_delta_rule`` sees exactly the three state products and the three ``c x c`` products
  computed as full blocks (the triangular solves are not matrix products to it);
* ``ModelFlops.from_model`` of a tiny Qwen3.5 hybrid reads the Gated DeltaNet sizes and adds
  ``3 x layers x value heads x sum F`` over the row's segments, and the short convolution's weights.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from grpo_core.models.attention.gated_delta import chunked_delta_rule
from grpo_core.packing.planner import plan_step
from grpo_core.training.perf import ModelFlops, causal_pairs, gdn_chunk_flops, gdn_row_flops, gdn_segment_flops
from tests.test_packing_trie import make_sample


def test_chunk_flops_by_hand():
    # c = 4 tokens, K = 2, V = 3:
    #   state products: q S0, k S0 (for the corrections) and k^T u, each 4 x 2 x 3 multiply-adds -> 3 * 2 * 24 = 144
    #   (beta k) k^T strictly below the diagonal: 6 pairs x 2 -> 12 multiply-adds -> 24
    #   triangular solve, right-hand sides beta v (3 columns) and decayed beta k (2 columns): 6 x 5 -> 60
    #   q k^T on and below the diagonal: 10 pairs x 2 -> 40; its product with u: 10 x 3 -> 60
    assert gdn_chunk_flops(4, 2, 3) == 144 + 24 + 60 + 40 + 60
    # one token: its state products (3 x 6 multiply-adds) and q.k, q.k * u (2 + 3 multiply-adds)
    assert gdn_chunk_flops(1, 2, 3) == 2 * (18 + 2 + 3)
    assert gdn_chunk_flops(0, 2, 3) == 0
    # 9 tokens in chunks of 4: two full chunks and a rest of 1
    assert gdn_segment_flops(9, 2, 3, chunk=4) == 2 * 328 + 46


def test_products_are_those_of_the_reference_scan():
    c, k, v = 8, 4, 6
    gen = torch.Generator().manual_seed(0)
    q, key = torch.randn(1, 1, c, k, generator=gen), torch.randn(1, 1, c, k, generator=gen)
    value = torch.randn(1, 1, c, v, generator=gen)
    g, beta = -torch.rand(1, 1, c, generator=gen), torch.rand(1, 1, c, generator=gen)
    with FlopCounterMode(display=False) as counter:
        chunked_delta_rule(q, key, value, g, beta, torch.zeros(1, 1, k, v), chunk=c)
    dense = 6 * c * k * v + 2 * c * c * (2 * k + v)  # (beta k) k^T, q k^T and (q k^T) u as full c x c blocks
    assert counter.get_total_flops() == dense
    # F counts the triangles instead, and the solve that the counter does not see
    triangles = c * (c - 1) * k + c * (c + 1) * (k + v)
    solve = c * (c - 1) * (k + v)
    assert gdn_chunk_flops(c, k, v) == 6 * c * k * v + triangles + solve


def tiny_qwen35() -> torch.nn.Module:
    config = Qwen3_5TextConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    )
    torch.manual_seed(0)
    return Qwen3_5ForCausalLM(config)


def test_model_flops_of_a_hybrid():
    model = tiny_qwen35()
    flops = ModelFlops.from_model(model)
    assert (flops.num_layers, flops.gdn_layers, flops.gdn_heads) == (1, 3, 4)
    assert (flops.gdn_key_dim, flops.gdn_value_dim) == (8, 16)
    conv = sum(layer.linear_attn.conv1d.weight.numel() for layer in model.model.layers[:3])
    assert conv == 3 * (2 * 2 * 8 + 4 * 16) * 4  # q, k, v channels x kernel 4
    linear = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    assert flops.layer_params == linear + conv
    # a shared prompt and two completions: a root segment longer than a chunk and two children
    prompt = list(range(1, 71))
    samples = [make_sample(prompt + [7] * 6, 6, group_id=0), make_sample(prompt + [9] * 81, 81, group_id=0)]
    row = plan_step(samples, world_size=1, gradient_accumulation_steps=1, token_budget=10_000).rows[0]
    lengths = sorted(seg.num_nodes for seg in row.segments())
    assert len(lengths) == 3 and sum(lengths) == row.num_unique_tokens and lengths[-1] > 64
    per_head = sum(gdn_segment_flops(n, 8, 16) for n in lengths)
    assert gdn_row_flops(row, 8, 16) == per_head
    expected = (6 * flops.layer_params * row.num_unique_tokens + 6 * flops.head_params * row.num_trained_tokens
                + 12 * 1 * 4 * 8 * causal_pairs(row) + 3 * 3 * 4 * per_head)
    assert flops.row_flops(row) == expected
