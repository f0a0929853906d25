"""Checks of what a user hands the trainer, made in the main process before anything is spawned.

Each failure names the culprit (the column, the function, the row, the object and the argument it
came in), what was expected and what was found. What can only be seen once the run is going (a
reward function that raises on some row, returns the wrong count or non-numbers) is checked where
it happens, in the rollout process, by ``check_reward_values``; its message reaches the trainer
first, with the worker's traceback below it.
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import cloudpickle

from grpo_core.environments import environment_inputs as from_environment


class InputError(ValueError):
    """Something handed to the trainer cannot work; the message names it and says what fixes it."""


# ---- the model ---------------------------------------------------------------------------------------
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def check_model_reference(model: Any) -> None:
    """A model given by name must be a local folder, or look like a hub id (``org/name``)."""
    if not isinstance(model, (str, os.PathLike)):
        return
    path = os.fspath(model)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise InputError(f"no model at {path!r}: the folder has no config.json, so it holds no transformers model")
        return
    if os.path.exists(path) or path.startswith((".", "/", "~")) or not _HUB_ID.match(path):
        raise InputError(f"no model at {path!r}: it is not a local folder, nor a hub id of the form 'org/name'")
    from huggingface_hub import model_info, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(path, "config.json"), str):
        return  # downloaded before: loads offline too
    try:
        # One short request, where the loader would retry for tens of seconds before failing.
        model_info(path, timeout=10)
    except Exception as exc:  # noqa: BLE001 - not found, gated, offline: all mean the same here
        raise InputError(
            f"no model at {path!r}: it is not a local folder, and the hub could not provide it "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
        ) from exc


def model_load_error(model: Any, exc: Exception) -> Exception:
    """The error to raise when loading ``model`` failed: a named one for a name that is neither a local
    folder nor a hub id that could be fetched, else the loader's own."""
    if isinstance(model, (str, os.PathLike)) and not os.path.isdir(os.fspath(model)):
        return InputError(
            f"no model at {os.fspath(model)!r}: it is not a local folder, and the hub could not provide it "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
        )
    return exc


# ---- the dataset -----------------------------------------------------------------------------------
def first_rows(dataset: Any, n: int = 8) -> list[dict[str, Any]]:
    """Up to ``n`` rows from the start of a ``Dataset`` or ``IterableDataset`` (without consuming a stream)."""
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        return [dataset[i] for i in range(min(n, len(dataset)))]
    rows = []
    for row in dataset:
        rows.append(row)
        if len(rows) == n:
            break
    return rows


def check_train_dataset(dataset: Any, reward_funcs: list[Callable[..., Any]]) -> None:
    """The dataset has prompts of a usable type, and every column a reward function asks for."""
    if dataset is None:
        raise InputError("train_dataset is required: pass a datasets.Dataset (or IterableDataset) with a 'prompt' column")
    rows = first_rows(dataset)
    if not rows:
        raise InputError("train_dataset is empty: it has no rows to train on")
    for index, row in enumerate(rows):
        if not isinstance(row, dict) or "prompt" not in row:
            found = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise InputError(
                f"train_dataset has no 'prompt' column (row {index} has columns {found}): each row needs 'prompt', a "
                "string or a list of chat messages ({'role': ..., 'content': ...})"
            )
        _check_prompt(row["prompt"], index)
        try:
            refuse_images(as_messages(row["prompt"]), row)
        except ImageInputError as exc:
            raise InputError(f"train_dataset row {index}: {exc}") from None
    columns = set(rows[0])
    for func in reward_funcs:
        missing = sorted(_required_columns(func) - columns)
        if missing:
            raise InputError(
                f"reward function {reward_name(func)!r} needs the column(s) {missing}, which train_dataset lacks "
                f"(its columns: {sorted(columns)}); add them, or give the parameters defaults"
            )


def _check_prompt(prompt: Any, index: int) -> None:
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt):
        return
    shown = repr(prompt)
    raise InputError(
        f"train_dataset column 'prompt' must hold a string or a list of chat messages ({{'role': ..., 'content': ...}}); "
        f"row {index} holds {type(prompt).__name__} {shown[:80]}"
    )


def as_messages(prompt: Any) -> list[dict[str, Any]]:
    """A prompt as chat messages: a plain string becomes one user message."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


# Passed to every reward function by the trainer itself, never taken from the dataset.
REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids")


def _required_columns(func: Callable[..., Any]) -> set[str]:
    """Keyword parameters a reward function needs from the dataset (no default, not passed by the trainer)."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {
        p.name
        for p in params
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty and p.name not in REWARD_ARGUMENTS
    }


def reward_name(func: Callable[..., Any]) -> str:
    return str(getattr(func, "__name__", None) or type(func).__name__)


# ---- crossing to the rollout process ----------------------------------------------------------------
def check_crossing(named_objects: dict[str, Any]) -> None:
    """Raise ``TypeError`` naming any object that cannot be sent to the rollout process.

    Objects cross with cloudpickle: functions and classes defined in the user's script (and lambdas,
    closures) go by value, importable ones by reference. What truly cannot cross (an open socket, a
    lock, a live client) is named here, with the argument it came in.
    """
    for argument, obj in named_objects.items():
        items = obj if isinstance(obj, (list, tuple)) else [obj]
        for item in items:
            if item is None:
                continue
            try:
                cloudpickle.dumps(item)
            except Exception as exc:  # noqa: BLE001 - every pickling failure gets the same explanation
                name = getattr(item, "__qualname__", None) or getattr(item, "__name__", None) or type(item).__name__
                raise TypeError(
                    f"{argument} {name!r} cannot be sent to the rollout process: {exc}. It (or something it refers to) "
                    "holds a resource that cannot be copied to another process, such as an open socket, a lock or a "
                    "live client; create that resource inside the function (or in AsyncRolloutLoop.setup) instead"
                ) from exc


# ---- reward values (checked in the rollout process) ----------------------------------------------------
def check_reward_values(func_name: str, row_index: int, values: Any, expected: int) -> list[float]:
    """The values of one reward call as floats (NaN for ``None``), or ``InputError`` naming the culprit."""
    if not isinstance(values, Iterable) or isinstance(values, (str, bytes, dict)):
        raise InputError(
            f"reward function {func_name!r} returned {type(values).__name__} {values!r:.80} for dataset row {row_index}; "
            f"it must return a list of {expected} floats (or None), one per completion"
        )
    values = list(values)
    if len(values) != expected:
        raise InputError(
            f"reward function {func_name!r} returned {len(values)} values for the {expected} completions of dataset row "
            f"{row_index}; return one value (or None) per completion"
        )
    out = []
    for i, value in enumerate(values):
        if value is None:
            out.append(math.nan)
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise InputError(
                f"reward function {func_name!r} returned {value!r} ({type(value).__name__}) for completion {i} of dataset "
                f"row {row_index}; rewards must be numbers (or None for 'not scored')"
            )
        number = float(value)
        if not math.isfinite(number):
            raise InputError(
                f"reward function {func_name!r} returned {number} for completion {i} of dataset row {row_index}; rewards "
                "must be finite (return None for 'not scored')"
            )
        out.append(number)
    return out


# ---- prompts with images ------------------------------------------------------------------------------
class ImageInputError(ValueError):
    """A prompt carries an image (or another non-text input): only text is trained for now."""


_IMAGE_COLUMNS = ("image", "images", "video", "videos")


def refuse_images(messages: Iterable[Mapping[str, Any]], row: Mapping[str, Any] | None = None) -> None:
    """Raise ``ImageInputError`` if a chat message has a non-text content part, or ``row`` an image column.

    Pure: call it where a prompt's messages are turned into tokens, before anything is generated.
    """
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, (str, type(None))):
            continue
        parts = [content] if isinstance(content, Mapping) else content
        for part in parts:
            kind = part.get("type", "text") if isinstance(part, Mapping) else type(part).__name__
            if kind != "text":
                raise ImageInputError(
                    f"message {i} ({message.get('role', '?')}) has a {kind!r} content part: prompts with images "
                    "are not supported yet; vision-language models are trained on text only (their vision "
                    "tower is frozen). Remove the image parts, or drop these prompts from the dataset."
                )
    for column in _IMAGE_COLUMNS:
        value = None if row is None else row.get(column)
        if value is not None and not (isinstance(value, (list, tuple)) and len(value) == 0):
            raise ImageInputError(
                f"dataset row has a non-empty {column!r} column: prompts with images are not supported yet; "
                "vision-language models are trained on text only. Remove the column or the row."
            )


def check_trainer_inputs(args: Any, model: Any, reward_funcs: list[Callable[..., Any]], train_dataset: Any,
                         eval_dataset: Any, scored_elsewhere: bool) -> None:
    """The trainer's inputs, named in the main process before anything is loaded or spawned (``scored_elsewhere``:
    an environment or a rollout loop of the caller's scores the rollouts, so no reward function is needed)."""
    check_model_reference(model)
    if args.reward_weights is not None and len(args.reward_weights) != len(reward_funcs):
        raise ValueError(
            f"AsyncGRPOConfig.reward_weights has {len(args.reward_weights)} entries for "
            f"{len(reward_funcs)} reward functions; give one weight per function"
        )
    if not reward_funcs and not scored_elsewhere:
        raise ValueError("reward_funcs is empty and there is no environment_factory: nothing would score the rollouts")
    check_train_dataset(train_dataset, reward_funcs)
    if args.eval_strategy == "steps":
        if eval_dataset is None:
            raise ValueError("AsyncGRPOConfig.eval_strategy='steps' needs eval_dataset=...; pass one or set eval_strategy='no'")
        check_train_dataset(eval_dataset, reward_funcs)


def inputs_with_environment(args: Any, reward_funcs: list[Callable[..., Any]], train_dataset: Any,
                            eval_dataset: Any) -> tuple[Any, list[Callable[..., Any]], Any, Any]:
    """The run's config, reward functions and datasets, taken from ``args.environment`` where one is named
    (``grpo_core.environments``; its packages are imported only then), else returned as given."""
    if getattr(args, "environment", None) is None:
        return args, reward_funcs, train_dataset, eval_dataset
    return from_environment(args, reward_funcs, train_dataset, eval_dataset)
