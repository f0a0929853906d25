"""Adaptive cap on the number of rollouts in flight against one vLLM server, as a pure state machine.

``max_concurrent_rollouts`` is only a ceiling: past some load, extra requests make vLLM slower, not
faster (the KV cache fills, sequences are preempted and recomputed, cached prefixes are evicted). The
rollout worker therefore keeps a live cap below the ceiling and steers it from the server's
``/metrics``:

- start at KV-cache tokens / ``max_model_len``: as many requests as fit at full length, so the first
  step cannot overload the server;
- grow by 25 % (at least +1, up to the ceiling) each time a cap's worth of rollouts completes while
  KV usage stayed under 0.6 and nothing waited in the server queue;
- shrink by 30 % (at least -1, never below 1) when KV usage passes 0.8; nothing is cancelled, nothing is
  admitted until in-flight drops under the new cap, and no further cut happens before that;
- a server without ``/metrics`` (or without the KV gauge) leaves the cap at the ceiling.

Nothing here does I/O or reads a clock: the worker scrapes ``/metrics``, parses it with
``parse_vllm_metrics`` and feeds ``ConcurrencyController.observe``; it calls ``on_rollout_started`` /
``on_rollout_finished`` around each rollout and waits (e.g. on an ``asyncio.Condition``) while
``can_admit()`` is False. Tests drive it with scripted metric traces (tests/test_concurrency.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Thresholds on vllm:kv_cache_usage_perc (a fraction in 0..1) and step sizes in percent of the cap.
GROW_BELOW_USAGE = 0.6
SHRINK_ABOVE_USAGE = 0.8
GROW_PERCENT = 25
SHRINK_PERCENT = 30


# ---------------------------------------------------------------------------------------------------
# Prometheus text parsing
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromSample:
    """One sample line of the Prometheus text format: ``name{labels} value``."""

    name: str
    labels: dict[str, str] = field(default_factory=dict)
    value: float = math.nan


def parse_prometheus_text(text: str) -> list[PromSample]:
    """Samples of Prometheus exposition text, read with ``prometheus_client``'s parser.

    A scrape is advisory: text that does not parse yields no samples (the controller then keeps its
    cap), never an error in the rollout loop.
    """
    from prometheus_client.parser import text_string_to_metric_families

    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError):
        return []
    return [PromSample(name=s.name, labels=dict(s.labels), value=float(s.value)) for f in families for s in f.samples]


@dataclass(frozen=True)
class VllmMetrics:
    """The few vLLM gauges and counters the rollout worker steers by; None where the server lacks one.

    With several engines (data parallel) the series are combined: KV usage takes the fullest engine
    (the cap must protect the worst one), request counts, KV capacity and token counters are summed.
    """

    kv_cache_usage_perc: float | None = None  # fraction 0..1 despite the name (vLLM 0.32's /metrics)
    num_requests_waiting: int | None = None
    num_requests_running: int | None = None
    kv_cache_size_tokens: int | None = None  # from the vllm:cache_config_info labels
    generation_tokens_total: float | None = None
    prompt_tokens_total: float | None = None

    @property
    def tokens_processed(self) -> float | None:
        """Prompt and generated tokens so far: what moves while the server's requests make progress (None: neither
        counter exported)."""
        if self.generation_tokens_total is None and self.prompt_tokens_total is None:
            return None
        return (self.generation_tokens_total or 0.0) + (self.prompt_tokens_total or 0.0)


# Older vLLM releases named the KV gauge after the GPU; accept it so the cap still adapts there.
_KV_USAGE_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def _finite(samples: list[PromSample], name: str) -> list[float]:
    return [s.value for s in samples if s.name == name and math.isfinite(s.value)]


def parse_vllm_metrics(text: str) -> VllmMetrics:
    """Extract ``VllmMetrics`` from the text of vLLM's ``/metrics``; pure, never raises on odd input."""
    samples = parse_prometheus_text(text)

    kv_usage: float | None = None
    for kv_name in _KV_USAGE_NAMES:
        values = _finite(samples, kv_name)
        if values:
            kv_usage = max(values)
            break

    def summed(name: str) -> float | None:
        values = _finite(samples, name)
        return sum(values) if values else None

    waiting = summed("vllm:num_requests_waiting")
    running = summed("vllm:num_requests_running")

    # cache_config_info is an info-style gauge (value 1) whose labels carry the cache config, one series
    # per engine; each engine owns its KV cache, so the capacities add up.
    kv_tokens: int | None = None
    for s in samples:
        if s.name != "vllm:cache_config_info":
            continue
        try:
            tokens = int(float(s.labels["kv_cache_size_tokens"]))
        except (KeyError, ValueError):  # absent, or "None" before the cache was sized
            continue
        kv_tokens = tokens if kv_tokens is None else kv_tokens + tokens

    return VllmMetrics(
        kv_cache_usage_perc=kv_usage,
        num_requests_waiting=None if waiting is None else int(waiting),
        num_requests_running=None if running is None else int(running),
        kv_cache_size_tokens=kv_tokens,
        generation_tokens_total=summed("vllm:generation_tokens_total"),
        prompt_tokens_total=summed("vllm:prompt_tokens_total"),
    )


# ---------------------------------------------------------------------------------------------------
# The controller
# ---------------------------------------------------------------------------------------------------


def initial_cap_from_server(metrics: VllmMetrics | None, max_model_len: int | None, ceiling: int) -> int | None:
    """KV-cache tokens / ``max_model_len`` clamped to [1, ceiling], or None to start at the ceiling.

    None when the server exposes no ``/metrics`` (``metrics is None``), no KV-usage gauge (the cap
    could never adapt, so it must not start low), no cache size, or no ``max_model_len``.
    """
    if metrics is None or metrics.kv_cache_usage_perc is None:
        return None
    if metrics.kv_cache_size_tokens is None or not max_model_len or max_model_len <= 0:
        return None
    return max(1, min(ceiling, metrics.kv_cache_size_tokens // max_model_len))


class ConcurrencyController:
    """Live concurrency cap; see the module docstring for the rules.

    Growth is judged per window: a window starts at every cap change (and after each full window) and
    ends when ``cap`` rollouts have completed since its start. It is clean when every reading made
    during it was clean (usage < 0.6 and 0 waiting), and so was the last reading before it, which
    describes the window's first stretch. So a window with no scrape in it (rollouts finishing faster
    than the scrape period) is judged by the newest reading instead of blocking growth, and a cut's
    bad reading spoils the window that follows it. Growth needs at least one reading. A reading with an
    unknown gauge (None) is never clean: a failed scrape usually means an overloaded server.

    Feed no observations while the server is paused for a weight swap: its gauges are only refreshed on
    scheduler steps (vLLM 0.32) and are stale then. Not thread-safe: drive it from one event loop.
    """

    def __init__(self, ceiling: int, initial_cap: int | None = None) -> None:
        if ceiling < 1:
            raise ValueError(f"ceiling (max_concurrent_rollouts) must be >= 1, got {ceiling}")
        if initial_cap is not None and initial_cap < 1:
            raise ValueError(f"initial_cap must be >= 1 or None, got {initial_cap}")
        self._ceiling = ceiling
        self._cap = ceiling if initial_cap is None else min(initial_cap, ceiling)
        self._in_flight = 0
        self._draining = False
        self._last_obs_clean: bool | None = None  # None: no reading yet
        self._window_clean = True
        self._window_seen = False  # a reading describes (part of) this window
        self._window_done = 0
        self.num_grows = 0
        self.num_cuts = 0

    @classmethod
    def from_server(cls, ceiling: int, metrics: VllmMetrics | None, max_model_len: int | None) -> ConcurrencyController:
        """Controller whose initial cap comes from the server's first scrape and ``/v1/models``."""
        return cls(ceiling, initial_cap_from_server(metrics, max_model_len, ceiling))

    # -- state -------------------------------------------------------------------------------------

    @property
    def ceiling(self) -> int:
        return self._ceiling

    @property
    def cap(self) -> int:
        """Current live cap (logged as ``rollout/concurrency_cap``)."""
        return self._cap

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def draining(self) -> bool:
        """True after a cut until in-flight drops under the new cap: nothing is admitted, no new cut."""
        return self._draining

    def can_admit(self) -> bool:
        return not self._draining and self._in_flight < self._cap

    def free_slots(self) -> int:
        """How many rollouts may start now."""
        return 0 if self._draining else max(0, self._cap - self._in_flight)

    # -- events ------------------------------------------------------------------------------------

    def on_rollout_started(self) -> None:
        if not self.can_admit():
            raise RuntimeError(
                f"rollout started without a free slot (cap {self._cap}, in flight {self._in_flight}, "
                f"draining {self._draining}); check can_admit() first"
            )
        self._in_flight += 1

    def adopt(self, count: int) -> None:
        """Take over ``count`` rollouts already running elsewhere (a fleet server was lost and its groups moved
        here): they count as in flight at once, over the cap if need be, and nothing more is admitted until
        in-flight drops under it."""
        if count < 0:
            raise ValueError(f"adopt({count}): a count of rollouts is never negative")
        self._in_flight += count

    def on_rollout_finished(self) -> None:
        if self._in_flight == 0:
            raise RuntimeError("on_rollout_finished() called with no rollout in flight")
        self._in_flight -= 1
        self._update_drain()
        self._window_done += 1
        if self._window_done >= self._cap:
            if self._window_clean and self._window_seen and self._cap < self._ceiling:
                step = max(1, self._cap * GROW_PERCENT // 100)
                self._cap = min(self._ceiling, self._cap + step)
                self.num_grows += 1
            self._start_window()

    def observe(self, kv_usage: float | None, num_waiting: int | None) -> None:
        """Feed one ``/metrics`` reading: KV usage as a fraction and the server's waiting-queue length."""
        clean = kv_usage is not None and num_waiting is not None and kv_usage < GROW_BELOW_USAGE and num_waiting == 0
        self._last_obs_clean = clean
        self._window_clean = self._window_clean and clean
        self._window_seen = True
        if kv_usage is not None and kv_usage > SHRINK_ABOVE_USAGE and not self._draining:
            self._cut()

    def observe_metrics(self, metrics: VllmMetrics | None) -> None:
        """``observe`` from a parsed scrape; None (no ``/metrics``) is a reading with unknown gauges."""
        if metrics is None:
            self.observe(None, None)
        else:
            self.observe(metrics.kv_cache_usage_perc, metrics.num_requests_waiting)

    # -- internals ---------------------------------------------------------------------------------

    def _cut(self) -> None:
        if self._cap > 1:
            step = max(1, self._cap * SHRINK_PERCENT // 100)
            self._cap = max(1, self._cap - step)
            self.num_cuts += 1
        # At the floor nothing is cut, but the pool still drains before the next reading may cut.
        self._draining = True
        self._update_drain()
        self._start_window()

    def _update_drain(self) -> None:
        if self._draining and self._in_flight < self._cap:
            self._draining = False

    def _start_window(self) -> None:
        self._window_done = 0
        self._window_seen = self._last_obs_clean is not None
        self._window_clean = self._last_obs_clean is not False
