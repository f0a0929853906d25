"""``WeightPusher``: a push confirmed, a failed push recovered over a new session, a lasting mismatch named.

The server is a stand-in (a dict of what it serves); the syncs are stand-ins that record what they were
asked to do. What is checked is the pusher's order of things, not a transport (tests/test_sync_transfer.py
and tests/integration/test_weight_sync_trust.py cover those).
"""

from __future__ import annotations

import pytest
import torch

from grpo_core.fleet.verify import VerifyConfig
from grpo_core.fleet.weight_push import WeightPusher
from grpo_core.ranks import DistInfo
from grpo_core.sync.base import SyncStats, WeightSync
from grpo_core.sync.errors import ServedWeightsMismatch, WeightSyncTimeout
from grpo_core.vllm_server.control import VLLMRequestError

URL = "http://server:8000"


class Server:
    """What the server serves: a version and the log-probs of whatever it is asked."""

    base_url = URL

    def __init__(self):
        self.version = "default"
        self.logprob = 0.0  # every served log-prob
        self.events: list[str] = []

    def weight_version(self, timeout: float | None = None) -> str:
        return self.version

    def server_config(self) -> dict:
        return {"model_config": {"dtype": "torch.float32"}, "device_config": {"device": "cpu"}}

    def prompt_logprobs(self, token_ids: list[int], model: str | None = None, timeout: float | None = None) -> list[float]:
        return [self.logprob] * (len(token_ids) - 1)

    def finish_weight_update(self, weight_version: str | None = None, timeout: float | None = None) -> None:
        self.events.append("finish-open-update")
        raise VLLMRequestError("/finish_weight_update -> HTTP 400: finish without a matching start")


class Sync(WeightSync):
    """Pushes by setting the server's version (and, unless ``stale``, its log-probs to the trainer's)."""

    mode = "full"

    def __init__(self, server: Server, trainer: dict, failures: list[BaseException], stale: bool = False):
        self.control, self.server, self.trainer, self.failures, self.stale = server, server, trainer, failures, stale

    def push(self, version: int) -> SyncStats:
        self.server.events.append(f"push {version}")
        if self.failures:
            raise self.failures.pop(0)
        self.server.version = str(version)
        if not self.stale:
            self.server.logprob = self.trainer["logprob"]
        return SyncStats(mode=self.mode, bytes=10, seconds=0.01)

    def close(self) -> None:
        self.server.events.append("close")


class Watch:
    def __init__(self, server: Server):
        self.server = server

    def wait_until_answering(self) -> None:
        self.server.events.append("wait")


def pusher(server: Server, trainer: dict, failures: list[BaseException], stale: bool = False, attempts: int = 2):
    def probe(ids: list[int]) -> torch.Tensor:
        return torch.full((len(ids) - 1,), trainer["logprob"], dtype=torch.float64)

    def make() -> Sync:
        server.events.append("open")
        return Sync(server, trainer, failures, stale)

    return WeightPusher(make, DistInfo(), server, Watch(server), attempts=attempts, verify=VerifyConfig(),
                        probe=probe, vocab_size=100)


def test_a_confirmed_push_reports_the_check():
    server, trainer = Server(), {"logprob": -1.0}
    outcome = pusher(server, trainer, []).push(3)
    assert server.events == ["open", "push 3"] and outcome.attempts == 1
    assert outcome.report.max_diff == 0.0 and outcome.report.moved is None
    assert outcome.metrics(3, 0)["sync/verify_logprob_diff"] == 0.0


def test_a_push_past_its_deadline_is_pushed_again_over_a_new_session_after_the_server_answers():
    server, trainer = Server(), {"logprob": -1.0}
    timeout = WeightSyncTimeout("phase 'transfer' ...", server=URL, version=4, phase="transfer")
    p = pusher(server, trainer, [timeout])
    outcome = p.push(4)
    assert server.events == ["open", "push 4", "close", "wait", "finish-open-update", "open", "push 4"]
    assert outcome.attempts == 2 and p.recoveries == 1 and server.version == "4"


def test_a_server_that_keeps_old_weights_is_named_after_the_last_attempt():
    server, trainer = Server(), {"logprob": -1.0}
    p = pusher(server, trainer, [])
    p.push(1)
    trainer["logprob"] = -1.5  # a step later, the server does not follow
    p.make_sync = lambda: Sync(server, trainer, [], stale=True)
    p.reopen()
    with pytest.raises(ServedWeightsMismatch, match=rf"the vLLM server at {URL} does not serve the trainer's weights of "
                                                    r"version 2: its log-probs of the probe differ by 0.5 on average "
                                                    r"and up to 0.5 \(tolerance 0.0001 on the largest"):
        p.push(2)
    assert server.events.count("wait") == 1  # one recovery, then the named error


def test_a_cpu_server_with_lora_support_gets_no_probe_and_others_do() -> None:
    from grpo_core.fleet.verify import PushVerifier, VerifyConfig, probe_unsafe_reason

    cpu_lora = {"device_config": {"device": "cpu"}, "lora_config": {"max_loras": 2}, "model_config": {"dtype": "float32"}}
    assert "LoRA" in probe_unsafe_reason(cpu_lora)
    assert probe_unsafe_reason({**cpu_lora, "device_config": {"device": "cuda"}}) is None
    assert probe_unsafe_reason({**cpu_lora, "lora_config": None}) is None
    assert probe_unsafe_reason({}) is None  # a server that does not say: probed

    class LoraServer(Server):
        def server_config(self) -> dict:
            return cpu_lora

        def prompt_logprobs(self, *a, **k):  # noqa: ANN002, ANN003
            raise AssertionError("a CPU server with LoRA support must not be probed")

    verifier = PushVerifier(VerifyConfig(), vocab_size=50)
    assert verifier.check_logprobs(LoraServer(), 1, torch.zeros(31)) is None
    assert verifier.check_logprobs(LoraServer(), 2, torch.zeros(31)) is None  # the configuration is read once
    plain = PushVerifier(VerifyConfig(), vocab_size=50)
    report = plain.check_logprobs(Server(), 1, torch.zeros(31))
    assert report is not None and report.max_diff == 0.0 and plain.atol == 1e-4  # fp32: FP32_ATOL


def test_a_server_without_the_tokens_route_gets_no_probe_but_other_errors_are_raised() -> None:
    from grpo_core.fleet.verify import PushVerifier

    class NoScaleOut(Server):
        def prompt_logprobs(self, *a, **k):  # noqa: ANN002, ANN003
            raise VLLMRequestError('/inference/v1/generate -> HTTP 403: {"error":{"message":"Scale-out endpoints are '
                                   'disabled."}}', status=403)

    class UnknownModel(Server):
        def prompt_logprobs(self, *a, **k):  # noqa: ANN002, ANN003
            raise VLLMRequestError('/inference/v1/generate -> HTTP 404: {"error":{"message":"model run-v3 not found"}}',
                                   status=404)

    verifier = PushVerifier(VerifyConfig(), vocab_size=50)
    assert verifier.check_logprobs(NoScaleOut(), 1, torch.zeros(31)) is None and "scale-out" in verifier.skip_reason
    with pytest.raises(VLLMRequestError, match="not found"):
        PushVerifier(VerifyConfig(), vocab_size=50).check_logprobs(UnknownModel(), 1, torch.zeros(31))


def test_adapter_sync_confirms_the_base_version_of_its_session() -> None:
    pusher = WeightPusher(lambda: None, DistInfo(rank=0, world_size=1, local_rank=0), None, None, attempts=1,
                          verify=VerifyConfig(every=0), probe=None, vocab_size=50)

    class AdapterSync:
        mode = "adapter"

    pusher.sync = AdapterSync()
    assert [pusher.served_version(v) for v in (3, 4, 5)] == [3, 3, 3]  # adapters by name; the base stays at 3
    pusher.sync = None
    pusher.close()
    pusher.sync = AdapterSync()
    assert pusher.served_version(7) == 7  # a new session pushes the base again
    pusher.sync.mode = "full"
    assert pusher.served_version(8) == 8


def test_a_16_bit_servers_tolerance_follows_the_trainers_own_rounding() -> None:
    """An fp32 trainer's probe against a bf16 server: the fixed floor alone refused a server holding the right weights
    (0.42 apart on the tiny Qwen3.5-MoE as loaded, benchmarks/sync/probe_rounding.py); the measured rounding admits it, a
    single token's flip passes a check on the mean, and weights a push got wrong (nats apart) are still refused."""
    from grpo_core.fleet.verify import LOW_PRECISION_ATOL, ROUNDING_MARGIN, PushVerifier, VerifyConfig, default_atol

    assert default_atol("float32", 0.3) == 1e-4  # an fp32 server: the exact bound, whatever the rounding
    assert default_atol("bfloat16") == default_atol("bfloat16", 0.001) == LOW_PRECISION_ATOL  # the floor
    assert default_atol("bfloat16", 0.3) == pytest.approx(ROUNDING_MARGIN * 0.3)
    assert default_atol(None, 0.3) == pytest.approx(ROUNDING_MARGIN * 0.3)  # a server that does not say: 16 bits

    class Bf16Server(Server):
        def server_config(self) -> dict:
            return {"model_config": {"dtype": "torch.bfloat16"}, "device_config": {"device": "cpu"}}

    server = Bf16Server()
    server.logprob = -1.42  # the trainer's probe is -1.0 everywhere: 0.42 apart
    with pytest.raises(ServedWeightsMismatch, match="differ by 0.42 on average and up to 0.42 .tolerance 0.05 on the mean"):
        PushVerifier(VerifyConfig(), vocab_size=50).check_logprobs(server, 0, torch.full((31,), -1.0))
    measured = PushVerifier(VerifyConfig(confirm_probes=0), vocab_size=50)  # the first sequence's verdict is final
    report = measured.check_logprobs(server, 0, torch.full((31,), -1.0), rounding_gap=0.29)
    assert report.max_diff == pytest.approx(0.42) and report.tolerance == pytest.approx(ROUNDING_MARGIN * 0.29)
    server.logprob = -3.0  # later weights that the trainer itself rounds more: the tolerance follows them
    assert measured.check_logprobs(server, 1, torch.full((31,), -1.0), rounding_gap=0.5).tolerance == pytest.approx(ROUNDING_MARGIN * 0.5)
    server.logprob = -9.96  # a push that landed wrong (unpacked experts moved the probe by 8.96)
    with pytest.raises(ServedWeightsMismatch, match="differ by 8.96 on average") as refused:
        measured.check_logprobs(server, 2, torch.full((31,), -1.0), rounding_gap=0.29)
    # the bound on the mean can fail with the right weights: the message says so and names the setting
    assert "a known false alarm); weight_sync_verify_atol sets a fixed one" in str(refused.value)
    class OneFlippedToken(Bf16Server):  # one token routed to other experts by the 16-bit router: 1.8 nats on one
        def prompt_logprobs(self, token_ids, model=None, timeout=None):  # noqa: ANN001, ANN202
            return [-1.0 - 1.8] + [-1.0] * (len(token_ids) - 2)

    report = PushVerifier(VerifyConfig(), vocab_size=50).check_logprobs(OneFlippedToken(), 3, torch.full((31,), -1.0),
                                                                        rounding_gap=0.02)
    assert report.max_diff == pytest.approx(1.8) and report.mean_diff == pytest.approx(1.8 / 31)
    fixed = PushVerifier(VerifyConfig(logprob_atol=0.01), vocab_size=50)  # a set tolerance is not raised
    with pytest.raises(ServedWeightsMismatch, match="tolerance 0.01 on the largest") as refused:
        fixed.check_logprobs(server, 0, torch.full((31,), -9.96 + 0.02), rounding_gap=0.29)
    assert "false alarm" not in str(refused.value)  # the user's own bound


def test_the_pusher_hands_the_probes_rounding_to_the_check_on_every_rank() -> None:
    """The rounding is a forward, so every rank computes it at each checked push (not only rank 0, which asks the
    server), once per version however many servers check it."""
    from grpo_core.fleet.probe import VersionProbe

    forwards = []
    probe = VersionProbe(lambda ids: forwards.append("fp32") or torch.full((len(ids) - 1,), -1.0),
                         lambda ids: forwards.append("bf16") or torch.full((len(ids) - 1,), -1.2))
    probe.version = 0
    assert probe.rounding_gap([1, 2, 3]) == pytest.approx(0.2)
    assert probe.rounding_gap([1, 2, 3]) == pytest.approx(0.2) and forwards == ["fp32", "bf16"]  # once a version
    probe.version = 1
    assert probe.rounding_gap([1, 2, 3]) == pytest.approx(0.2) and forwards == ["fp32", "bf16"] * 2
    assert VersionProbe(lambda ids: torch.zeros(2)).rounding_gap([1, 2, 3]) is None  # a bf16 trainer: no second probe

    seen = {}

    class Verifier:
        token_ids = [1, 2, 3]

        def due(self, index: int) -> bool:
            return True

        def check_logprobs(self, control, version, expected, model=None, rounding_gap=None):  # noqa: ANN001, ANN202
            seen["rounding_gap"] = rounding_gap

    worker = WeightPusher(lambda: None, DistInfo(rank=1, world_size=1, local_rank=1), None, None, attempts=1,
                          verify=VerifyConfig(every=0), probe=probe, vocab_size=50)
    worker.verifier, worker.sync = Verifier(), None
    probe.version = 2
    worker._confirm(2)  # a rank without a control client computes the forwards and asks nothing
    assert seen == {} and forwards == ["fp32", "bf16"] * 3


@pytest.mark.parametrize(("dtype", "rounding_gap", "rule"), [
    ("torch.float32", 0.3, "within 0.0001 on every probe token"),
    ("torch.bfloat16", None, "within 0.05 on average"),
    ("torch.bfloat16", 0.02, "within 8x the trainer's own bf16 rounding of the probe on average, measured at each "
                             "checked version (0.02 now), at least 0.05"),
])
def test_the_start_of_run_log_states_the_rule_the_check_applies(caplog: pytest.LogCaptureFixture, dtype: str,
                                                                 rounding_gap: float | None, rule: str) -> None:
    from grpo_core.fleet.verify import PushVerifier, VerifyConfig

    class TypedServer(Server):
        def server_config(self) -> dict:
            return {"model_config": {"dtype": dtype}, "device_config": {"device": "cpu"}}

    server = TypedServer()
    server.logprob = -1.0
    with caplog.at_level("INFO", logger="grpo_core.fleet.verify"):
        PushVerifier(VerifyConfig(), vocab_size=50).check_logprobs(server, 0, torch.full((31,), -1.0),
                                                                   rounding_gap=rounding_gap)
    assert f"computes in {dtype.removeprefix('torch.')}; probe log-probs must agree {rule} (weight_sync_verify_atol)" \
        in caplog.text


class Bf16Server(Server):
    """A 16-bit server whose log-probs of each probe sequence are the trainer's plus that sequence's own offset."""

    def __init__(self, offsets: dict[int, float]):
        super().__init__()
        self.offsets = offsets  # by the sequence's first token; other sequences are served exactly
        self.asked: list[int] = []

    def server_config(self) -> dict:
        return {"model_config": {"dtype": "torch.bfloat16"}, "device_config": {"device": "cpu"}}

    def prompt_logprobs(self, token_ids: list[int], model: str | None = None, timeout: float | None = None) -> list[float]:
        self.asked.append(token_ids[0])
        return (trainer_logprobs(token_ids) + self.offsets.get(token_ids[0], 0.0)).tolist()


def trainer_logprobs(token_ids: list[int]) -> torch.Tensor:
    return -torch.tensor(token_ids[1:], dtype=torch.float64) / 50


def bf16_pusher(server: Bf16Server, monkeypatch: pytest.MonkeyPatch, dist: DistInfo | None = None,
                forwards: list | None = None, attempts: int = 1) -> WeightPusher:
    """A pusher whose trainer rounds every probe sequence by 0.02 on average (a 16-bit bound of 0.16)."""
    from grpo_core.fleet.probe import VersionProbe

    forwards = [] if forwards is None else forwards

    def full(ids: list[int]) -> torch.Tensor:
        forwards.append(("fp32", ids[0]))
        return trainer_logprobs(ids)

    def bf16(ids: list[int]) -> torch.Tensor:
        forwards.append(("bf16", ids[0]))
        return trainer_logprobs(ids) + 0.02

    class Pushed(Sync):
        def push(self, version: int) -> SyncStats:
            self.server.version = str(version)
            return SyncStats(mode=self.mode, bytes=10, seconds=0.01)

    probe = VersionProbe(full, bf16)
    probe.version = 5
    return WeightPusher(lambda: Pushed(server, {}, []), dist or DistInfo(), server, Watch(server), attempts=attempts,
                        verify=VerifyConfig(), probe=probe, vocab_size=50)


def first_tokens() -> list[int]:
    from grpo_core.fleet.verify import probe_token_ids

    return [probe_token_ids(50, 32, seed)[0] for seed in range(3)]


def test_one_probe_sequence_past_a_16_bit_bound_is_settled_by_two_more(monkeypatch: pytest.MonkeyPatch,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A bf16 server holding the right weights put one probe sequence 8-26x past the trainer's own rounding at some
    versions of the tiny hybrid's runs: the push stands when two other sequences pass, and the metrics count them."""
    first, second, third = first_tokens()
    assert len({first, second, third}) == 3  # the stand-in tells the sequences apart by their first token
    server = Bf16Server({first: 0.6})  # 0.6 on average, against 8 x 0.02
    with caplog.at_level("WARNING", logger="grpo_core.fleet.verify"):
        outcome = bf16_pusher(server, monkeypatch).push(5)
    assert server.asked == [first, second, third] and outcome.attempts == 1
    assert outcome.report.reprobes == 2 and outcome.report.mean_diff == pytest.approx(0.6)
    assert outcome.metrics(5, 0)["sync/verify_reprobes"] == 2.0
    assert "the first probe sequence failed its bound and 2 more passed theirs" in caplog.text
    assert "sequence 0: 0.6 on average" in caplog.text and "sequence 2: 0 on average" in caplog.text


@pytest.mark.parametrize("offsets", [{0: 0.6}, {1: 0.6}], ids=["every-sequence", "two-sequences"])
def test_wrong_weights_fail_the_further_sequences_too_and_every_gap_is_named(monkeypatch: pytest.MonkeyPatch,
                                                                             offsets: dict[int, float]) -> None:
    tokens = first_tokens()
    if offsets == {0: 0.6}:  # every sequence 0.6 apart: weights the push got wrong
        server = Bf16Server({t: 0.6 for t in tokens})
    else:  # the first and the second
        server = Bf16Server({tokens[0]: 0.6, tokens[1]: 0.6})
    with pytest.raises(ServedWeightsMismatch, match=r"of version 5: its log-probs of 3 probe sequences differ by "
                                                    r"sequence 0: 0.6 on average .* sequence 1: 0.6 on average") as err:
        bf16_pusher(server, monkeypatch).push(5)
    assert type(err.value) is ServedWeightsMismatch  # a verdict, not an outlier waiting to be settled


def test_an_exact_bound_gets_no_further_sequences() -> None:
    """An fp32 server (every token within 1e-4) or a bound the user set: the first sequence's verdict is final."""
    server, trainer = Server(), {"logprob": -1.0}
    p = pusher(server, trainer, [], attempts=1)
    trainer["logprob"] = -1.5
    p.make_sync = lambda: Sync(server, trainer, [], stale=True)
    p.reopen()
    with pytest.raises(ServedWeightsMismatch, match="tolerance 0.0001 on the largest") as err:
        p.push(2)
    assert type(err.value) is ServedWeightsMismatch


def test_every_rank_computes_the_further_sequences_and_only_rank_0_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's side of each further sequence is a sharded forward: a rank that asks no server computes them
    when rank 0 says the first failed (one broadcast), and nothing more when it passed."""
    import grpo_core.fleet.weight_push as weight_push

    first, second, third = first_tokens()
    said = []
    for verdict in (True, False):
        answers = [verdict, None]  # rank 0's: the first sequence failed (or not), then no failure
        monkeypatch.setattr(weight_push, "broadcast_object", lambda obj, answers=answers: said.append(obj) or answers.pop(0))
        forwards: list = []
        worker = bf16_pusher(Bf16Server({}), monkeypatch, dist=DistInfo(rank=1, world_size=2, local_rank=1),
                             forwards=forwards)
        worker.control = None  # only rank 0 talks to the server
        worker.sync = worker.open()
        assert worker._confirm(5) == (None, None)
        computed = [(kind, t) for t in ([first, second, third] if verdict else [first]) for kind in ("fp32", "bf16")]
        assert sorted(forwards) == sorted(computed)
    assert said == [None] * 4  # each time the flag, then the failure, from a rank that knows neither
