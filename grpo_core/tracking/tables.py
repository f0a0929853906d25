"""Tables a run logs step by step (its completions), laid out so that MLflow's UI shows them as tables at a cost per
logged step that does not grow with the run.

MLflow's UI offers "View as table" for an artifact, and lists it under the runs page's "Artifact evaluation", only
when the run's tag ``mlflow.loggedArtifacts`` names its path with the type ``table`` (what ``mlflow.log_table`` writes;
read from the UI's bundled JavaScript, 3.17, and checked in Chromium by ``tests/test_mlflow_browser.py``).
A tag holds at most 8,000 characters, about 120 such paths. So a run's rows go into as many files as the tag can
name, each covering a block of consecutive steps (``table_block``: one logged step per file when the run is short
enough), and the tag names each file once, when its block starts.

A block's file is written again at each of its logged steps from the rows this process holds (never read back from
the store), so the table is current while the run trains and a step costs at most one block's rows. A resumed run
reads the file of the block it resumes in once, keeping the rows of the steps before the one it starts at.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

LOGGED_ARTIFACTS_TAG = "mlflow.loggedArtifacts"
"""The run tag naming the artifacts MLflow's UI shows as tables (``[{"path": ..., "type": "table"}, ...]``)."""
TAG_VALUE_LIMIT = 8000
"""MLflow's limit on a tag's value, in characters (longer values are refused or cut)."""
def _files_named(name: str, block: tuple[int, int]) -> int:
    """How many files with paths as long as ``block``'s a ``mlflow.loggedArtifacts`` tag can name."""
    entry = len(json.dumps({"path": block_path(name, block), "type": "table"}, separators=(",", ":")))
    return (TAG_VALUE_LIMIT - 1) // (entry + 1)  # entries and the commas between them, in brackets


def steps_per_file(name: str, max_steps: int, logging_steps: int) -> int:
    """Logged steps per file of table ``name`` in a run of ``max_steps`` that logs every ``logging_steps``: one where
    the tag can name a file per logged step (the demo's 120 steps), else the fewest that let it name every block's
    file (119 blocks of ``completions``). A run bounded by epochs instead (``max_steps`` <= 0) has one logged step per
    file, and the tag names the files that fit (``with_table``)."""
    logged = math.ceil(max_steps / logging_steps) if max_steps > 0 else 0
    if logged <= _files_named(name, (max_steps, max_steps)):
        return 1
    return math.ceil(logged / _files_named(name, (max_steps, max_steps + 1)))  # the longest block path of the run


def table_block(name: str, step: int, max_steps: int, logging_steps: int) -> tuple[int, int]:
    """The first and last step of the block of table ``name`` that ``step`` falls in: ``steps_per_file`` logged steps
    from step 1 on (the last block's span may pass ``max_steps``: its file is named like the others); ``(step, step)``
    where a file holds one logged step."""
    per_file = steps_per_file(name, max_steps, logging_steps)
    if per_file == 1:
        return step, step
    span = per_file * logging_steps
    first = (step - 1) // span * span + 1
    return first, first + span - 1


def block_path(name: str, block: tuple[int, int]) -> str:
    """The artifact path of a block's file: ``<name>/step-<step>.json`` for a block of one step, else
    ``<name>/steps-<first>-<last>.json``; zero-padded, so that files sort by step."""
    first, last = block
    return f"{name}/step-{first:08d}.json" if first == last else f"{name}/steps-{first:08d}-{last:08d}.json"


def table_text(columns: dict[str, list[Any]]) -> str:
    """Columns (names to equally long lists) in the layout of MLflow's tables, ``{"columns": [...], "data": [[...],
    ...]}``: what ``MlflowClient.load_table`` and ``pandas.read_json(orient="split")`` read."""
    names = list(columns)
    rows = [list(row) for row in zip(*(columns[c] for c in names), strict=True)]
    return json.dumps({"columns": names, "data": rows}, default=str)


def listed_tables(tag_value: str | None) -> list[dict[str, str]]:
    """The entries of a ``mlflow.loggedArtifacts`` tag (empty for none, or for a value that is not a JSON list)."""
    try:
        entries = json.loads(tag_value) if tag_value else []
    except ValueError:
        return []
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []


def with_table(tag_value: str | None, path: str) -> str | None:
    """The tag's value with ``path`` listed as a table, or None when it is listed already or would not fit
    (``TAG_VALUE_LIMIT``)."""
    entries = listed_tables(tag_value)
    entry = {"path": path, "type": "table"}
    if entry in entries:
        return None
    value = json.dumps([*entries, entry], separators=(",", ":"))
    return value if len(value) <= TAG_VALUE_LIMIT else None


@dataclass
class BlockRows:
    """The rows of one table's current block, which this process writes again at each logged step of the block."""

    block: tuple[int, int]
    columns: dict[str, list[Any]] = field(default_factory=dict)

    def count(self) -> int:
        return len(next(iter(self.columns.values()), []))

    def add(self, columns: dict[str, list[Any]]) -> None:
        """Append a step's rows; a column that one side lacks is None in the other's rows."""
        before, added = self.count(), len(next(iter(columns.values()), []))
        for name in columns:
            self.columns.setdefault(name, [None] * before)
        for name, values in self.columns.items():
            values.extend(columns.get(name, [None] * added))

    def keep_before(self, step: int) -> None:
        """Drop the rows of ``step`` and after (a resumed run logs those steps again)."""
        keep = [i for i, s in enumerate(self.columns.get("step", [])) if s is not None and int(s) < step]
        self.columns = {name: [values[i] for i in keep] for name, values in self.columns.items()}


def rows_of(text: str) -> dict[str, list[Any]]:
    """A table file's text (``table_text``) back as columns."""
    table = json.loads(text)
    names = table["columns"]
    return {name: [row[i] for row in table["data"]] for i, name in enumerate(names)}


def read_table(client: Any, run_id: str, name: str) -> Any:
    """The table ``name`` of run ``run_id`` (``MLflowTracker.log_table``: a file per block of steps) as one
    ``pandas.DataFrame`` in step order; empty when the run logged none."""
    import tempfile

    import pandas

    files = sorted(a.path for a in client.list_artifacts(run_id, name) if a.path.endswith(".json"))
    with tempfile.TemporaryDirectory(prefix="grpo-table-") as tmp:
        parts = [pandas.read_json(client.download_artifacts(run_id, path, tmp), orient="split") for path in files]
    if not parts:
        return pandas.DataFrame()
    table = pandas.concat(parts, ignore_index=True)
    return table.sort_values("step", kind="stable", ignore_index=True) if "step" in table else table
