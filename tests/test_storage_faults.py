"""Storage that fails: transient errors retried with backoff, others named; a full disk skips a checkpoint.

``retrying`` is checked on scripted failures. The full disk is real: a 24 MiB tmpfs mounted for the
test (skipped where mounting is not allowed), filled until a checkpoint write fails. The flaky S3
and MLflow servers are in ``tests/integration/test_flaky_services.py``.

    .venv/bin/python -m pytest -q tests/test_storage_faults.py
"""

from __future__ import annotations

import errno
import logging
import subprocess
from pathlib import Path

import pytest
import torch

from grpo_core.checkpoint import CheckpointError, StorageError, verify_local
from grpo_core import retry as retry_module  # the retry policy's clock and sleep
from grpo_core.storage.retry import is_transient, retrying
from tests.test_checkpoint import make_trainer, model_path, params, start, step, train_rows  # noqa: F401 - fixtures


@pytest.fixture
def no_sleep(monkeypatch):
    monkeypatch.setattr(retry_module.time, "sleep", lambda s: None)


def failing(errors: list[BaseException], result: str = "done"):
    calls = []

    def call() -> str:
        calls.append(1)
        if errors:
            raise errors.pop(0)
        return result

    return call, calls


def test_transient_failures_are_retried_until_they_pass(no_sleep):
    from botocore.exceptions import EndpointConnectionError

    call, calls = failing([OSError(errno.EBUSY, "Please reduce your request rate."),
                           EndpointConnectionError(endpoint_url="http://s3"), TimeoutError("read timed out")])
    assert retrying("writing", "s3://b/x", call, local=False, timeout_s=60) == "done"
    assert len(calls) == 4


def test_a_failure_that_cannot_pass_names_operation_and_place(no_sleep):
    call, calls = failing([PermissionError(errno.EACCES, "Access Denied")])
    with pytest.raises(StorageError, match=r"^.*writing s3://b/ledger/x.json failed: PermissionError: .*Access Denied"):
        retrying("writing", "s3://b/ledger/x.json", call, local=False)
    assert len(calls) == 1
    call, _ = failing([FileNotFoundError("gone")])
    with pytest.raises(FileNotFoundError):  # callers ask with it: passed through as it is
        retrying("reading", "s3://b/x", call, local=False)


def test_transient_failures_give_up_after_the_window(monkeypatch):
    clock = iter(range(0, 10_000, 7))
    monkeypatch.setattr(retry_module.time, "monotonic", lambda: float(next(clock)))
    monkeypatch.setattr(retry_module.time, "sleep", lambda s: None)
    call, calls = failing([OSError(errno.EBUSY, "SlowDown")] * 100)
    with pytest.raises(StorageError, match=r"uploading to s3://b/c failed \d+ times over \d+ s \(retried for up to 30 s\)"):
        retrying("uploading to", "s3://b/c", call, local=False, timeout_s=30)
    assert 2 < len(calls) < 10


def test_local_disk_errors_are_not_retried():
    assert not is_transient(OSError(errno.ENOSPC, "No space left on device"), local=True)
    assert not is_transient(OSError(errno.EIO, "Input/output error"), local=True)
    assert is_transient(OSError(errno.EIO, "S3 error"), local=False)
    assert not is_transient(OSError(errno.ENOSPC, "No space left on device"), local=False)


# ------------------------------------------------------------------------------------------ a full disk
@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path, leave_bytes: int) -> Path:
    """Fill ``disk`` until ``leave_bytes`` are free."""
    import shutil

    filler = disk / "filler"
    with open(filler, "wb") as f:
        while (free := shutil.disk_usage(disk).free) > leave_bytes:
            f.write(b"\0" * min(1 << 20, free - leave_bytes))
            f.flush()
    return filler


def test_full_disk_skips_the_checkpoint_and_keeps_the_last_good_one(model_path, train_rows, small_disk, caplog):
    out = small_disk / "run"
    trainer = make_trainer(model_path, train_rows, out, max_steps=4)
    start(trainer)
    step(trainer, 1)
    assert "checkpoint/failed" not in trainer.checkpointer.save()
    good = params(trainer)
    size = sum(p.stat().st_size for p in (out / "checkpoint-1").iterdir())

    step(trainer, 2)
    filler = fill(small_disk, leave_bytes=size // 3)
    with caplog.at_level(logging.ERROR):
        metrics = trainer.checkpointer.save()
    assert metrics["checkpoint/failed"] == 1.0
    message = next(r.getMessage() for r in caplog.records if "checkpoint-2 could not be written" in r.getMessage())
    assert f"to {out / 'checkpoint-2'}" in message and "MiB free" in message, message
    assert "training goes on" in message
    assert not (out / "checkpoint-2").exists()  # removed: it held no manifest and took the space
    assert verify_local(out / "checkpoint-1") is None  # the last good checkpoint is untouched

    filler.unlink()
    step(trainer, 3)
    assert "checkpoint/failed" not in trainer.checkpointer.save()  # space again: the next save works

    # The checkpoint after the last step is not skipped: the run must not end without it.
    step(trainer, 4)
    fill(small_disk, leave_bytes=size // 3)
    with pytest.raises(CheckpointError, match=r"checkpoint-4 could not be written .* it was the checkpoint of the last step"):
        trainer.checkpointer.save()

    # A new trainer resumes from the newest good checkpoint, which holds what was saved.
    (small_disk / "filler").unlink()
    resumed = make_trainer(model_path, train_rows, out, max_steps=4, resume_from_checkpoint=True)
    start(resumed)
    assert resumed.global_step == 3
    fresh = make_trainer(model_path, train_rows, small_disk / "other", max_steps=4, resume_from_checkpoint=str(out / "checkpoint-1"))
    start(fresh)
    assert all(torch.equal(fresh.model.state_dict()[k], v) for k, v in good.items())


def test_storage_reads_the_endpoint_when_it_is_made(monkeypatch) -> None:
    # fsspec's instance cache would hand a second Storage the client made for the first endpoint (a
    # long-lived process that reaches two stores, or the test suite's two S3 servers).
    from grpo_core.checkpoint import Storage

    for key, value in {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    endpoints = []
    for port in (1, 2):
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        storage = Storage("s3://bucket/run")
        storage.fs.connect()  # builds the client; no request is sent
        endpoints.append(storage.fs.s3.meta.endpoint_url)
    assert endpoints == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
