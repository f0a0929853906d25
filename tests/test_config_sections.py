"""Each part's typed settings (grpo_core/config_sections.py): complete, made of real names, frozen, closed."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from grpo_core.config import AsyncGRPOConfig, FleetSettings, TrackingSettings
from grpo_core.config_sections import SECTIONS, method_reads_outside


def test_every_field_is_in_a_part():
    fields = {f.name for f in dataclasses.fields(AsyncGRPOConfig)}
    listed = set().union(*SECTIONS.values())
    assert fields - listed == set(), "fields no part names"


def test_a_part_names_only_fields_and_methods_of_the_config():
    fields = {f.name for f in dataclasses.fields(AsyncGRPOConfig)}
    for name, names in SECTIONS.items():
        unknown = {n for n in names if n not in fields and not callable(getattr(AsyncGRPOConfig, n, None))}
        assert not unknown, f"part {name!r} lists names the config does not have: {unknown}"


@pytest.mark.parametrize("part", sorted(SECTIONS))
def test_no_method_a_part_carries_reads_outside_the_part(part):
    """A derived value (``server_urls``, ``resolved_*``) runs on the part's settings: every name it reads on ``self``
    must be the part's, or it fails there (and only when called)."""
    assert method_reads_outside(AsyncGRPOConfig, part) == {}


def test_the_check_of_methods_sees_a_read_outside_the_part(monkeypatch):
    """The test above can fail: drop a field a method reads from its part and it is named."""
    monkeypatch.setitem(SECTIONS, "sync", SECTIONS["sync"] - {"vllm_server_base_url"})
    assert method_reads_outside(AsyncGRPOConfig, "sync") == {"server_urls": {"vllm_server_base_url"}}


def test_settings_hold_the_configs_values_and_methods_with_its_types():
    config = AsyncGRPOConfig(save_steps=7, vllm_server_base_url=["http://a:1/", "http://b:2"], temperature=0.5)
    assert config.checkpoint.save_steps == 7
    assert isinstance(config.fleet, FleetSettings) and config.fleet.server_urls() == ["http://a:1", "http://b:2"]
    assert config.evaluation.temperature == 0.5 and config.evaluation.num_eval_generations() == config.num_generations
    declared = {f.name: f.type for f in dataclasses.fields(AsyncGRPOConfig)}
    assert all(f.type == declared[f.name] for f in dataclasses.fields(TrackingSettings))


def test_settings_are_frozen_copies():
    config = AsyncGRPOConfig(max_steps=5)
    tracking = config.tracking
    with pytest.raises(dataclasses.FrozenInstanceError):
        tracking.max_steps = 3  # type: ignore[misc]
    config.max_steps = 9
    assert tracking.max_steps == 5 and config.tracking.max_steps == 9


def test_a_field_outside_the_part_is_refused_naming_the_part():
    with pytest.raises(AttributeError, match="'fleet' settings have no 'temperature'"):
        AsyncGRPOConfig().fleet.temperature  # noqa: B018


def test_settings_cross_to_another_process():
    """The rollout worker and the trainer's helpers receive settings pickled."""
    sync = AsyncGRPOConfig(output_dir="s3://bucket/run").sync
    assert pickle.loads(pickle.dumps(sync)) == sync


def test_parts_are_no_fields_of_the_config():
    """The flat surface is unchanged: a part is neither a field, nor in the config's dict or its job file."""
    names = {f.name for f in dataclasses.fields(AsyncGRPOConfig)}
    assert not names & set(SECTIONS)
    assert isinstance(AsyncGRPOConfig().tracking, TrackingSettings)
    assert not set(dataclasses.asdict(AsyncGRPOConfig())) & set(SECTIONS)


def _sync_setup(config, **values):
    from grpo_core.sync.factory import SyncSetup

    return SyncSetup(config=config, model=None, rank=0, backend="gloo", wire_dtype=None, model_path=None, **values)


def test_the_weight_sync_is_set_up_from_its_own_settings_only():
    """The weight sync's set-up takes ``config.sync``; handed the whole config, it refuses at once, naming the part.
    What it needs of other parts (a LoRA run's server command) it receives as a value."""
    config = AsyncGRPOConfig(max_staleness=3)
    assert _sync_setup(config.sync).config == config.sync
    with pytest.raises(TypeError, match=r"config\.sync"):
        _sync_setup(config)
    with pytest.raises(ValueError, match="lora_command"):
        _sync_setup(config.sync, peft_config=object())
    assert _sync_setup(config.sync, peft_config=object(), lora_command="vllm serve m").lora_command == "vllm serve m"
