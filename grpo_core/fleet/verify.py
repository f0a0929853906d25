"""Checks that a server serves the version just pushed, and the trainer's weights under that version.

Two checks after a push, per server (a fleet calls them for each):

* ``check_version``: ``GET /weight_info`` must report the pushed version (every push; one request);
* ``PushVerifier.check_logprobs``: the server's log-probs of a fixed probe sequence
  (``prompt_logprobs`` of ``probe_token_ids``) must be within ``logprob_atol`` of the trainer's own
  for the same tokens, computed by the trainer from the weights it pushed: every token for an fp32 server, on
  average for a 16-bit one (``LOW_PRECISION_ATOL``, ``ROUNDING_MARGIN``). This sees what the server
  computes with, whatever the transport and its receiving code (a tied head not refreshed, a layer
  not reloaded, a push that never reached the weights): every ``every`` pushes.

A 16-bit server whose mean gap fails the bound is probed again with ``confirm_probes`` other sequences
(``ProbeOutlier``; the pusher computes the trainer's side of each on every rank): the push passes only when
each of them is within its own bound. Weights a push got wrong move every sequence; the bf16 CPU server of the
tiny Gated DeltaNet hybrid, holding the right weights, put the first probe sequence 8-26x past the trainer's own
rounding at a few versions of a run, the same again after a second push of the same weights, while the two further
sequences sat within 1.4x of it at the versions where that happened (docs/weight_sync.md).

The log-prob check tells two versions apart only where one step moves the probe's log-probs by more
than the tolerance; the verifier reports that move (``VerifyReport.moved``) beside the difference
it found, so the margin is visible in the run's metrics. Exact checks of the bytes a server holds
exist where this package's code receives them (``StoragePatchSync.check_applied``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from grpo_core.sync.errors import ServedVersionMismatch, ServedWeightsMismatch
from grpo_core.vllm_server.control import VLLMRequestError
from grpo_core.vllm_server.process import ENABLE_SCALE_OUT

log = logging.getLogger(__name__)

FP32_ATOL = 1e-4
"""``logprob_atol`` when None and the server computes in fp32: the bound the dense push meets on the CPU
server (server and trainer log-probs of the same weights, another process and other kernels;
``tests/integration/test_async_loop.py``)."""
LOW_PRECISION_ATOL = 5e-2
"""The least ``logprob_atol`` when None and the server computes in 16 bits, or does not say in what. Such a server is
checked on the probe's mean |server - trainer| log-prob, not its largest: one token whose 16-bit router picks other
experts, or whose logit lands on the other side of a rounding step, moved a single log-prob of the tiny Qwen3.5-MoE
by 1.8 nats after pushes that had landed (its sampled tokens' log-probs agreed within 0.01 on average), while weights
a push got wrong move every token. A trainer that computes in fp32 raises it to ``ROUNDING_MARGIN`` times its own
16-bit rounding of the probe."""
ROUNDING_MARGIN = 8.0
"""A 16-bit server's mean probe gap may be this many times the trainer's own: the mean |fp32 - bf16| of its probe,
measured at each checked version (``VersionProbe.rounding_gap``). Measured on bf16 CPU servers of the tiny Gated
DeltaNet builds: weights as loaded, five probe sequences each, up to 1.74x (``benchmarks/sync/probe_rounding.py``); over
the 120 pushes of the tiny Qwen3.5-MoE's learning run, up to 3.5x. Twice that, since a false alarm stops a run.
In 16 bits the probe tells wrong weights from right ones (a push of unpacked experts moved it by 8.96), not one
step's movement; the version read back after every push is what catches a push that did not land."""


@dataclass(frozen=True)
class VerifyConfig:
    """How and how often the served weights are checked after a push."""

    every: int = 1
    """Compare log-probs after every ``every``-th push (0: never; the version is checked every push)."""
    probe_tokens: int = 32
    """Length of the fixed probe sequence whose log-probs are compared."""
    confirm_probes: int = 2
    """Probe sequences (seeds 1, 2, ...) checked after a 16-bit server fails the default bound on the mean with the
    first: the push passes when every one of them passes (a rounding outlier of one sequence), else it fails with
    all their gaps. Not used where the bound is exact (an fp32 server) or set (``logprob_atol``)."""
    logprob_atol: float | None = None
    """Largest |server - trainer| log-prob of a probe token accepted (None: ``FP32_ATOL`` for a server that
    computes in fp32, else ``LOW_PRECISION_ATOL``; read from the server at the first check)."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"VerifyConfig.every={self.every}: 0 (never) or a positive number of pushes")
        if self.confirm_probes < 0:
            raise ValueError(f"VerifyConfig.confirm_probes={self.confirm_probes}: 0 (fail on the first probe) or more")
        if self.probe_tokens < 2:
            raise ValueError(f"VerifyConfig.probe_tokens={self.probe_tokens}: at least 2 (the first token has no log-prob)")
        if self.logprob_atol is not None and not self.logprob_atol > 0:
            raise ValueError(f"VerifyConfig.logprob_atol={self.logprob_atol}: must be > 0, or None for the default")


@dataclass(frozen=True)
class VerifyReport:
    """What one log-prob check found."""

    version: int
    max_diff: float
    """Largest |server - trainer| log-prob over the probe."""
    mean_diff: float
    """Mean |server - trainer| log-prob over the probe."""
    moved: float | None
    """Largest change of the trainer's probe log-probs since the last checked version (None: first check)."""
    tolerance: float
    """The bound this check held ``max_diff`` to, or ``mean_diff`` for a 16-bit server (``PushVerifier.checks_mean``)."""
    seconds: float
    reprobes: int = 0
    """Further probe sequences checked because the first failed a 16-bit bound and each passed (``confirm_probes``);
    the figures above are the first sequence's."""


@dataclass(frozen=True)
class ProbeGap:
    """One probe sequence's |server - trainer| log-probs against the bound that applies to them."""

    max_diff: float
    mean_diff: float
    tolerance: float
    on_mean: bool
    """The bound holds the mean (a 16-bit server, default tolerance), else the largest."""

    @property
    def passed(self) -> bool:
        checked = self.mean_diff if self.on_mean else self.max_diff
        return checked <= self.tolerance  # NaN fails

    def describe(self) -> str:
        return (f"{self.mean_diff:.3g} on average and up to {self.max_diff:.3g} (tolerance {self.tolerance:g} on the "
                f"{'mean' if self.on_mean else 'largest'}")


def probe_gap(served: list[float], expected: torch.Tensor, tolerance: float, on_mean: bool) -> ProbeGap:
    """Compare a server's probe log-probs with the trainer's (one per token after the first)."""
    gaps = (torch.tensor(served, dtype=torch.float64) - expected.detach().double().cpu()).abs()
    return ProbeGap(max_diff=float(gaps.max()), mean_diff=float(gaps.mean()), tolerance=tolerance, on_mean=on_mean)


class ProbeOutlier(ServedWeightsMismatch):
    """A 16-bit server's first probe sequence failed the bound on its mean: what ``PushVerifier.confirm`` settles with
    further sequences. Raised as is (a mismatch) where nothing confirms it."""

    def __init__(self, message: str, *, server: str, version: int, gap: ProbeGap, expected: torch.Tensor,
                 moved: float | None, started: float):
        super().__init__(message, server=server, version=version, phase="verify")
        self.gap, self.expected, self.moved, self.started = gap, expected, moved, started


def probe_token_ids(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    """A fixed pseudo-random token sequence (the same in every run of the same vocabulary size)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=g).tolist()


def check_version(control: Any, version: int) -> None:
    """Raise ``ServedVersionMismatch`` unless the server reports ``version``."""
    served = control.weight_version()
    if served != str(version):
        raise ServedVersionMismatch(
            f"the vLLM server at {control.base_url} reports weight version {served!r} right after the push of "
            f"version {version}", server=control.base_url, version=version, phase="verify",
        )


def default_atol(served_dtype: str | None, rounding_gap: float | None = None) -> float:
    """``logprob_atol`` for a server that computes in ``served_dtype`` (None: it did not say), given the trainer's
    own mean fp32-vs-bf16 gap on the probe where it measured one."""
    if served_dtype == "float32":
        return FP32_ATOL
    return max(LOW_PRECISION_ATOL, ROUNDING_MARGIN * rounding_gap if rounding_gap is not None else 0.0)


def probe_unsafe_reason(server_config: dict[str, Any]) -> str | None:
    """Why a log-prob probe must not be sent to a server with this engine configuration (None: it may).

    vLLM's CPU LoRA kernels mis-size the logits step when a prompt-log-prob request shares a batch with
    decoding requests (``bgmv_shrink``: an einsum over mismatched batch sizes), and the engine dies; the
    rollouts decode while the probe is asked, so a CPU server started with LoRA support gets no probe."""
    device = (server_config.get("device_config") or {})
    on_cpu = "cpu" in {str(device.get("device", "")).lower(), str(device.get("device_type", "")).lower()}
    if on_cpu and server_config.get("lora_config"):
        return ("the server runs on the CPU with LoRA support, whose kernels fail on a prompt-log-prob request "
                "batched with decoding ones")
    return None


class PushVerifier:
    """The log-prob check of ``VerifyConfig``."""

    def __init__(self, config: VerifyConfig, vocab_size: int):
        self.config = config
        self.vocab_size = vocab_size
        self.token_ids = probe_token_ids(vocab_size, config.probe_tokens)
        self.atol: float | None = config.logprob_atol
        self.served_dtype: str | None = None  # as the server reports it, read at the first check
        self.last_expected: torch.Tensor | None = None
        self.server_read = False
        self.skip_reason: str | None = None  # set at the first check: this server gets no probe

    def due(self, push_index: int) -> bool:
        """Whether the ``push_index``-th push (1-based) gets a log-prob check."""
        return self.config.every > 0 and push_index % self.config.every == 0

    def _tolerance_rule(self, rounding_gap: float | None) -> str:
        """The default tolerance for this server's dtype, in words, for the start-of-run log."""
        if self.served_dtype == "float32":
            return f"{default_atol(self.served_dtype):g} on every probe token"
        if rounding_gap is None:
            return f"{default_atol(self.served_dtype):g} on average"
        return (f"{ROUNDING_MARGIN:g}x the trainer's own bf16 rounding of the probe on average, measured at each checked "
                f"version ({rounding_gap:.3g} now), at least {LOW_PRECISION_ATOL:g}")

    def check_logprobs(self, control: Any, version: int, expected: torch.Tensor,
                       model: str | None = None, rounding_gap: float | None = None) -> VerifyReport | None:
        """Compare the server's probe log-probs with ``expected`` (the trainer's, one per token after the first).
        None: this server gets no probe (``probe_unsafe_reason``); its version is still read back.
        ``rounding_gap``: the trainer's own mean fp32-vs-bf16 gap on this version's probe, which sets the tolerance
        for a 16-bit server where ``logprob_atol`` is None."""
        start = time.perf_counter()
        if not self.server_read:
            self.server_read = True
            server_config = control.server_config()
            self.skip_reason = probe_unsafe_reason(server_config)
            if self.skip_reason is not None:
                log.warning("weight push check: no log-prob probe for the server at %s (%s); the served version is "
                            "still read back after every push", control.base_url, self.skip_reason)
            dtype = (server_config.get("model_config") or {}).get("dtype")
            self.served_dtype = str(dtype).removeprefix("torch.") if dtype else None
            if self.config.logprob_atol is None:
                log.info("weight push check: the server at %s computes in %s; probe log-probs must agree within %s "
                         "(weight_sync_verify_atol)", control.base_url, self.served_dtype or "an unreported dtype",
                         self._tolerance_rule(rounding_gap))
        if self.config.logprob_atol is None:
            self.atol = default_atol(self.served_dtype, rounding_gap)
        if self.skip_reason is not None:
            return None
        try:
            served = control.prompt_logprobs(self.token_ids, model=model)
        except VLLMRequestError as err:
            route_missing = err.status == 404 and '"detail":"Not Found"' in str(err).replace(" ", "")
            if not (err.status == 403 or route_missing):  # an unknown model name (404) is an answer, not a refusal
                raise
            # The probe asks /inference/v1/generate, which a server started without the scale-out flag refuses.
            self.skip_reason = f"the server has no /inference/v1/generate route (started without {ENABLE_SCALE_OUT})"
            log.warning("weight push check: no log-prob probe for the server at %s (%s); the served version is still "
                        "read back after every push", control.base_url, self.skip_reason)
            return None
        expected = expected.detach().double().cpu()
        moved = None if self.last_expected is None else float((expected - self.last_expected).abs().max())
        gap = probe_gap(served, expected, self.atol, self.checks_mean())
        if not gap.passed:
            message = (f"the vLLM server at {control.base_url} does not serve the trainer's weights of version {version}: "
                       f"its log-probs of the probe differ by {gap.describe()}"
                       + (f"; one version moves them by up to {moved:.3g})" if moved is not None else ")"))
            if gap.on_mean and self.config.confirm_probes > 0:
                raise ProbeOutlier(message, server=control.base_url, version=version, gap=gap, expected=expected,
                                   moved=moved, started=start)
            raise ServedWeightsMismatch(
                message + (". On a 16-bit server this bound can fail with the right weights (docs/weight_sync.md, a "
                           "known false alarm); weight_sync_verify_atol sets a fixed one" if gap.on_mean else ""),
                server=control.base_url, version=version, phase="verify")
        self.last_expected = expected
        return VerifyReport(version=version, max_diff=gap.max_diff, mean_diff=gap.mean_diff, moved=moved,
                            tolerance=gap.tolerance, seconds=time.perf_counter() - start)

    def confirm_token_ids(self) -> list[list[int]]:
        """The further probe sequences of ``VerifyConfig.confirm_probes`` (seeds 1, 2, ...)."""
        return [probe_token_ids(self.vocab_size, self.config.probe_tokens, seed)
                for seed in range(1, self.config.confirm_probes + 1)]

    def confirm(self, control: Any, outlier: ProbeOutlier, probes: list[tuple[list[int], torch.Tensor, float | None]],
                model: str | None = None) -> VerifyReport:
        """Settle ``outlier`` with further sequences: ``probes`` holds each one's token ids, the trainer's log-probs and
        its own 16-bit rounding of them (every rank computed those). The first sequence's report when every one passes
        its bound (logged: one sequence's rounding outlier), else ``ServedWeightsMismatch`` naming every gap."""
        gaps = [probe_gap(control.prompt_logprobs(ids, model=model), expected,
                          default_atol(self.served_dtype, rounding_gap), on_mean=True)
                for ids, expected, rounding_gap in probes]
        first = outlier.gap
        listed = "; ".join(f"sequence {seed}: {gap.describe()})" for seed, gap in enumerate([first, *gaps]))
        if not all(gap.passed for gap in gaps):
            raise ServedWeightsMismatch(
                f"the vLLM server at {control.base_url} does not serve the trainer's weights of version "
                f"{outlier.version}: its log-probs of {len(gaps) + 1} probe sequences differ by {listed}. A 16-bit "
                "server's rounding put one sequence past its bound at times in tests; more than one failing points to "
                "the weights (docs/weight_sync.md; weight_sync_verify_atol sets a fixed bound)",
                server=control.base_url, version=outlier.version, phase="verify")
        log.warning("weight push check, version %s on %s: the first probe sequence failed its bound and %d more passed "
                    "theirs, so the push stands (a 16-bit rounding outlier of one sequence): %s", outlier.version,
                    control.base_url, len(gaps), listed)
        self.last_expected = outlier.expected
        return VerifyReport(version=outlier.version, max_diff=first.max_diff, mean_diff=first.mean_diff,
                            moved=outlier.moved, tolerance=first.tolerance,
                            seconds=time.perf_counter() - outlier.started, reprobes=len(gaps))

    def checks_mean(self) -> bool:
        """Whether the tolerance bounds the probe's mean gap (a 16-bit server, default tolerance) or its largest."""
        return self.config.logprob_atol is None and self.served_dtype != "float32"
