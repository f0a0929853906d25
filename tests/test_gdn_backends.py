"""Which delta-rule and convolution kernels a hybrid's Gated DeltaNet layers run: the backends' probes, the
probe's head sizes and count (the model's), the fallback from FlashQLA to fla's Triton kernels, and refusals by
name. The kernels' own results are tested in ``tests/test_gated_delta.py``."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from grpo_core.models.attention import gated_delta as gd
from grpo_core.models.attention import hybrid
from grpo_core.models.attention import short_conv as sc
from tests.test_gated_delta import COMMON

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_backend_choice():
    assert gd.select_gdn_backend("auto", "cpu").name == "reference"
    assert gd.probe_gdn(gd.GDN_BACKENDS["reference"], torch.device("cpu")) < 1e-2  # bf16 against fp32
    with pytest.raises(RuntimeError, match="fla"):
        gd.select_gdn_backend("fla", "cpu")
    with pytest.raises(ValueError, match="unknown"):
        gd.select_gdn_backend("mamba", "cpu")


def test_fla_kernel_names_the_kernels_fla_dispatches_to(monkeypatch):
    """FlashQLA serves heads of 128 where the package is importable and FLA_FLASH_QLA is not 0; fla's Triton
    kernels otherwise."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_qla" else real(name, *a))
    monkeypatch.delenv("FLA_FLASH_QLA", raising=False)
    assert gd.fla_kernel(128, 128) == "flash_qla"
    assert gd.fla_kernel(64, 128) == "triton"
    monkeypatch.setenv("FLA_FLASH_QLA", "0")
    assert gd.fla_kernel(128, 128) == "triton"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_qla" else real(name, *a))
    monkeypatch.delenv("FLA_FLASH_QLA")
    assert gd.fla_kernel(128, 128) == "triton"


def test_the_backend_probe_runs_at_the_model_head_sizes(monkeypatch):
    """install_gated_delta probes at the GDN layers' own head sizes, value-head count and convolution width (a kernel
    library may dispatch by size, and FlashQLA compiles a kernel per head count)."""
    seen = []
    monkeypatch.setattr(gd, "register_gdn_backend", lambda name, device, dk, dv, channels, kernel, heads:
                        seen.append((dk, dv, channels, kernel, heads)) or "reference")
    torch.manual_seed(0)
    # heads of 32, not the probe's default 64; 6 value heads, not its default 4
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{**COMMON, "linear_num_value_heads": 6}))
    layer = hybrid.gated_delta_layers(model)[0]
    assert hybrid.value_heads(layer) == 6
    hybrid.install_gated_delta(model)
    assert seen == [(layer.head_k_dim, layer.head_v_dim, layer.conv_dim, layer.conv_kernel_size, layer.num_v_heads)]
    assert hybrid.head_sizes(layer) == (layer.head_k_dim, layer.head_v_dim)


def test_flash_qla_failing_its_probe_falls_back_to_fla_triton_kernels(monkeypatch):
    """Where FlashQLA's kernels fail the probe, fla's own are switched on (FLA_FLASH_QLA=0) and probed in turn."""
    probes = []

    def probe(device, dk, dv, heads):
        assert heads == 16  # the caller's count, to both probes
        probes.append(gd.fla_kernel(dk, dv))
        return "probe error 3.1e-01" if probes[-1] == "flash_qla" else None

    monkeypatch.setenv("FLA_FLASH_QLA", "1")  # recorded, so that the fallback's "0" is undone after the test
    monkeypatch.setattr(gd, "_probe_fla", probe)
    monkeypatch.setattr(gd.importlib.util, "find_spec", lambda name, *a: object())
    assert gd.select_gdn_backend("fla", "cuda", 128, 128, heads=16).name == "fla"
    assert probes == ["flash_qla", "triton"] and gd.os.environ["FLA_FLASH_QLA"] == "0"
    monkeypatch.setattr(gd, "_probe_fla", lambda device, dk, dv, heads: "probe error 3.1e-01")
    with pytest.raises(RuntimeError, match="not usable here: probe error"):
        gd.select_gdn_backend("fla", "cuda", 128, 128)


def test_the_probes_check_the_backward_under_no_grad():
    """The delta rule's and the convolution's probes run a backward: called under ``no_grad`` (a caller that
    re-registers a backend while evaluating), they still measure, instead of failing every backend."""
    with torch.no_grad():
        assert gd.probe_gdn(gd.GDN_BACKENDS["reference"], torch.device("cpu")) < 1e-2
        assert sc.probe_conv(sc.CONV_BACKENDS["torch"], torch.device("cpu")) < 1e-2
