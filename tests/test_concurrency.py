"""Adaptive concurrency cap: the metrics parser and the controller driven by scripted /metrics traces."""

from __future__ import annotations

import math

import pytest

from grpo_core.rollout.concurrency import (
    ConcurrencyController,
    VllmMetrics,
    initial_cap_from_server,
    parse_prometheus_text,
    parse_vllm_metrics,
)

# A /metrics page shaped like vLLM 0.32's (its metric names and labels), trimmed to a few
# families plus the kinds of lines a parser must skip: HELP/TYPE comments, histograms, _created series.
RECORDED_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
# HELP vllm:num_requests_waiting_by_reason Number of requests waiting, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="deferred"} 0.0
# HELP vllm:engine_sleep_state Engine sleep state
# TYPE vllm:engine_sleep_state gauge
vllm:engine_sleep_state{engine="0",model_name="tiny",sleep_state="awake"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.4375
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="tiny"} 4.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 12800.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 9600.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 12800.0
vllm:prompt_tokens_created{engine="0",model_name="tiny"} 1.7e+09
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="tiny"} 61440.0
vllm:generation_tokens_created{engine="0",model_name="tiny"} 1.7e+09
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 200.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 56.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="tiny"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 256.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 256.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 3.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",calculate_kv_scales="False",enable_prefix_caching="True",engine="0",kv_cache_max_concurrency="4096.0",kv_cache_memory_bytes="1073741824",kv_cache_size_tokens="1048576",num_gpu_blocks="8192",prefix_caching_hash_algo="sha256"} 1.0
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 1234.0
process_open_fds 42.0
"""


def metrics_page(usage: float | None, waiting: int = 0, running: int = 0) -> str:
    """A minimal scrape with the gauges the controller reads; usage None drops the KV gauge."""
    lines = [
        "# TYPE vllm:num_requests_waiting gauge",
        f'vllm:num_requests_waiting{{engine="0",model_name="tiny"}} {float(waiting)}',
        f'vllm:num_requests_running{{engine="0",model_name="tiny"}} {float(running)}',
    ]
    if usage is not None:
        lines.append(f'vllm:kv_cache_usage_perc{{engine="0",model_name="tiny"}} {usage}')
    return "\n".join(lines) + "\n"


class Driver:
    """Plays a trace against a controller the way the worker does: fill free slots, finish, scrape."""

    def __init__(self, controller: ConcurrencyController) -> None:
        self.c = controller
        self.peak_in_flight = 0

    def fill(self) -> int:
        started = 0
        while self.c.can_admit():
            self.c.on_rollout_started()
            started += 1
        self.peak_in_flight = max(self.peak_in_flight, self.c.in_flight)
        return started

    def finish(self, n: int) -> None:
        for _ in range(n):
            self.c.on_rollout_finished()

    def scrape(self, text: str | None) -> None:
        self.c.observe_metrics(None if text is None else parse_vllm_metrics(text))


# --------------------------------------------------------------------------------------------------
# Parser
# --------------------------------------------------------------------------------------------------


def test_parser_on_recorded_metrics() -> None:
    m = parse_vllm_metrics(RECORDED_METRICS)
    assert m == VllmMetrics(
        kv_cache_usage_perc=0.4375,
        num_requests_waiting=2,
        num_requests_running=3,
        kv_cache_size_tokens=1048576,
        generation_tokens_total=61440.0,
        prompt_tokens_total=12800.0,
    )
    assert m.tokens_processed == 61440.0 + 12800.0  # what moves while its requests make progress


def test_parser_missing_metrics_are_none() -> None:
    assert parse_vllm_metrics("") == VllmMetrics()
    only_waiting = parse_vllm_metrics('vllm:num_requests_waiting{engine="0"} 0\n')
    assert only_waiting.num_requests_waiting == 0
    assert only_waiting.kv_cache_usage_perc is None
    assert only_waiting.kv_cache_size_tokens is None


def test_parser_combines_engines() -> None:
    text = (
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.9\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 1\n'
        'vllm:num_requests_waiting{engine="1",model_name="m"} 4\n'
        'vllm:cache_config_info{engine="0",kv_cache_size_tokens="1000"} 1\n'
        'vllm:cache_config_info{engine="1",kv_cache_size_tokens="1000"} 1\n'
    )
    m = parse_vllm_metrics(text)
    assert m.kv_cache_usage_perc == 0.9  # the fullest engine decides
    assert m.num_requests_waiting == 5
    assert m.kv_cache_size_tokens == 2000


def test_parser_label_escapes_timestamps_and_special_values() -> None:
    text = (
        'weird{path="a\\"b,c}d",note="x\\\\y\\nz"} 7 1700000000000\n'
        "no_labels 3.5\n"
        'nan_metric{a="1"} NaN\n'
        'inf_metric{a="1"} +Inf\n'
    )
    by_name = {s.name: s for s in parse_prometheus_text(text)}
    assert by_name["weird"].labels == {"path": 'a"b,c}d', "note": "x\\y\nz"}
    assert by_name["weird"].value == 7.0
    assert by_name["no_labels"].value == 3.5
    assert math.isnan(by_name["nan_metric"].value)
    assert by_name["inf_metric"].value == math.inf


def test_a_scrape_that_does_not_parse_gives_no_metrics() -> None:
    assert parse_prometheus_text('broken{a="1" 2\n') == []
    assert parse_vllm_metrics("this is not a scrape\n") == parse_vllm_metrics("")


def test_parser_ignores_unsized_cache_and_nan_gauge() -> None:
    text = (
        'vllm:cache_config_info{engine="0",kv_cache_size_tokens="None"} 1\n'
        'vllm:kv_cache_usage_perc{engine="0"} NaN\n'
    )
    m = parse_vllm_metrics(text)
    assert m.kv_cache_size_tokens is None
    assert m.kv_cache_usage_perc is None


def test_parser_accepts_legacy_gpu_cache_gauge() -> None:
    assert parse_vllm_metrics('vllm:gpu_cache_usage_perc{engine="0"} 0.25\n').kv_cache_usage_perc == 0.25


# --------------------------------------------------------------------------------------------------
# Initial cap
# --------------------------------------------------------------------------------------------------


def test_initial_cap_from_kv_tokens_over_max_model_len() -> None:
    m = parse_vllm_metrics(RECORDED_METRICS)  # 1048576 KV tokens
    assert initial_cap_from_server(m, max_model_len=65536, ceiling=64) == 16
    assert initial_cap_from_server(m, max_model_len=256, ceiling=64) == 64  # clamped to the ceiling
    assert initial_cap_from_server(m, max_model_len=4_000_000, ceiling=64) == 1  # at least one
    assert ConcurrencyController.from_server(64, m, 65536).cap == 16


def test_initial_cap_none_without_metrics_or_kv_gauge() -> None:
    m = parse_vllm_metrics(RECORDED_METRICS)
    assert initial_cap_from_server(None, 256, 8) is None
    assert initial_cap_from_server(m, None, 8) is None
    no_gauge = parse_vllm_metrics(RECORDED_METRICS.replace("vllm:kv_cache_usage_perc", "other_gauge"))
    assert no_gauge.kv_cache_size_tokens == 1048576
    assert initial_cap_from_server(no_gauge, 65536, 64) is None
    assert ConcurrencyController.from_server(64, no_gauge, 65536).cap == 64


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        ConcurrencyController(0)
    with pytest.raises(ValueError):
        ConcurrencyController(4, 0)
    assert ConcurrencyController(4, 100).cap == 4


# --------------------------------------------------------------------------------------------------
# Controller traces
# --------------------------------------------------------------------------------------------------


def test_grow_by_a_quarter_per_clean_window_up_to_ceiling() -> None:
    d = Driver(ConcurrencyController(ceiling=20, initial_cap=8))
    caps = [d.c.cap]
    for _ in range(12):
        d.fill()
        d.scrape(metrics_page(0.3, waiting=0))
        d.finish(d.c.cap)  # a cap's worth completes
        caps.append(d.c.cap)
    # 8 → +2 → 10 → +2 → 12 → +3 → 15 → +3 → 18 → +4 capped → 20
    assert caps[:6] == [8, 10, 12, 15, 18, 20]
    assert set(caps[6:]) == {20}
    assert d.peak_in_flight == 20


def test_grow_at_least_one() -> None:
    d = Driver(ConcurrencyController(ceiling=10, initial_cap=1))
    caps = []
    for _ in range(5):
        d.fill()
        d.scrape(metrics_page(0.1))
        d.finish(d.c.in_flight)
        caps.append(d.c.cap)
    assert caps == [2, 3, 4, 5, 6]  # 25 % of 1..4 rounds down to 0, so +1


def test_growth_needs_a_full_window() -> None:
    d = Driver(ConcurrencyController(ceiling=20, initial_cap=8))
    d.fill()
    d.scrape(metrics_page(0.1))
    d.finish(7)
    assert d.c.cap == 8
    d.finish(1)
    assert d.c.cap == 10


def test_no_growth_before_any_reading() -> None:
    d = Driver(ConcurrencyController(ceiling=20, initial_cap=4))
    d.fill()
    d.finish(4)
    assert d.c.cap == 4


def test_window_without_scrape_uses_latest_reading() -> None:
    # Rollouts can finish faster than the scrape period: a window with no reading inherits the last.
    d = Driver(ConcurrencyController(ceiling=20, initial_cap=4))
    d.scrape(metrics_page(0.2))
    for expected in (5, 6, 7):
        d.fill()
        d.finish(d.c.in_flight)
        assert d.c.cap == expected


@pytest.mark.parametrize(
    ("usage", "waiting"),
    [(0.6, 0), (0.7, 0), (0.8, 0), (0.3, 1), (0.3, None), (None, 0)],
    ids=["usage=0.6", "usage=0.7", "usage=0.8", "waiting", "waiting-unknown", "scrape-failed"],
)
def test_hold(usage: float | None, waiting: int | None) -> None:
    c = ConcurrencyController(ceiling=20, initial_cap=8)
    for _ in range(5):
        while c.can_admit():
            c.on_rollout_started()
        c.observe(usage, waiting)
        for _ in range(c.cap):
            c.on_rollout_finished()
    assert c.cap == 8
    assert c.num_grows == 0 and c.num_cuts == 0


def test_one_bad_reading_spoils_the_window() -> None:
    d = Driver(ConcurrencyController(ceiling=20, initial_cap=8))
    d.fill()
    d.scrape(metrics_page(0.2))
    d.finish(3)
    d.scrape(metrics_page(0.2, waiting=3))  # something queued mid-window
    d.finish(2)
    d.scrape(metrics_page(0.2))
    d.finish(3)
    assert d.c.cap == 8  # window of 8 finished, but not clean throughout
    d.fill()
    d.finish(8)
    assert d.c.cap == 10  # the next window starts from the clean latest reading


def test_shrink_by_thirty_percent_without_cancelling() -> None:
    d = Driver(ConcurrencyController(ceiling=32, initial_cap=20))
    d.fill()
    assert d.c.in_flight == 20
    d.scrape(metrics_page(0.85, running=20))
    assert d.c.cap == 14  # 20 - 30 %
    assert d.c.in_flight == 20  # nothing cancelled
    assert not d.c.can_admit() and d.c.draining
    d.finish(6)  # in flight 14 == cap: still not under it
    assert not d.c.can_admit() and d.c.draining
    d.finish(1)
    assert d.c.in_flight == 13 and d.c.can_admit() and not d.c.draining
    assert d.fill() == 1


def test_shrink_at_least_one_and_never_below_one() -> None:
    caps = []
    c = ConcurrencyController(ceiling=8, initial_cap=3)
    for _ in range(4):
        c.observe(0.95, 0)
        caps.append(c.cap)
    assert caps == [2, 1, 1, 1]
    assert c.num_cuts == 2


def test_no_second_cut_before_drain() -> None:
    d = Driver(ConcurrencyController(ceiling=32, initial_cap=20))
    d.fill()
    d.scrape(metrics_page(0.9))
    assert d.c.cap == 14
    for _ in range(5):  # usage stays high while the pool drains: no further cut
        d.scrape(metrics_page(0.95))
        d.finish(1)
    assert d.c.cap == 14 and d.c.num_cuts == 1
    d.finish(2)  # 13 in flight: drained
    assert not d.c.draining
    d.scrape(metrics_page(0.95))
    assert d.c.cap == 10 and d.c.num_cuts == 2


def test_cut_with_pool_already_under_new_cap_does_not_block() -> None:
    c = ConcurrencyController(ceiling=32, initial_cap=20)
    for _ in range(5):
        c.on_rollout_started()
    c.observe(0.85, 0)
    assert c.cap == 14 and not c.draining and c.can_admit()
    assert c.free_slots() == 9


def test_growth_after_cut_needs_fresh_clean_window() -> None:
    d = Driver(ConcurrencyController(ceiling=32, initial_cap=10))
    d.fill()
    d.scrape(metrics_page(0.85))
    assert d.c.cap == 7
    d.finish(10)  # the window restarted at the cut under the bad reading: it ends unclean at the 7th
    assert d.c.cap == 7
    d.scrape(metrics_page(0.3))
    d.fill()
    d.finish(7)  # the window begun under the bad reading ends at the 4th; 3 count towards a clean one
    assert d.c.cap == 7
    d.fill()
    d.finish(7)  # ...which ends at the 4th finish here
    assert d.c.cap == 8


def test_no_metrics_server_keeps_ceiling() -> None:
    d = Driver(ConcurrencyController.from_server(16, None, 256))
    for _ in range(10):
        assert d.fill() >= 1
        d.scrape(None)
        d.finish(d.c.in_flight)
        assert d.c.cap == 16
    assert d.peak_in_flight == 16


def test_server_without_kv_gauge_keeps_ceiling() -> None:
    page = metrics_page(None, waiting=0)
    d = Driver(ConcurrencyController.from_server(16, parse_vllm_metrics(page), 256))
    for _ in range(5):
        d.fill()
        d.scrape(page)
        d.finish(d.c.in_flight)
    assert d.c.cap == 16 and d.c.num_cuts == 0


def test_full_trace_grow_hold_shrink_regrow() -> None:
    """A run-shaped trace: warm up, load climbs past 0.8, drain, settle, grow back."""
    d = Driver(ConcurrencyController(ceiling=24, initial_cap=8))
    # (KV usage at the scrape, rollouts finishing after it; None = every one in flight)
    trace = [(0.2, None), (0.3, None), (0.5, None), (0.7, None), (0.85, 3), (0.9, 3), (0.75, None), (0.5, None), (0.4, None)]
    caps, admitted = [], []
    for usage, n_finish in trace:
        admitted.append(d.fill())
        d.scrape(metrics_page(usage))
        d.finish(d.c.in_flight if n_finish is None else n_finish)
        caps.append(d.c.cap)
        assert 1 <= d.c.cap <= d.c.ceiling
    # 8→10→12→15 on clean windows; 0.7 holds; 0.85 cuts 15→11 with 15 in flight; 0.9 arrives while
    # still draining (12 in flight): no cut, nothing admitted; 0.75 holds; the 0.5 window began under
    # 0.75 so it holds too; the next clean window grows 11→13.
    assert caps == [10, 12, 15, 15, 11, 11, 11, 11, 13]
    assert admitted[5] == 0


def test_started_without_slot_and_unbalanced_finish_raise() -> None:
    c = ConcurrencyController(ceiling=1)
    c.on_rollout_started()
    with pytest.raises(RuntimeError):
        c.on_rollout_started()
    c.on_rollout_finished()
    with pytest.raises(RuntimeError):
        c.on_rollout_finished()
