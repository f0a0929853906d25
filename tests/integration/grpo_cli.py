"""``grpo train JOB`` (``python -m flows.cli train``) run as a user runs it, by the tests that train from a job file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def grpo_train(job: Path, out: Path, server_url: str, env: dict[str, str], tracking_uri: str
               ) -> subprocess.CompletedProcess[str]:
    """Train ``job`` into ``out`` against the test's server and tracking store; fails the test naming the output
    when the command fails."""
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "train", str(job), "--output-dir", str(out), "--server-url", server_url],
        cwd=REPO, env={**env, "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": tracking_uri}, capture_output=True,
        text=True, timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done
