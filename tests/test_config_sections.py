"""The config's sections (grpo_core/config_sections.py): complete, made of real names, read-through, closed."""

from __future__ import annotations

import dataclasses

import pytest

from grpo_core.config import AsyncGRPOConfig
from grpo_core.config_sections import SECTIONS, ConfigSection


def test_every_field_is_in_a_section():
    fields = {f.name for f in dataclasses.fields(AsyncGRPOConfig)}
    listed = set().union(*SECTIONS.values())
    assert fields - listed == set(), "fields no section names"


def test_a_section_names_only_fields_and_methods_of_the_config():
    fields = {f.name for f in dataclasses.fields(AsyncGRPOConfig)}
    for name, names in SECTIONS.items():
        unknown = {n for n in names if n not in fields and not callable(getattr(AsyncGRPOConfig, n, None))}
        assert not unknown, f"section {name!r} lists names the config does not have: {unknown}"


def test_a_section_reads_the_configs_values_and_methods():
    config = AsyncGRPOConfig(save_steps=7, vllm_server_base_url=["http://a:1/", "http://b:2"], temperature=0.5)
    assert config.checkpoint.save_steps == 7
    assert config.fleet.server_urls() == ["http://a:1", "http://b:2"]
    assert config.evaluation.temperature == 0.5 and config.evaluation.num_eval_generations() == config.num_generations


def test_a_field_outside_the_section_is_refused_naming_the_section():
    with pytest.raises(AttributeError, match="'fleet' section has no 'temperature'"):
        AsyncGRPOConfig().fleet.temperature  # noqa: B018
    with pytest.raises(AttributeError, match="read-only"):
        AsyncGRPOConfig().checkpoint.save_steps = 3


def test_sections_are_no_fields_of_the_config():
    """The flat surface is unchanged: a section is neither a field, nor in the config's dict or its job file."""
    names = {f.name for f in dataclasses.fields(AsyncGRPOConfig)}
    assert not names & set(SECTIONS)
    assert isinstance(AsyncGRPOConfig().tracking, ConfigSection)
    assert not set(dataclasses.asdict(AsyncGRPOConfig())) & set(SECTIONS)
