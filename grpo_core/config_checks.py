"""The config's checks: strict per-field validation against the annotations, unknown-key refusal with a suggestion,
the error type every config refusal raises, and the parse of ``attention_kernel``'s reference.

Kept apart from ``grpo_core.config`` so that the declaration of the fields reads on its own; the launch layer's
configs (``grpo_core.launch.job``) use the same checks.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError


class ConfigError(ValueError):
    """A config value is invalid; the message names the field and how to fix it."""


# ---- kernel references ------------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelRef:
    """Where the ``kernels`` attention backend loads from: a local folder, or a Hub repo at a version or revision."""

    path: str | None = None
    repo_id: str | None = None
    version: int | None = None
    revision: str | None = None


def parse_kernel_ref(spec: str) -> KernelRef:
    """``/abs``, ``./rel``, ``../rel`` or ``~/dir``: a local kernel folder; ``owner/name@1``: a Hub kernel at major
    version 1; ``owner/name@<branch, tag or commit>``: at that revision.

    The ``kernels`` package loads a Hub kernel only at a stated version or revision, so a Hub id without ``@``
    is refused here, when the config is made, rather than at start-up on the GPU.
    """
    if spec.startswith(("/", "./", "../", "~")):
        return KernelRef(path=spec)
    repo_id, at, ref = spec.partition("@")
    if repo_id.count("/") != 1 or not all(repo_id.split("/")) or not at or not ref or any(c.isspace() for c in spec):
        raise ValueError(
            f"attention_kernel={spec!r}: use a Hub kernel with its version or revision "
            "('kernels-community/flash-attn3@1', 'owner/name@main') or a local folder path ('/path/to/kernel', './kernel')"
        )
    if ref.isdigit():
        return KernelRef(repo_id=repo_id, version=int(ref))
    return KernelRef(repo_id=repo_id, revision=ref)


# ---- checking ---------------------------------------------------------------------------------------
def check_known_keys(owner: str, values: dict[str, Any], known: list[str]) -> None:
    """Raise ``ConfigError`` for keys of ``values`` that ``owner`` does not have, suggesting the closest."""
    unknown = [k for k in values if k not in known]
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), known, n=1)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise ConfigError(f"{owner} has no field {', '.join(hints)}")


@functools.cache
def _field_adapters(cls: type) -> dict[str, TypeAdapter[Any]]:
    # Resolved once per class, subclasses included: their own fields are checked the same way.
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: TypeAdapter(hints[f.name]) for f in dataclasses.fields(cls)}


def check_fields(config: Any) -> None:
    """Validate every field against its annotation, strictly: a string is not a bool, 1 is not True."""
    for name, adapter in _field_adapters(type(config)).items():
        value = getattr(config, name)
        try:
            adapter.validate_python(value, strict=True)
        except ValidationError as exc:
            fail_field(config, name, _reason(exc))


def _reason(exc: ValidationError) -> str:
    messages = []
    for error in exc.errors():
        message = error["msg"]
        if error["type"] == "string_pattern_mismatch":
            message = "use the form LOW-HIGH, e.g. 40000-40100"
        if message not in messages:
            messages.append(message)
    # A union reports each member's complaint; the first ones name the expected value.
    return "; ".join(messages[:2])


def fail_field(config: Any, name: str, fix: str) -> typing.NoReturn:
    """Raise ``ConfigError`` naming ``config``'s field ``name``, its value, and ``fix``."""
    raise ConfigError(f"{type(config).__name__}.{name}={getattr(config, name)!r} is invalid: {fix}")
