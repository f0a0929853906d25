"""What the code's and the docs' text points at exists, and docstrings link benchmark figures instead of copying them.

Figures live in ``benchmarks/README.md``, written by the scripts that measure them; a docstring that
quotes one drifts from it at the next run. A file or README section named in a docstring or comment that
has been moved or renamed sends the reader nowhere. The README is an entry page whose sections continue in
``docs/*.md``, so a README section named in the code may be a heading of one of those pages. The README and
the pages under ``docs/`` are checked too: the files they name exist, their links resolve, and a section
they name beside a link is a heading of the linked page.

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


DOC_PAGES = sorted([REPO / "README.md", *REPO.glob("docs/*.md")])
# A relative markdown link: [text](target) or ![alt](target), optionally with a #section.
MD_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# A section named beside a link to its page: [page.md](page.md), "Section title".
LINKED_SECTION = re.compile(r"\]\(([^)#\s]+\.md)\),? \"([^\"]+)\"")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def page_headings(path: Path) -> list[str]:
    """The markdown headings of ``path``, without their ``#`` marks (code blocks left out)."""
    return [line.lstrip("#").strip() for line in FENCE.sub("", path.read_text()).splitlines() if line.startswith("#")]


def headings() -> list[str]:
    return [title for path in [REPO / "README.md", REPO / "benchmarks/README.md", *REPO.glob("docs/*.md")]
            for title in page_headings(path)]


def anchor(title: str) -> str:
    """The fragment a markdown renderer gives a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


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


@pytest.mark.parametrize("path", DOC_PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_doc_pages_name_and_link_what_exists(path: Path) -> None:
    text = path.read_text()
    missing = [ref for ref in FILE_REF.findall(text)
               if not (REPO / ref).exists() and "/results/" not in ref and "NAME" not in ref]
    for target in MD_LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto: point outside the repository
            continue
        file, _, fragment = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            missing.append(f"link {target}")
        elif fragment and linked.suffix == ".md" and fragment not in map(anchor, page_headings(linked)):
            missing.append(f"link {target} (no such section)")
    for file, title in LINKED_SECTION.findall(flat(text)):
        linked = (path.parent / file).resolve()
        if linked.exists() and not any(h.startswith(title) for h in page_headings(linked)):
            missing.append(f"section {title!r} of {file}")
    assert not missing, f"{path.relative_to(REPO)} names or links what does not exist: {missing}"


def test_every_doc_page_is_reachable_from_the_readme() -> None:
    """A page under docs/ that no page links is one no reader finds."""
    linked = {(page.parent / target.partition("#")[0]).resolve()
              for page in DOC_PAGES for target in MD_LINK.findall(page.read_text()) if not re.match(r"[a-z]+:", target)}
    readme_links = {(REPO / target.partition("#")[0]).resolve() for target in MD_LINK.findall((REPO / "README.md").read_text())}
    orphans = [str(page.relative_to(REPO)) for page in REPO.glob("docs/*.md") if page.resolve() not in linked]
    assert not orphans, f"docs pages no page links to: {orphans}"
    assert any(p.parent == REPO / "docs" for p in readme_links), "the README links no page under docs/"


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


@pytest.mark.parametrize("page", ["DESIGN.md", "docs/layout.md"])
def test_the_structure_pages_have_no_table_cell_over_300_characters(page: str) -> None:
    """A newcomer reads these two pages in minutes: a table cell stays a sentence or two (a longer one is split into
    rows of its own)."""
    long = []
    for number, line in enumerate((REPO / page).read_text().splitlines(), 1):
        if line.startswith("|"):
            long += [f"{page}:{number}: {len(cell)} characters" for cell in line.strip().strip("|").split("|")
                     if len(cell.strip()) > 300]
    assert not long, long
