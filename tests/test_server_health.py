"""The fleet's rule for taking a server out of service (``grpo_core.vllm_server.health``): refused at once; silent or
stalled only once that has lasted the window; slow but answering or progressing, never. What "out" does depends only
on whether another server serves."""

from __future__ import annotations

import pytest

from grpo_core.vllm_server.health import ServerHealth, Verdict, action


def test_a_server_never_asked_or_answering_is_ok():
    health = ServerHealth(drain_after_s=10.0)
    assert health.verdict(0.0) == Verdict("ok")
    health.answered(5.0, progress=100.0, busy=True)
    assert health.verdict(1000.0).standing == "ok"  # nothing known against it since its answer


def test_a_refused_connection_is_out_at_once_and_an_answer_clears_it():
    health = ServerHealth(drain_after_s=10.0)
    health.answered(0.0)
    health.failed(1.0, refused="ConnectError: [Errno 111] Connection refused")
    verdict = health.verdict(1.0)
    assert verdict.standing == "out" and "refused" in verdict.reason and verdict.since == 1.0
    health.answered(2.0)
    assert health.verdict(2.0).standing == "ok"


def test_timeouts_make_a_server_suspect_until_they_have_lasted_the_window():
    health = ServerHealth(drain_after_s=10.0)
    health.answered(0.0)
    health.failed(3.0)  # the first unanswered call was sent at 3 s
    health.failed(8.0)  # later failures do not move the start
    suspect = health.verdict(12.9)
    assert suspect.standing == "suspect" and suspect.since == 3.0 and suspect.deadline == 13.0
    out = health.verdict(13.0)
    assert out.standing == "out" and "not answered for 10 s" in out.reason and "server_drain_after_s=10" in out.reason


def test_an_answer_within_the_window_keeps_the_server_and_restarts_the_count():
    health = ServerHealth(drain_after_s=10.0)
    health.failed(0.0)
    health.answered(9.0)
    health.failed(12.0)
    assert health.verdict(21.0).standing == "suspect"  # 9 s since its first unanswered call after the answer
    assert health.verdict(22.0).standing == "out"


def test_requests_that_stop_making_progress_are_out_after_the_window():
    health = ServerHealth(drain_after_s=10.0)
    health.answered(0.0, progress=500.0, busy=True)
    health.answered(4.0, progress=500.0, busy=True)
    assert health.verdict(4.0) == Verdict("suspect", "its requests made no progress for 4 s", 0.0, 10.0)
    health.answered(10.0, progress=500.0, busy=True)
    out = health.verdict(10.0)
    assert out.standing == "out" and "no progress for 10 s" in out.reason and "500" in out.reason


def test_a_server_back_from_a_silence_gets_a_whole_window_to_move_again():
    health = ServerHealth(drain_after_s=10.0)
    health.answered(0.0, progress=500.0, busy=True)
    health.failed(2.0)  # frozen from 2 s to 9 s: shorter than the window
    health.answered(9.0, progress=500.0, busy=True)  # its first answer shows the counters where the freeze left them
    assert health.verdict(9.0).standing == "ok"
    health.answered(18.9, progress=500.0, busy=True)
    assert health.verdict(18.9).standing == "suspect"
    assert health.verdict(19.0).standing == "out"  # still standing a window after it came back: stalled


@pytest.mark.parametrize("moved, busy, paused", [(True, True, False), (False, False, False), (False, True, True)])
def test_slow_but_moving_idle_or_paused_for_a_push_is_no_stall(moved, busy, paused):
    health = ServerHealth(drain_after_s=10.0)
    health.answered(0.0, progress=500.0, busy=True)
    health.answered(30.0, progress=501.0 if moved else 500.0, busy=busy, paused=paused)
    assert health.verdict(30.0).standing == "ok"


def test_a_scrape_without_counters_says_nothing_of_progress():
    health = ServerHealth(drain_after_s=10.0)
    health.answered(0.0, progress=None, busy=True)
    health.answered(60.0, progress=None, busy=True)
    assert health.verdict(60.0).standing == "ok"


@pytest.mark.parametrize("standing, others, expected", [
    ("ok", True, "keep"), ("suspect", True, "keep"), ("suspect", False, "keep"),
    ("out", True, "drain"), ("out", False, "wait"),
])
def test_out_drains_while_another_serves_and_waits_as_the_last(standing, others, expected):
    assert action(Verdict(standing, "", 0.0), others_serving=others) == expected


def test_a_window_that_is_not_positive_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="server_drain_after_s"):
        ServerHealth(drain_after_s=0.0)
