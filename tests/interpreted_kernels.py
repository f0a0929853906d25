"""Running the project's Triton kernels in tests: on a GPU where this session has one, else on the CPU under
Triton's interpreter, in a child process with Triton from ``.triton-interpreter/`` (``scripts/triton_interpreter.sh``,
which ``scripts/test.sh`` runs; the project environment's lock leaves Triton out). A kernel test file marks its
kernel tests ``needs_kernels`` and adds one test that calls ``run_under_interpreter(__file__, ...)``: where the
kernels cannot run in this process, that test runs them in the child, where none may be skipped."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

INTERPRETER_SITE = Path(__file__).resolve().parents[1] / ".triton-interpreter"


def kernel_device() -> str | None:
    """Where the Triton kernels can run here: CUDA, or the CPU under Triton's interpreter."""
    if importlib.util.find_spec("triton") is None:
        return None
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None


needs_kernels = pytest.mark.skipif(kernel_device() is None, reason="needs Triton and CUDA, or Triton's interpreter "
                                                                   "(TRITON_INTERPRET=1) on the CPU; without them, "
                                                                   "the file's test named under_the_interpreter runs "
                                                                   "them in a child process")

in_a_child_where_no_kernels = pytest.mark.skipif(kernel_device() is not None,
                                                 reason="this session runs the kernel tests itself")


def run_under_interpreter(test_file: str, min_passed: int) -> None:
    """``test_file``'s tests but the ones named ``under_the_interpreter``, in a child process under the interpreter:
    all must run (none skipped), pass, and number at least ``min_passed``."""
    if not (INTERPRETER_SITE / "triton").is_dir():
        pytest.fail(f"no Triton in {INTERPRETER_SITE}: run `bash scripts/triton_interpreter.sh` (scripts/test.sh does)")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(INTERPRETER_SITE), os.environ.get("PYTHONPATH")) if p)}
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", test_file,
         "-k", "not under_the_interpreter"],
        env=env, cwd=INTERPRETER_SITE.parent, capture_output=True, text=True, timeout=900)
    tail = child.stdout[-4000:] + child.stderr[-2000:]
    assert child.returncode == 0, tail
    counts = dict((kind, int(n)) for n, kind in re.findall(r"(\d+) (passed|skipped|failed|deselected)", tail))
    assert counts.get("skipped", 0) == 0 and counts.get("passed", 0) >= min_passed, counts
