"""Console progress of a training job: a spinner per long stage, and training progress read from MLflow.

    with stage("starting vLLM server"):          spinner on a terminal; one line when done, anywhere
        ...
    with TrainingProgress(tracking_uri, run_id, total_steps=120):
        ...                                      prints a bar line per new step (at most every few s)

The trainer runs in child processes or pods whose output is copied line by line to the flow's
console, so a live (redrawn) bar would be torn apart by those lines. Instead a thread reads the
run's latest metrics from MLflow (never a metric's whole history, which grows with the run), the same way on a laptop and on a cluster, and prints one static line
with a bar, step, reward, tokens/s and ETA when something changed, plus a line per checkpoint.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from rich.console import Console
from rich.progress_bar import ProgressBar
from rich.table import Table

log = logging.getLogger(__name__)
console = Console(highlight=False)


@contextmanager
def stage(description: str) -> Iterator[None]:
    """A spinner while ``description`` runs (on a terminal), then ``✓ description (N s)``."""
    start = time.monotonic()
    if console.is_terminal:
        with console.status(f"{description} ..."):
            yield
    else:
        console.print(f"{description} ...")
        yield
    console.print(f"[green]✓[/green] {description} ({time.monotonic() - start:.0f} s)")


def latest_metric(run, key: str):  # noqa: ANN001, ANN201 - an MLflow Run and Metric
    """``key``'s latest value of ``run`` with its step (the one at the highest step), or None: read from the run
    itself, which holds each metric's latest value, so a poll costs the same at step 10 and at step 10,000 (the
    metric's history grows with the run). MLflow's ``RunData`` keeps the step only on its metric objects."""
    return next((m for m in getattr(run.data, "_metric_objs", []) if m.key == key), None)


class TrainingProgress:
    """Polls an MLflow run while training runs and prints progress lines (see the module docstring)."""

    def __init__(self, tracking_uri: str, run_id: str, total_steps: int, interval_s: float = 5.0,
                 on_step: Callable[[int, int], None] | None = None, print_steps: bool = True):
        self.tracking_uri = tracking_uri
        # False where the trainer's own step lines reach this console (a local run): one line per step, not two.
        self.print_steps = print_steps
        self.on_step = on_step  # told (step, total) at each new step, e.g. to move a Prefect progress artifact
        self.run_id = run_id
        self.total_steps = total_steps
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="training-progress", daemon=True)
        self._last_step = -1
        self._checkpoints: set[tuple[str, str]] = set()
        self._start = time.monotonic()
        self._first_step_at: tuple[float, int] | None = None

    def __enter__(self) -> "TrainingProgress":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.poll()  # the last steps and the final checkpoint land right before the trainer exits

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - progress display must never fail a run
                log.debug("progress poll failed", exc_info=True)

    def poll(self) -> None:
        import mlflow

        client = mlflow.MlflowClient(self.tracking_uri)
        run = client.get_run(self.run_id)
        for key, uri in sorted(run.data.tags.items()):
            # The trainer re-points one tag per kind (artifact.checkpoint) at each save: a new value is news.
            if key.startswith("artifact.") and (key, uri) not in self._checkpoints:
                self._checkpoints.add((key, uri))
                console.print(f"[cyan]checkpoint written[/cyan] {uri}")
        latest = latest_metric(run, "reward")
        if latest is None:
            return
        if latest.step == self._last_step:
            return
        self._last_step = latest.step
        if self.print_steps:
            console.print(self.line(latest.step, latest.value, run.data.metrics.get("rollout/generated_tok_s")))
        if self.on_step is not None:
            self.on_step(latest.step, self.total_steps)

    def line(self, step: int, reward: float, tokens_per_s: float | None) -> Table:
        """One row: bar, step/total, reward, tokens/s, ETA from the pace since the first logged step."""
        now = time.monotonic()
        if self._first_step_at is None:
            self._first_step_at = (now, step)
        t0, s0 = self._first_step_at
        eta = "?"
        if step > s0 and self.total_steps > 0:
            minutes, seconds = divmod(round((now - t0) / (step - s0) * max(0, self.total_steps - step)), 60)
            eta = f"{minutes}m{seconds:02d}s"
        row = Table.grid(padding=(0, 2))
        row.add_row(
            ProgressBar(total=max(1, self.total_steps), completed=min(step, self.total_steps), width=30),
            f"step {step}/{self.total_steps}",
            f"reward {reward:.3f}",
            f"{tokens_per_s:,.0f} tok/s" if tokens_per_s is not None else "- tok/s",
            f"eta {eta}",
        )
        return row
