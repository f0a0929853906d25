"""The short convolution's index tables (``tree_conv_plan``) and its Triton kernels (``tree_conv_triton``).

* The tables, CPU, fp64: the convolution and its input gradient computed from them in PyTorch equal
  ``short_conv.tree_causal_conv1d`` and its autograd gradient on random tries (hypothesis) and on a row where one
  parent's last tokens are read by several children and a context reaches past a one-token parent.
* The kernels (a GPU, or the CPU under ``TRITON_INTERPRET=1`` with Triton installed): output and gradients of input,
  weight and bias equal the PyTorch form, and the backward gives the same bits twice.

Run: ``.venv/bin/python -m pytest tests/test_tree_conv_kernels.py``. Where this session has no Triton (the project
environment's lock leaves it out), the kernels' half runs in a child process under Triton's interpreter with
Triton from ``.triton-interpreter/`` (``scripts/triton_interpreter.sh``, which ``scripts/test.sh`` runs), and none
of it may be skipped there. By hand: ``TRITON_INTERPRET=1 PYTHONPATH=.triton-interpreter .venv/bin/python -m pytest
tests/test_tree_conv_kernels.py``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from grpo_core.models.attention import short_conv as sc
from grpo_core.models.attention.probe_rows import probe_meta
from grpo_core.models.attention.tree_conv_plan import taps_conv, taps_conv_input_grad, tree_conv_plan
from grpo_core.packing.collator import pack_row
from grpo_core.packing.trie import TreeRow
from tests.interpreted_kernels import in_a_child_where_no_kernels, kernel_device, needs_kernels, run_under_interpreter
from tests.test_packing_trie import make_sample, sample_sets

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = torch.device("cpu")


def fan_out_meta():
    """A root of 6 tokens read by three children (their first tokens' windows all reach into it), one child of one
    token whose own child's window reaches past it into the root, and a second root."""
    return probe_meta(CPU, FAN_OUT, FAN_OUT_PARENTS)


FAN_OUT, FAN_OUT_PARENTS = [6, 2, 3, 1, 4, 5], (None, 0, 0, 0, 3, None)


def random_conv(u: int, channels: int, kernel: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(u, channels, generator=gen, dtype=torch.float64)
    weight = torch.randn(channels, kernel, generator=gen, dtype=torch.float64)
    bias = torch.randn(channels, generator=gen, dtype=torch.float64)
    grad = torch.randn(u, channels, generator=gen, dtype=torch.float64)
    return rows, weight, bias, grad


def check_tables(meta, kernel: int, seed: int = 0) -> None:
    u = int(meta.cu_seq_q[-1])
    rows, weight, bias, grad = random_conv(u, 5, kernel, seed)
    plan = tree_conv_plan(meta, kernel, CPU)
    x = rows.t().unsqueeze(0).requires_grad_()  # [1, C, U], as a layer hands it over
    expected = sc.tree_causal_conv1d(x, weight, bias, meta)[0].t()
    torch.testing.assert_close(taps_conv(rows, weight, bias, plan), expected, atol=1e-12, rtol=1e-10)
    expected.backward(grad)
    torch.testing.assert_close(taps_conv_input_grad(grad, weight, plan), x.grad[0].t(), atol=1e-12, rtol=1e-10)


@given(samples=sample_sets(vocab_max=4))
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_the_tables_give_the_tree_convolution_and_its_input_gradient(samples):
    row = TreeRow()
    for s in samples:
        row.add(s)
    meta = pack_row(row).attention
    for kernel in (1, 2, 4):
        check_tables(meta, kernel)


def test_a_parents_tail_read_by_several_children_sums_every_reader():
    meta = fan_out_meta()
    plan = tree_conv_plan(meta, 4, CPU)
    # The root's last three tokens (rows 3-5) are read across segments; so is the one-token child (row 11).
    read = (plan.cross_row >= 0).nonzero().flatten().tolist()
    assert read == [3, 4, 5, 11]
    # Row 5, the root's last token, is read by every token of the children of 2 and 3 tokens (rows 6-10), by the
    # one-token child (11) and by the first two tokens of its child (12, 13): eight readers.
    line = plan.cross_table[int(plan.cross_row[5])]
    readers = plan.cross_reader[line[line < plan.cross_reader.numel()]]
    assert readers.tolist() == [6, 7, 8, 9, 10, 11, 12, 13]
    # A token's readers inside its own segment only: the root's token 3 is read by 4 and 5 there, not by row 6.
    assert plan.succ[3].tolist() == [-1, 5, 4, 3]
    check_tables(meta, 4)


def test_a_row_without_forks_has_no_reads_across_segments():
    row = TreeRow()
    for tokens in ([1, 2, 3, 4, 5], [6, 7, 8]):
        row.add(make_sample(tokens, 2))
    meta = pack_row(row).attention
    plan = tree_conv_plan(meta, 4, CPU)
    assert not plan.has_cross and plan.cross_table.shape == (0, 0)
    second = int(meta.cu_seq_q[1])
    assert plan.taps[second].tolist() == [-1, -1, -1, second]  # the second root starts from zeros, not the first's tail
    assert plan.succ[second - 1].tolist() == [-1, -1, -1, second - 1]  # and nothing of it reads the first's tail


# ------------------------------------------------------------------------------------------ the kernels
@in_a_child_where_no_kernels
def test_the_kernels_run_under_the_interpreter_with_triton_of_their_own():
    """This file's kernel tests, in a child process under Triton's CPU interpreter with Triton from
    ``.triton-interpreter/``: all of them must run (no skip) and pass, so that a session without Triton still
    checks the kernels the GPU runs."""
    run_under_interpreter(__file__, min_passed=9)


@pytest.fixture(autouse=True)
def untimed_autotuner_on_the_cpu(monkeypatch):
    """The interpreter has no timer: there the autotuner takes its first config (each is checked on a GPU)."""
    if kernel_device() == "cpu":
        import triton.runtime.autotuner as autotuner

        monkeypatch.setattr(autotuner.Autotuner, "do_bench", lambda self, fn, quantiles=None: [0.0, 0.0, 0.0],
                            raising=False)


@needs_kernels
@pytest.mark.parametrize("activation", ["silu", None, "gelu"])
def test_the_kernels_equal_the_pytorch_form(activation):
    device = torch.device(kernel_device())
    for shape, parents in ((FAN_OUT, FAN_OUT_PARENTS), ([40, 7, 70, 3], (None, 0, 1, 0))):
        meta = probe_meta(device, shape, parents)
        u = int(meta.cu_seq_q[-1])
        rows, weight, bias, grad = (t.float().to(device) for t in random_conv(u, 200, 4, seed=u))
        inputs = [rows.t().unsqueeze(0), weight, bias]  # 200 channels: a full tile of 128 and a partial one
        results = []
        for backend in (sc.CONV_BACKENDS["triton"], sc.CONV_BACKENDS["torch"]):
            xs = [t.clone().requires_grad_() for t in inputs]
            out = sc.tree_conv(*xs, activation, meta, backend=backend)
            out.backward(grad.t().unsqueeze(0))
            results.append([out.detach()] + [t.grad for t in xs])
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@needs_kernels
@pytest.mark.parametrize("config", range(4))
def test_every_tile_config_gives_the_pytorch_form(config, monkeypatch):
    """Each tile size the autotuner may pick, on its own (partial tiles of tokens and channels included)."""
    from grpo_core.models.attention import tree_conv_triton as tct

    for kernel in (tct._forward_kernel, tct._input_grad_kernel, tct._grad_pre_kernel):
        monkeypatch.setattr(kernel, "configs", [kernel.configs[config % len(kernel.configs)]])
        monkeypatch.setattr(kernel, "cache", {})
    device = torch.device(kernel_device())
    meta = probe_meta(device, [40, 7, 70, 3])
    u = int(meta.cu_seq_q[-1])
    rows, weight, bias, grad = (t.float().to(device) for t in random_conv(u, 200, 4, seed=config))
    results = []
    for backend in (sc.CONV_BACKENDS["triton"], sc.CONV_BACKENDS["torch"]):
        xs = [t.clone().requires_grad_() for t in (rows.t().unsqueeze(0), weight, bias)]
        out = sc.tree_conv(*xs, "silu", meta, backend=backend)
        out.backward(grad.t().unsqueeze(0))
        results.append([out.detach()] + [t.grad for t in xs])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@needs_kernels
def test_the_kernels_backward_is_the_same_bits_every_run():
    device = torch.device(kernel_device())
    meta = probe_meta(device, FAN_OUT, FAN_OUT_PARENTS)
    u = int(meta.cu_seq_q[-1])
    rows, weight, bias, grad = (t.float().to(device) for t in random_conv(u, 64, 4, seed=1))
    grads = []
    for _ in range(2):
        xs = [t.clone().requires_grad_() for t in (rows.t().unsqueeze(0), weight, bias)]
        sc.tree_conv(*xs, "silu", meta, backend=sc.CONV_BACKENDS["triton"]).backward(grad.t().unsqueeze(0))
        grads.append([t.grad for t in xs])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@needs_kernels
def test_the_kernels_pass_the_backends_probe():
    assert sc.probe_conv(sc.CONV_BACKENDS["triton"], torch.device(kernel_device()), channels=64) < 2e-2
