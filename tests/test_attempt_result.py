"""A training attempt's result file: what a failed attempt tells the flow (``grpo_core.launch``)."""

from __future__ import annotations

from grpo_core.launch import AttemptFailure, attempt_failure, write_failure
from grpo_core.training.collector import NoLearningSignalError


def test_a_failed_attempt_names_its_error_and_whether_a_resume_can_help(tmp_path):
    result = tmp_path / "result.json"
    assert attempt_failure(result) is None  # a process killed from outside writes nothing
    write_failure(str(result), 19, RuntimeError("the server at http://x does not serve version 19"), resumable=True)
    assert attempt_failure(result) == AttemptFailure(
        "training stopped at step 19: RuntimeError: the server at http://x does not serve version 19", resumable=True)
    write_failure(str(result), 3, NoLearningSignalError("every group scored one reward"), resumable=False)
    failure = attempt_failure(result)
    assert failure.why == "training stopped at step 3: NoLearningSignalError: every group scored one reward"
    assert not failure.resumable


def test_a_finished_or_unreadable_result_is_no_failure(tmp_path):
    finished = tmp_path / "finished.json"
    finished.write_text('{"global_step": 120, "history": []}')
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert attempt_failure(finished) is None and attempt_failure(broken) is None
