"""The gloo transfer in one process (the server's worker engine loading into a dict): delta pushes,
deadlines, a receiver that stops, a delta for weights the receiver does not hold."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from grpo_core.sync.errors import WeightSyncError, WeightSyncTimeout
from grpo_core.sync.protocol import ProtocolWeightSync
from grpo_core.sync.source import ModelWeightSource
from grpo_core.sync.timing.deadline import DeadlineConfig


class FakeServer:
    """The HTTP routes of a vLLM server as the trainer engine calls them, with the real worker engine
    behind them; ``stall`` makes ``/update_weights`` hang without receiving (a stopped worker)."""

    base_url = "http://127.0.0.1:9"

    def __init__(self):
        from grpo_core.vllm_plugin.gloo_engine import GlooWeightTransferEngine

        self.loaded: dict[str, torch.Tensor] = {}
        model = SimpleNamespace(load_weights=lambda weights: self.loaded.update((n, t.clone()) for n, t in weights))
        config = SimpleNamespace(model_config=None, parallel_config=SimpleNamespace(data_parallel_index=0, world_size=1, rank=0))
        self.engine = GlooWeightTransferEngine(None, config, torch.device("cpu"), model)
        self.infos: list[dict] = []
        self.version: str | None = None
        self.stall = threading.Event()
        self.released = threading.Event()

    def world_size(self) -> int:
        return 1

    def pause(self, mode: str = "keep", clear_cache: bool = True, timeout: float | None = None) -> None:
        pass

    def resume(self, timeout: float | None = None) -> None:
        pass

    def init_weight_transfer_engine(self, init_info: dict, timeout: float | None = None) -> None:
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def start_weight_update(self, timeout: float | None = None) -> None:
        pass

    def update_weights(self, update_info: dict, timeout: float | None = None) -> None:
        self.infos.append(update_info)
        if self.stall.is_set():
            self.released.wait(30)
            raise RuntimeError("the worker was stopped")
        self.engine.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None, timeout: float | None = None) -> None:
        self.version = weight_version


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(300, 16), torch.nn.Linear(16, 40), torch.nn.LayerNorm(40))


def push(sync: ProtocolWeightSync, version: int) -> None:
    done: list[BaseException | None] = []

    def run():
        try:
            sync.push(version)
            done.append(None)
        except BaseException as err:  # noqa: BLE001
            done.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    assert done, "the push did not return"
    if done[0] is not None:
        raise done[0]


def test_delta_pushes_leave_the_receiver_with_the_trainers_bf16_weights_and_move_fewer_bytes():
    model = tiny_model()
    server = FakeServer()
    sync = ProtocolWeightSync(server, ModelWeightSource(model, wire_dtype=torch.bfloat16), backend="gloo",
                              bucket_bytes=4096, encoding="delta")
    try:
        sizes = []
        for version in range(4):
            if version:
                with torch.no_grad():
                    model[0].weight[version * 7] += 0.5  # one embedding row
                    model[1].bias.add_(1e-5)  # below half a bf16 step of most biases: mostly no change
            push(sync, version)
            stats = sync.engine.last_delta
            sizes.append(stats.wire_bytes)
            for name, p in model.state_dict().items():
                assert torch.equal(server.loaded[name], p.to(torch.bfloat16)), (version, name)
        encodings = [i["encoding"] for i in server.infos]
        assert encodings == ["dense", "delta", "delta", "delta"]
        assert server.infos[2]["base_version"] == "1" and server.engine.held.version == "3"
        assert max(sizes[1:]) < sizes[0] / 10, sizes
    finally:
        sync.close()
        server.engine.shutdown()


def test_a_delta_for_weights_the_receiver_does_not_hold_is_refused_by_name():
    model = tiny_model()
    server = FakeServer()
    sync = ProtocolWeightSync(server, ModelWeightSource(model), backend="gloo", encoding="delta",
                              deadline=DeadlineConfig(floor_s=5.0))
    try:
        push(sync, 0)
        server.engine.held.version = "7"  # as if something else had moved the server's weights
        with pytest.raises(WeightSyncError, match=r"phase '(update|transfer)'.*version 1.*applies to weight version '0', "
                                                  r"this server holds '7'"):
            push(sync, 1)
        assert sync.engine is None  # the session is torn down; the caller makes a new one
    finally:
        sync.close()
        server.engine.shutdown()


def test_a_receiver_that_stops_mid_push_ends_in_a_named_timeout_within_the_deadline():
    model = tiny_model()
    server = FakeServer()
    deadline = DeadlineConfig(floor_s=2.0, slack=4.0)
    sync = ProtocolWeightSync(server, ModelWeightSource(model), backend="gloo", bucket_bytes=2048, deadline=deadline)
    try:
        push(sync, 0)
        server.stall.set()
        start = time.monotonic()
        with pytest.raises(WeightSyncTimeout) as info:
            push(sync, 1)
        waited = time.monotonic() - start
        err = info.value
        assert err.server == FakeServer.base_url and err.version == 1 and err.phase in ("transfer", "update")
        assert f"phase '{err.phase}' of the push of version 1 passed its deadline of 2.0 s = max(floor 2 s" in str(err)
        assert waited < 2.0 + 2.0, waited  # the deadline, the walk over the remaining buckets, the teardown
        assert sync.engine is None
    finally:
        server.released.set()
        sync.close()
        server.engine.shutdown()


def test_a_server_fed_through_storage_patches_holds_the_trainers_weights_and_says_so(tmp_path):
    from grpo_core.sync.errors import ServedWeightsMismatch
    from grpo_core.sync.storage_sync import PatchPublisher, StoragePatchSync

    model = tiny_model()
    server = FakeServer()
    publisher = PatchPublisher(ModelWeightSource(model, wire_dtype=torch.bfloat16), str(tmp_path / "patches"), rank=0,
                               bucket_bytes=4096, keyframe_every=4)
    sync = StoragePatchSync(server, publisher)
    shares = []
    for version in range(7):
        if version:
            with torch.no_grad():
                model[0].weight[version] += 1.0
        stats = sync.push(version)
        shares.append(stats.changed_share)
        sync.check_applied(version)
        for name, p in model.state_dict().items():
            assert torch.equal(server.loaded[name], p.to(torch.bfloat16)), (version, name)
    assert shares[0] is None and shares[4] is None  # keyframes
    assert all(0 < s < 0.05 for i, s in enumerate(shares) if i not in (0, 4)), shares
    # A server whose copy went astray after the push is named by the receipt check.
    receipt = tmp_path / "patches" / "receipts" / sync.receipt_key / "v0000000006-w0.json"
    receipt.write_text(receipt.read_text().replace('"0.weight": "', '"0.weight": "0'))
    with pytest.raises(ServedWeightsMismatch, match=r"at http://127.0.0.1:9 holds other weights than the trainer's "
                                                    r"version 6: 1 of 5 tensors differ \(0.weight\)"):
        sync.check_applied(6)
    # A server that restarted (holds nothing) catches up from the newest keyframe.
    server.engine.held.clear()
    server.loaded.clear()
    sync.push(6)
    assert json_chain(receipt) == [4, 5, 6]


def json_chain(path) -> list[int]:
    import json

    return json.loads(path.read_text())["chain"]
