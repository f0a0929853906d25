"""The fused log-prob head's Triton kernels against their PyTorch forms (``grpo_core.models.head``):

* ``stats_triton``: the log-normaliser equals ``torch.logsumexp`` to fp32 rounding, and the sampled and top ids'
  log-probs equal ``fused.chunk_stats``', with temperatures, candidate masks (a row masked but for its sampled id, a
  row masked entirely), vocabularies that are not a multiple of the block, and rows split over several programs;
* ``grad_triton``: the logits' gradient equals ``fused.chunk_grad`` to one bf16 rounding for one program per row
  and for several, written into a new tensor or over the logits, with the top ids' terms compared at every entry
  or written apart (repeated top ids, a top id that is the sampled id, one outside the candidate set); the two
  forms of the top terms agree bit for bit.

They run on a GPU, or on the CPU under Triton's interpreter (``tests/interpreted_kernels.py``): without either in
this process, ``test_the_head_kernels_run_under_the_interpreter`` runs them in a child process. The launches here
are small (``columns_per_program`` of 96 and blocks of 32) so that a row of a few hundred ids spans several
programs and several blocks per program, as a 152k vocabulary does with the defaults.
"""

from __future__ import annotations

import pytest
import torch

from grpo_core.models.head.fused import chunk_grad, chunk_stats
from tests.interpreted_kernels import in_a_child_where_no_kernels, kernel_device, needs_kernels, run_under_interpreter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL_LAUNCH = dict(columns_per_program=96, block=32)


@in_a_child_where_no_kernels
def test_the_head_kernels_run_under_the_interpreter():
    """This file's kernel tests in a child process under Triton's CPU interpreter: all run, none skipped."""
    run_under_interpreter(__file__, min_passed=18)


def logits_case(rows: int, vocab: int, dtype: torch.dtype, masked: bool, n_top: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    device = kernel_device()
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    tops = torch.randint(0, vocab, (rows, n_top), generator=gen) if n_top else None
    masks = None
    if masked:
        masks = torch.rand(rows, vocab, generator=gen) < 0.6
        masks[torch.arange(rows), targets] = True
        masks[0] = False
        masks[0, targets[0]] = True  # a row whose candidate set is its sampled id alone
        masks[1] = False  # a row masked entirely: its normaliser is -inf, as torch.logsumexp's
        masks[2, :200] = False  # the first programs of a row see nothing but masked ids
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return move(logits), move(targets), move(tops), move(masks)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_log_normaliser_equals_logsumexp(dtype, masked, temperature):
    from grpo_core.models.head.stats_triton import triton_lse

    logits, _, _, masks = logits_case(7, 1001, dtype, masked, 0)
    scaled = logits.float() / temperature
    if masks is not None:
        scaled = scaled.masked_fill(~masks, float("-inf"))
    want = torch.logsumexp(scaled, -1)
    got = triton_lse(logits, temperature, masks, **SMALL_LAUNCH)
    assert got.dtype == torch.float32
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    assert torch.allclose(got[finite], want[finite], rtol=2e-6, atol=2e-6), (got - want)[finite].abs().max()
    if masked:
        assert got[1].item() == float("-inf")
        assert torch.allclose(got[0], scaled[0].max())  # the sampled id alone: its own scaled logit
    whole_rows = triton_lse(logits, temperature, masks, columns_per_program=4096, block=1024)
    assert torch.allclose(whole_rows[finite], want[finite], rtol=2e-6, atol=2e-6)


@needs_kernels
@pytest.mark.parametrize("masked", [False, True])
def test_the_statistics_equal_chunk_stats(masked):
    from grpo_core.models.head import stats_triton

    logits, targets, tops, masks = logits_case(6, 517, torch.bfloat16, masked, 3, seed=1)
    tops[3, 1] = tops[3, 0]  # a repeated top id
    want = chunk_stats(logits, targets, 0.9, tops, masks)
    got = stats_triton.triton_chunk_stats(logits, targets, 0.9, tops, masks)
    for g, w in zip(got, want):
        # a row masked entirely: -inf normaliser, NaN log-probs (-inf - -inf), in both
        torch.testing.assert_close(g, w, rtol=2e-6, atol=2e-6, equal_nan=True)


@needs_kernels
@pytest.mark.parametrize("columns_per_program", [None, 96])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("inline_top", [False, True])
def test_the_logits_gradient_equals_chunk_grad(columns_per_program, masked, inline_top):
    from grpo_core.models.head.grad_triton import triton_chunk_grad

    logits, targets, tops, masks = logits_case(6, 777, torch.bfloat16, masked, 3, seed=2)
    tops[2, 1] = tops[2, 0]  # a repeated top id: its entry takes both terms
    tops[4, 2] = targets[4]  # a top id that is the sampled id: its entry takes both
    if masks is not None:
        masks[1, targets[1]] = True  # a masked-out row has no gradient to compare; keep its sampled id
        masks[5, tops[5, 0]] = False  # a top id outside the candidate set: its entry stays zero
    lse = chunk_stats(logits, targets, 1.3, tops, masks)[0]
    gen = torch.Generator().manual_seed(3)
    upstream = torch.randn(6, generator=gen).to(logits.device)
    upstream_top = torch.randn(6, 3, generator=gen).to(logits.device)
    want = chunk_grad(logits, lse, targets, upstream, tops, upstream_top, masks, 1.3)
    launch = dict(columns_per_program=columns_per_program, block=32, inline_top=inline_top)
    got = triton_chunk_grad(torch.empty_like(logits), logits, lse, targets, upstream, tops, upstream_top, masks,
                            1.3, **launch)
    # both round an fp32 value to bf16 once; Triton's exp may differ from PyTorch's by a few fp32 ulps
    assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-6)
    over = logits.clone()
    triton_chunk_grad(over, over, lse, targets, upstream, tops, upstream_top, masks, 1.3, **launch)
    assert torch.equal(over, got)


@needs_kernels
def test_the_top_terms_written_apart_equal_the_inline_ones_bit_for_bit():
    """The second kernel sums a top id's entry in the inline form's order: the two launches agree exactly."""
    from grpo_core.models.head.grad_triton import triton_chunk_grad

    logits, targets, tops, _ = logits_case(9, 900, torch.bfloat16, False, 8, seed=4)
    tops[0, 7] = tops[0, 3]
    lse = chunk_stats(logits, targets, 0.8, tops, None)[0]
    upstream = torch.linspace(-1, 1, 9).to(logits.device)
    upstream_top = torch.linspace(-2, 2, 72).reshape(9, 8).to(logits.device)
    apart, inline = (triton_chunk_grad(torch.empty_like(logits), logits, lse, targets, upstream, tops, upstream_top,
                                       None, 0.8, columns_per_program=128, block=64, inline_top=inline_top)
                     for inline_top in (False, True))
    assert torch.equal(apart, inline)
