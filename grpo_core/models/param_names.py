"""Parameter names as a saved (Hugging Face) checkpoint knows them, whatever wraps the module.

Wrappers change parameter names: activation checkpointing inserts ``_checkpoint_wrapped_module``,
torch.compile ``_orig_mod``, FSDP ``_fsdp_wrapped_module``. A server's ``load_weights`` and a frozen
tower's prefixes (``vision.py``) speak the checkpoint's names, so both normalise through here.
"""

from __future__ import annotations

_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def checkpoint_name(name: str) -> str:
    """The Hugging Face checkpoint name of a (possibly wrapped) parameter."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name
