"""What the code's text points at exists, and docstrings link benchmark figures instead of copying them.

Figures live in ``benchmarks/README.md``, written by the scripts that measure them; a docstring that
quotes one drifts from it at the next run. A file or README section named in a docstring or comment that
has been moved or renamed sends the reader nowhere.

    .venv/bin/python -m pytest -q tests/test_doc_references.py
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CODE = sorted([*REPO.glob("grpo_core/**/*.py"), *REPO.glob("flows/*.py"), *REPO.glob("benchmarks/**/*.py"),
               *REPO.glob("tests/**/*.py")])
FILE_REF = re.compile(r"\b(?:grpo_core|flows|tests|benchmarks|examples|infra|scripts|notebooks)/[\w/.-]*\w\.(?:py|md|yaml|sh|ipynb)\b")
SECTION_REF = re.compile(r"README(?:\.md)?,? \"([^\"]+)\"")
# A measured figure: a share, a time, a bandwidth or a speed ratio ...
FIGURE = re.compile(r"\d(?:\.\d+)?\s?(?:%|ms\b|TB/s|GB/s|[x×]\s+(?:faster|slower|the)\b)")
# ... said to be measured, or measured on a named device.
MEASURED = re.compile(r"\b(?:H100|H200|A100|B200|measured|benchmark)", re.I)
LINK = re.compile(r"\"[^\"]*\"|``[^`]*``|\S+/\S+")


def flat(text: str) -> str:
    """Lines joined as prose: comment markers and indentation dropped."""
    return " ".join(re.sub(r"^\s*#\s?", "", line).strip() for line in text.splitlines())


def headings() -> list[str]:
    return [line.lstrip("#").strip() for name in ("README.md", "benchmarks/README.md")
            for line in (REPO / name).read_text().splitlines() if line.startswith("#")]


@pytest.mark.parametrize("path", CODE, ids=lambda p: str(p.relative_to(REPO)))
def test_named_files_and_sections_exist(path: Path) -> None:
    text = path.read_text()
    missing = [ref for ref in FILE_REF.findall(text)
               if not (REPO / ref).exists() and "/results/" not in ref and "NAME" not in ref]
    titles = headings()
    missing += [f"README section {title!r}" for title in SECTION_REF.findall(flat(text))
                if not any(heading.startswith(title) for heading in titles)]
    # Notes kept outside the repository are no reference for a reader of the code.
    missing += [f"the {name}" for name in ("fact sheet",) if name in flat(text).replace(f'"{name}"', "")]
    assert not missing, f"{path.relative_to(REPO)} names what does not exist: {missing}"


def docstrings(tree: ast.AST):
    """Module, class and function docstrings, and the string that documents an attribute or constant."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                yield node, doc
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for before, after in zip(body, body[1:]):
                if isinstance(before, (ast.Assign, ast.AnnAssign)) and isinstance(after, ast.Expr) \
                        and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                    yield after, after.value.value


@pytest.mark.parametrize("path", sorted(REPO.glob("grpo_core/**/*.py")), ids=lambda p: str(p.relative_to(REPO)))
def test_docstrings_link_benchmark_figures_instead_of_quoting_them(path: Path) -> None:
    quoted = []
    for node, doc in docstrings(ast.parse(path.read_text())):
        for paragraph in re.split(r"\n\s*\n", doc):
            text = LINK.sub("", flat(paragraph))  # what a link names is no figure
            if FIGURE.search(text) and MEASURED.search(text):
                quoted.append(f"line {getattr(node, 'lineno', '?')}: {text[:160]}")
    assert not quoted, f"{path.relative_to(REPO)} quotes figures; link benchmarks/README.md instead:\n" + "\n".join(quoted)
