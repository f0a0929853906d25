"""The server calls of one push, each under its phase's deadline, each failure named by phase and server.

``TimedControl`` wraps the vLLM control client for one push (one version, one size): every weight-sync
route is sent with its phase's deadline (``deadline.Deadlines``) as the HTTP timeout, a timeout raises
``WeightSyncTimeout`` and any other failure ``WeightSyncError``, both naming the phase, the server and
the version. It has the four methods of vLLM's ``VLLMWeightSyncClient``, so trainer engines drive it
as they would the client.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grpo_core.sync.errors import WeightSyncError, WeightSyncTimeout
from grpo_core.sync.timing.deadline import Deadlines, PhaseClock


def _is_timeout(err: BaseException) -> bool:
    import httpx

    return isinstance(err, httpx.TimeoutException)


class TimedControl:
    """One push's calls to the server behind ``control``, under ``deadlines``."""

    def __init__(self, control: Any, deadlines: Deadlines, version: int | str | None, nbytes: int):
        self.control = control
        self.deadlines = deadlines
        self.version = version
        self.nbytes = nbytes

    def clock(self, phase: str) -> PhaseClock:
        return self.deadlines.clock(phase, self.nbytes, self.version)

    def failed(self, phase: str, err: BaseException) -> WeightSyncError:
        """``err`` (raised in ``phase``) as the named error."""
        if isinstance(err, WeightSyncError):
            return err
        return WeightSyncError(
            f"weight sync to {self.deadlines.server}: phase '{phase}' of the push of version {self.version} "
            f"failed: {type(err).__name__}: {err}",
            server=self.deadlines.server, version=self.version, phase=phase,
        )

    def call(self, phase: str, route: Callable[..., Any], *args: Any) -> Any:
        clock = self.clock(phase)
        try:
            return route(*args, timeout=clock.seconds)
        except Exception as err:
            raise (clock.expired(str(err)) if _is_timeout(err) else self.failed(phase, err)) from err

    def pause(self) -> None:
        # ``keep`` freezes in-flight rollouts rather than aborting them; ``clear_cache`` drops KV and
        # prefix-cache entries computed with the old weights.
        self.call("pause", lambda timeout: self.control.pause(mode="keep", clear_cache=True, timeout=timeout))

    def resume(self) -> None:
        self.call("resume", self.control.resume)

    # -- vLLM's VLLMWeightSyncClient ------------------------------------------------------------------
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.call("init", self.control.init_weight_transfer_engine, init_info)

    def start_weight_update(self) -> None:
        self.call("start", self.control.start_weight_update)

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.call("update", self.control.update_weights, update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.call("finish", self.control.finish_weight_update, weight_version)


__all__ = ["TimedControl", "WeightSyncError", "WeightSyncTimeout"]
