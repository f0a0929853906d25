"""Prompt positions: a map-style dataset in a seeded order per epoch, a stream in its own order, and a
resume that lands on the same prompt either way."""

from __future__ import annotations

import itertools

import pytest
from datasets import Dataset

from grpo_core.data.prompts import is_streaming, prompt_order, prompts_from


def rows(n: int) -> Dataset:
    return Dataset.from_dict({"prompt": [f"q{i}" for i in range(n)], "solution": [str(i) for i in range(n)]})


def test_map_style_visits_a_seeded_permutation_per_epoch_and_resumes_anywhere():
    data = rows(5)
    run = list(itertools.islice(prompts_from(data, 0, seed=3, epochs=None), 12))
    assert [p.position for p in run] == list(range(12))
    assert [p.epoch for p in run] == [0] * 5 + [1] * 5 + [2] * 2
    assert [p.row_index for p in run[:5]] == list(prompt_order(5, 0, 3))
    assert sorted(p.row_index for p in run[5:10]) == list(range(5))
    assert all(p.row["prompt"] == f"q{p.row_index}" for p in run)
    resumed = list(itertools.islice(prompts_from(data, 7, seed=3, epochs=None), 5))
    assert [(p.position, p.row_index) for p in resumed] == [(p.position, p.row_index) for p in run[7:12]]


def test_map_style_epochs_bound_the_run():
    assert len(list(prompts_from(rows(4), 0, seed=0, epochs=1.5))) == 6
    assert len(list(prompts_from(rows(4), 5, seed=0, epochs=1.5))) == 1


def test_a_stream_is_read_in_order_and_a_resume_reads_up_to_its_position():
    stream = rows(5).to_iterable_dataset()
    assert is_streaming(stream) and not is_streaming(rows(5))
    run = list(itertools.islice(prompts_from(stream, 0, seed=0, epochs=None), 8))
    assert [p.row["prompt"] for p in run] == ["q0", "q1", "q2", "q3", "q4", "q0", "q1", "q2"]
    assert [p.epoch for p in run] == [0] * 5 + [1] * 3
    assert [p.epoch_size for p in run] == [None] * 5 + [5] * 3  # known once a pass has ended
    resumed = list(itertools.islice(prompts_from(stream, 6, seed=0, epochs=None), 2))
    assert [(p.position, p.row["prompt"]) for p in resumed] == [(6, "q1"), (7, "q2")]


def test_a_stream_runs_whole_passes_and_an_empty_one_is_refused():
    assert len(list(prompts_from(rows(3).to_iterable_dataset(), 0, seed=0, epochs=1.2))) == 6
    class EmptyStream:  # any iterable without len() is read as a stream
        def __iter__(self):
            return iter(())

    with pytest.raises(ValueError, match="empty"):
        list(prompts_from(EmptyStream(), 0, seed=0, epochs=None))
