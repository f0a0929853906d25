"""A checksum of a tensor's bytes that both ends of a weight sync compute the same way, on any device.

``tensor_digest`` reads the tensor's bytes as unsigned 16-bit words w_i and sums w_i·r_i in int64
for two sets of odd weights r_i < 2^16 drawn from the word's position i; the two sums, each taken
mod 2^64, are the 128-bit digest (32 hex digits). Why this and not a cryptographic hash:

* it runs where the weights are (the trainer's GPU buckets, the server's host copy) as a few
  element-wise ops and one reduction, with no copy to the host and no byte-serial loop;
* a product is below 2^32, so a chunk of up to 2^31 words sums without overflow, and integer sums
  do not depend on the reduction order: every device, chunking and thread count gives the same digest;
* any change of one 16-bit word changes each sum by Δ·r with 0 < |Δ·r| < 2^32: it is always seen.
  Several changed words cancel only if both weighted sums of their differences are 0 mod 2^64.

It guards against stale, partial and corrupted weights, not against someone forging a patch (the
storage checksum of a patch file is SHA-256).
"""

from __future__ import annotations

import torch

_CHUNK_WORDS = 1 << 22
"""Words per reduction: bounds the int64 temporaries at 32 MiB whatever the tensor's size."""
_MULTIPLIERS = (0x9E3779B1, 0x85EBCA77)
"""Two odd 32-bit constants (golden-ratio and murmur3 mixing): (i mod 2^31)·c < 2^63, so no overflow."""
_MASK64 = (1 << 64) - 1


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat int16 view (a trailing odd byte is widened to a word of its own)."""
    flat = tensor.detach().contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    if raw.numel() % 2:
        raw = torch.cat([raw, raw.new_zeros(1)])
    return raw.view(torch.int16)


def tensor_digest(tensor: torch.Tensor) -> str:
    """32 hex digits: the two position-weighted word sums of ``tensor``'s bytes (see the module doc)."""
    words = _words(tensor)
    sums = [0, 0]
    for start in range(0, words.numel(), _CHUNK_WORDS):
        chunk = words[start : start + _CHUNK_WORDS].to(torch.int64) & 0xFFFF
        position = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=chunk.device) & 0x7FFFFFFF
        for k, multiplier in enumerate(_MULTIPLIERS):
            weight = (((position * multiplier) >> 16) & 0xFFFF) | 1
            sums[k] = (sums[k] + int((chunk * weight).sum())) & _MASK64
    return f"{sums[0]:016x}{sums[1]:016x}"


def digests(named: dict[str, torch.Tensor]) -> dict[str, str]:
    """``tensor_digest`` of every tensor, by name."""
    return {name: tensor_digest(t) for name, t in named.items()}
