"""``release_free_heap`` gives freed heap pages back: the resident size drops by what was freed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from grpo_core.training.host_memory import release_free_heap


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and needs glibc's malloc_trim")
def test_freed_heap_pages_leave_the_resident_set():
    # 64 KiB blocks come from the heap (below malloc's mmap threshold); keeping every 16th alive pins
    # the heap's top, so only a trim (not the heap shrinking from its end) can return the rest.
    blocks = [bytearray(64 * 1024) for _ in range(3200)]  # 200 MiB, written (zeroed) so resident
    kept = blocks[::16]
    del blocks
    before = rss_mib()
    assert release_free_heap() is True
    after = rss_mib()
    assert before - after > 100, (before, after)
    assert len(kept) == 200
