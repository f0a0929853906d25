"""Which dataset row each prompt *position* names, for map-style and streaming datasets alike.

A position counts prompts from the start of the run across epochs; it is what a checkpoint records
(``rollout_state.json``) and what a resume starts from. A map-style ``Dataset`` is visited in a
seeded permutation per epoch, so position ``p`` is row ``order(epoch)[p % n]`` and a resume jumps
straight there. A streaming ``IterableDataset`` has no length and cannot be indexed: it is read in
its own order (``set_epoch`` reshuffles a shuffled stream per pass), and a resume reaches position
``p`` by reading and discarding the rows before it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


def prompt_order(num_prompts: int, epoch: int, seed: int) -> np.ndarray:
    """The order in which epoch ``epoch`` visits the prompts (a seeded permutation, stable across resumes)."""
    return np.random.default_rng([seed, epoch]).permutation(num_prompts)


def is_streaming(dataset: Any) -> bool:
    return not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"))


@dataclass
class Prompt:
    position: int
    epoch: int
    row_index: int  # index of the row in its epoch's pass (map-style: in the dataset)
    row: dict[str, Any]
    epoch_size: int | None  # rows per epoch, once known (always for map-style)


def prompts_from(dataset: Any, start_position: int, seed: int, epochs: float | None) -> Iterator[Prompt]:
    """Prompts from ``start_position`` on; ``epochs`` bounds the run (None: endless)."""
    if is_streaming(dataset):
        yield from _streamed(dataset, start_position, epochs)
    else:
        yield from _indexed(dataset, start_position, seed, epochs)


def _indexed(dataset: Any, start: int, seed: int, epochs: float | None) -> Iterator[Prompt]:
    n = len(dataset)
    if n == 0:
        raise ValueError("train_dataset is empty")
    last = math.inf if epochs is None else math.ceil(epochs * n)
    position, order, order_epoch = start, None, -1
    while position < last:
        epoch, k = divmod(position, n)
        if epoch != order_epoch:
            order, order_epoch = prompt_order(n, epoch, seed), epoch
        row_index = int(order[k])
        yield Prompt(position, epoch, row_index, dataset[row_index], n)
        position += 1


def _streamed(dataset: Any, start: int, epochs: float | None) -> Iterator[Prompt]:
    # Fractions of an epoch need the epoch's length, which a stream tells only at its end: whole passes.
    passes = math.inf if epochs is None else math.ceil(epochs)
    position, epoch, size = 0, 0, None
    skipped = 0
    while epoch < passes:
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)
        k = -1
        for k, row in enumerate(dataset):
            if position >= start:
                if skipped:
                    log.info("streaming dataset: read and skipped %d rows to reach prompt position %d", skipped, start)
                    skipped = 0
                yield Prompt(position, epoch, k, row, size)
            else:
                skipped += 1
            position += 1
        if k < 0:
            raise ValueError("train_dataset is empty")
        size = k + 1
        epoch += 1
