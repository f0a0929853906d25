"""Choosing the tree-attention kernel by device (``grpo_core/models/attention/backends.py``), on a CPU.

The order per GPU type, the fallbacks and the errors are checked with fakes only for whether a
kernel can be loaded (a CPU has none of them); the probe that guards the tree mask runs for real,
with the CPU stand-in of a fused kernel, once correct and once with a top-left causal mask.

    .venv/bin/python -m pytest -q tests/test_attention_backends.py
"""

from __future__ import annotations

import logging
import typing

import pytest
import torch
import torch.nn.functional as F

from grpo_core.config import AsyncGRPOConfig, AttentionBackendName, ConfigError
from grpo_core.config_checks import KernelRef, parse_kernel_ref
from grpo_core.models.attention import backends as ab
from grpo_core.models.attention import tree as ta


def fake_attempt(available: set[str], calls: list[str]):
    def attempt(name: str) -> str:
        calls.append(name)
        if name not in available:
            raise ab.BackendUnavailable(f"{name} is not installed")
        return f"loaded {name}"

    return attempt


@pytest.mark.parametrize("capability, rocm, family", [
    (None, False, "cpu"), ((7, 5), False, "older_cuda"), ((8, 0), False, "ampere"), ((8, 9), False, "ampere"),
    ((9, 0), False, "hopper"), ((10, 0), False, "blackwell"), ((12, 0), False, "blackwell"), ((9, 4), True, "rocm"),
])
def test_device_families(capability, rocm, family):
    assert ab.family_of(capability, rocm) == family


def test_every_family_has_an_order_of_known_kernels():
    assert set(ab.BACKEND_ORDER) == set(typing.get_args(ab.DeviceFamily))
    for order in ab.BACKEND_ORDER.values():
        assert set(order) <= set(ab.FUSED_KERNELS) and len(set(order)) == len(order)
    # The config's choices are the fused kernels plus auto and the reference, in one declaration.
    assert set(typing.get_args(AttentionBackendName)) == {"auto", "reference", *ab.FUSED_KERNELS}
    assert ab.device_family(torch.device("cpu")) == "cpu"


@pytest.mark.parametrize("family, available, chosen, tried", [
    ("hopper", {"kernels", "flash_attn_cute", "torch_varlen"}, "kernels", ["kernels"]),
    ("hopper", {"flash_attn_cute", "torch_varlen"}, "flash_attn_cute", ["kernels", "flash_attn_cute"]),
    ("hopper", {"torch_varlen", "aten_flash"}, "torch_varlen", ["kernels", "flash_attn_cute", "torch_varlen"]),
    ("blackwell", {"flash_attn_cute"}, "flash_attn_cute", ["kernels", "flash_attn_cute"]),
    # FlashAttention-4 is never tried before sm90, even where it is installed.
    ("ampere", {"flash_attn_cute", "torch_varlen"}, "torch_varlen", ["kernels", "torch_varlen"]),
    ("rocm", {"kernels"}, "kernels", ["kernels"]),
    ("hopper", set(), "reference", ["kernels", "flash_attn_cute", "torch_varlen", "aten_flash"]),
    ("cpu", {"kernels", "torch_varlen"}, "reference", []),
])
def test_auto_takes_the_first_available_kernel_in_the_device_order(family, available, chosen, tried, caplog):
    calls: list[str] = []
    with caplog.at_level(logging.INFO, logger=ab.__name__):
        choice = ab.pick_backend("auto", family, fake_attempt(available, calls))
    assert choice.name == chosen and calls == tried
    assert choice.value == (None if chosen == "reference" else f"loaded {chosen}")
    # Every kernel passed over is logged with its reason.
    passed_over = tried if chosen == "reference" else tried[:-1]
    assert [s.split(":")[0] for s in choice.skipped] == passed_over
    for name in choice.skipped:
        assert f"{name.split(':')[0]} skipped ({name.split(': ', 1)[1]})" in caplog.text
    if chosen == "reference" and family != "cpu":
        assert "no fused varlen kernel runs" in caplog.text


def test_a_kernel_asked_for_by_name_is_the_only_one_tried():
    calls: list[str] = []
    choice = ab.pick_backend("torch_varlen", "hopper", fake_attempt({"kernels", "torch_varlen"}, calls))
    assert (choice.name, calls) == ("torch_varlen", ["torch_varlen"])
    calls.clear()
    assert ab.pick_backend("reference", "hopper", fake_attempt({"kernels"}, calls)).name == "reference"
    assert calls == []  # the reference runs anywhere: nothing to load


@pytest.mark.parametrize("name", ab.FUSED_KERNELS)
def test_a_kernel_asked_for_by_name_that_cannot_run_names_the_field_and_the_fix(name):
    with pytest.raises(ab.AttentionBackendError) as err:
        ab.pick_backend(name, "hopper", fake_attempt(set(), []))
    message = str(err.value)
    assert f"AsyncGRPOConfig.attention_backend={name!r}" in message
    assert f"{name} is not installed" in message and ab.INSTALL_HINTS[name] in message
    assert "attention_backend='auto'" in message


def test_unknown_backend_is_refused():
    with pytest.raises(ab.AttentionBackendError, match="unknown attention backend 'fa3'"):
        ab.pick_backend("fa3", "hopper", fake_attempt({"kernels"}, []))
    with pytest.raises(ConfigError, match="attention_backend"):
        AsyncGRPOConfig(attention_backend="fa3")


@pytest.mark.parametrize("spec, ref", [
    ("kernels-community/flash-attn3@1", KernelRef(repo_id="kernels-community/flash-attn3", version=1)),
    ("owner/name@main", KernelRef(repo_id="owner/name", revision="main")),
    ("owner/name@v0.2", KernelRef(repo_id="owner/name", revision="v0.2")),
    ("/opt/kernels/fa3", KernelRef(path="/opt/kernels/fa3")),
    ("./fa3", KernelRef(path="./fa3")),
    ("~/fa3", KernelRef(path="~/fa3")),
])
def test_kernel_references(spec, ref):
    assert parse_kernel_ref(spec) == ref
    assert AsyncGRPOConfig(attention_kernel=spec).attention_kernel == spec


@pytest.mark.parametrize("spec", ["kernels-community/flash-attn3", "flash-attn3@1", "a/b/c@1", "owner/name@", "a b/c@1"])
def test_kernel_references_without_version_or_owner_are_refused_by_the_config(spec):
    with pytest.raises(ConfigError, match=r"attention_kernel=.*flash-attn3@1"):
        AsyncGRPOConfig(attention_kernel=spec)


def test_the_kernels_backend_defaults_to_the_device_kernel():
    assert ab.kernel_spec_for("hopper", None) == ab.DEFAULT_HUB_KERNELS["hopper"]
    assert ab.kernel_spec_for("hopper", "./mine") == "./mine"
    with pytest.raises(ab.BackendUnavailable, match="set attention_kernel"):
        ab.kernel_spec_for("blackwell", None)
    for spec in ab.DEFAULT_HUB_KERNELS.values():
        parse_kernel_ref(spec)  # every default is a loadable reference


def test_loading_failures_are_reasons_not_crashes():
    # Without the kernels package: ModuleNotFoundError; with it: no such folder. Either is a reason.
    with pytest.raises(ab.BackendUnavailable, match="No module named 'kernels'|no kernel folder"):
        ab.load_kernel("kernels", "hopper", "/nonexistent/kernel")
    with pytest.raises(ab.BackendUnavailable, match="set attention_kernel"):
        ab.load_kernel("kernels", "cpu")
    # On this CPU the fused kernels either do not import or refuse CPU tensors: named, in one line.
    with pytest.raises(ab.AttentionBackendError) as err:
        ta.select_backend("torch_varlen", "cpu")
    assert "\n" not in str(err.value) and "torch_varlen" in str(err.value)


# ---- the probe guards the tree mask -----------------------------------------------------------------
def top_left_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """A varlen kernel with the causal mask aligned top-left: wrong for segments below ancestors."""
    heads, outs = q.shape[1], []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for g in range(len(cq) - 1):
        qq, kk, vv = q[cq[g]: cq[g + 1]], k[ck[g]: ck[g + 1]], v[ck[g]: ck[g + 1]]
        mask = torch.ones(qq.shape[0], kk.shape[0], dtype=torch.bool).tril()
        rep = heads // kk.shape[1]
        o = F.scaled_dot_product_attention(qq.transpose(0, 1), kk.repeat_interleave(rep, 1).transpose(0, 1),
                                           vv.repeat_interleave(rep, 1).transpose(0, 1), attn_mask=mask, scale=scale)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def test_select_backend_probes_each_kernel_and_keeps_the_tree_mask(monkeypatch):
    """On a 'Hopper' whose FlashAttention-4 masks top-left, auto rejects it by the probe and takes the next."""
    kernels = {"flash_attn_cute": top_left_kernel, "torch_varlen": ta._emulated_kernel}

    def fake_load(name, family, attention_kernel=None):
        if name not in kernels:
            raise ab.BackendUnavailable(f"{name} is not installed")
        return kernels[name]

    monkeypatch.setattr(ta, "load_kernel", fake_load)
    monkeypatch.setattr(ta, "device_family", lambda device: "hopper")
    backend = ta.select_backend("auto", "cpu")
    assert backend.name == "torch_varlen"
    assert ta._probe(backend, torch.device("cpu")) < 2e-2
    with pytest.raises(ab.AttentionBackendError, match="flash_attn_cute.*probe error"):
        ta.select_backend("flash_attn_cute", "cpu")


def test_fp32_training_on_a_gpu_gets_reference_or_a_named_error():
    from grpo_core.models.attention.tree import backend_for_precision

    # The fused kernels take bf16/fp16 only: auto falls back, a named kernel is refused at start-up.
    assert backend_for_precision("auto", "cuda", torch.float32) == "reference"
    with pytest.raises(ValueError, match=r"attention_backend='torch_varlen'.*bf16=True"):
        backend_for_precision("torch_varlen", "cuda", torch.float32)
    assert backend_for_precision("torch_varlen", "cuda", torch.bfloat16) == "torch_varlen"
    assert backend_for_precision("auto", "cuda", torch.float16) == "auto"
    assert backend_for_precision("auto", "cpu", torch.float32) == "auto"
    assert backend_for_precision("reference", "cuda", torch.float32) == "reference"
