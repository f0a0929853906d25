"""Every name the project's Python uses is defined: pyflakes over the library, the flows, the benchmarks, the scripts
and the tests.

Much of the benchmarks' code runs on a GPU only (profiles, kernel variants, several ranks), so no CPU test reaches
it, and a name left undefined there fails on the device machine, after minutes of set-up. A static pass finds those
here, in seconds."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("grpo_core", "flows", "benchmarks", "scripts", "tests")


def undefined_names(paths: list[Path]) -> list[str]:
    """pyflakes' undefined-name findings in ``paths`` (files or folders), as ``path:line: message``."""
    from pyflakes import api, messages, reporter

    kinds = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)
    found: list[str] = []

    class Collect(reporter.Reporter):
        def __init__(self) -> None:
            super().__init__(None, None)

        def flake(self, message) -> None:
            if isinstance(message, kinds):
                found.append(f"{message.filename}:{message.lineno}: {message.message % message.message_args}")

        def syntaxError(self, filename, msg, lineno, offset, text) -> None:  # noqa: N802 - pyflakes' interface
            found.append(f"{filename}:{lineno}: syntax error: {msg}")

        def unexpectedError(self, filename, msg) -> None:  # noqa: N802 - pyflakes' interface
            found.append(f"{filename}: {msg}")

    collect = Collect()
    for path in paths:
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for file in files:
            api.checkPath(str(file), collect)
    return found


def test_the_project_uses_no_undefined_name() -> None:
    missing = undefined_names([ROOT / name for name in CHECKED if (ROOT / name).exists()])
    assert not missing, "names used but never defined (import them, or fix the spelling):\n" + "\n".join(missing)


@pytest.mark.parametrize("source, expected", [
    ("def profile(step):\n    return profiling.profile_call(step)\n", "undefined name 'profiling'"),
    ("import contextlib\nwith contextlib.nullcontext():\n    pass\n", None),
])
def test_the_check_finds_a_name_that_was_never_imported(tmp_path: Path, source: str, expected: str | None) -> None:
    """The check itself: a function body that uses a module it never imported (found), and one that imports it."""
    file = tmp_path / "bench.py"
    file.write_text(source)
    found = undefined_names([file])
    assert (found == []) if expected is None else (len(found) == 1 and expected in found[0])
