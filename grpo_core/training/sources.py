"""The trainer's two replaceable parts, as ``AsyncGRPOTrainer`` takes them: where samples come from
(``rollout_worker=``) and how weights leave (``weight_transfer=``).

    RolloutSource    what the trainer collects each step's samples from. The run's own is the rollout
                     worker (``rollout.worker.RolloutWorker``: a process that samples from vLLM and scores);
                     ``ReplayRollouts`` plays a recorded stream back; ``RecordingSource`` keeps a copy of
                     what another source hands out (record once, replay many times).
    WeightTransfer   how a pushed version reaches the sampler. The run's own is vLLM's weight-transfer
                     protocol to every configured server (``sync.factory``); anything with ``push(version)``
                     may stand in for it.

With both given, the trainer talks to no vLLM server at all: no waiting for one, no start-up checks, no
confirmation of pushes. What the loss needs to know of the sampler (whether it sent candidate sets, routed
experts) then comes from the source's ``server_capabilities`` when it has one, otherwise from
``assumed_capabilities``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

from grpo_core.rollout.scheduler import END_OF_DATA
from grpo_core.sync.base import SyncStats
from grpo_core.vllm_server.checks import ServerCapabilities


@runtime_checkable
class RolloutSource(Protocol):
    """Where a trainer's samples come from (rank 0 only; the other ranks receive rank 0's plan).

    ``get`` returns the next item: a ``RolloutSample``, a group's report (``rollout.types.GroupReport``), or
    ``END_OF_DATA`` when nothing more will come; it raises ``TimeoutError`` when nothing arrived within
    ``timeout_s``. The optional hooks (``start``, ``stop``, ``publish_version(version, consumed)``) are called
    where the source has them: at the start of ``train()``, at its end, and after every weight push.
    """

    def get(self, timeout_s: float) -> Any: ...

    def queue_size(self) -> int: ...


@runtime_checkable
class WeightTransfer(Protocol):
    """How a pushed version reaches the sampler: ``push`` is called on every rank (a sharded model's gathers are
    collectives) and returns what it cost. ``sync.base.WeightSync`` is the project's base class for these;
    ``mode`` ("full", "delta", "adapter", ...) names the kind of push for the run's tags. Where the transfer has
    ``attach(model)``, the trainer calls it once, at the start of ``train()`` and on every rank, with the policy
    it trains (sharded where the run is): the weights each push sends."""

    mode: str

    def push(self, version: int) -> SyncStats: ...

    def close(self) -> None: ...


SourceWrapper = Callable[[RolloutSource], RolloutSource]
"""``rollout_worker=`` may also be a function that is handed the run's own rollout worker, once it has been
started, and returns the source to collect from (a ``RecordingSource`` around it, a filter)."""


class ReplayRollouts:
    """A recorded stream, handed out in order, then the end of the data.

    ``server_capabilities``: what the sampler that produced the stream offered (``ServerCapabilities``); kept
    with a recording so that a replay computes the same loss (candidate sets, routed experts).
    """

    def __init__(self, items: Iterable[Any], server_capabilities: ServerCapabilities | None = None):
        self.items = [i for i in items if not (isinstance(i, str) and i == END_OF_DATA)]
        self.position = 0
        self.server_capabilities = server_capabilities

    def get(self, timeout_s: float) -> Any:
        if self.position >= len(self.items):
            return END_OF_DATA
        self.position += 1
        return self.items[self.position - 1]

    def queue_size(self) -> int:
        return len(self.items) - self.position


class RecordingSource:
    """Another source's items, handed on unchanged and kept in ``items`` (``END_OF_DATA`` left out), so that a
    live run's stream can be written down and replayed (``ReplayRollouts``)."""

    def __init__(self, inner: RolloutSource):
        self.inner = inner
        self.items: list[Any] = []

    def get(self, timeout_s: float) -> Any:
        item = self.inner.get(timeout_s)
        if not (isinstance(item, str) and item == END_OF_DATA):
            self.items.append(item)
        return item

    def queue_size(self) -> int:
        return self.inner.queue_size()

    def __getattr__(self, name: str) -> Any:
        # The run's worker has more than a source's two methods (publish_version, the fleet's reports): pass them on.
        return getattr(self.inner, name)


def assumed_capabilities(max_model_len: int) -> ServerCapabilities:
    """What a trainer with no server assumes of the sampler behind a replaced source: the token route (per-token
    versions), no candidate sets and no routed experts (only a server that says it returns them sends them)."""
    return ServerCapabilities(max_model_len=max_model_len, served_model="replaced-source", tokens_endpoint=True,
                              candidate_sets=False, routed_experts=False)


def is_source(value: Any) -> bool:
    """A source (it has ``get``), as opposed to a wrapper of the run's own worker."""
    return callable(getattr(value, "get", None)) and callable(getattr(value, "queue_size", None))


def call_if_present(obj: Any, hook: str, *args: Any, **kwargs: Any) -> None:
    """``obj.hook(*args, **kwargs)`` where the object has that hook (the optional parts of ``RolloutSource``)."""
    method = getattr(obj, hook, None)
    if callable(method):
        method(*args, **kwargs)


def check_replacements(rollout_worker: Any, weight_transfer: Any, server_urls: list[str]) -> None:
    """The trainer's ``rollout_worker=`` and ``weight_transfer=``, named when they cannot be used."""
    if rollout_worker is not None and not (is_source(rollout_worker) or callable(rollout_worker)):
        raise TypeError(f"rollout_worker={rollout_worker!r} is neither a RolloutSource (get, queue_size) nor a "
                        "function of the run's rollout worker; see grpo_core.training.sources")
    if weight_transfer is not None and not callable(getattr(weight_transfer, "push", None)):
        raise TypeError(f"weight_transfer={weight_transfer!r} has no push(version); see grpo_core.training.sources")
    if weight_transfer is not None and len(server_urls) > 1 and not is_source(rollout_worker):
        raise ValueError(f"weight_transfer= pushes to one server, and vllm_server_base_url lists {len(server_urls)}: "
                         "give one URL, or leave weight_transfer unset (the run then pushes to every server itself)")
