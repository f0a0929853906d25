"""The CUDA IPC push's framing on the CPU, with a stand-in for the IPC handle and for the server's engine.

``IPCTrainerWeightTransferEngine`` cuts the model into buckets, fills each flat buffer and posts it with its
names, dtypes, shapes and byte sizes. Here ``share`` hands over a copy of the buffer's bytes instead of a CUDA
IPC handle, and ``UnpackingServer`` does what vLLM's IPC engine does with a packed update (splits the buffer by
``tensor_sizes``, views each part with its dtype and shape) and records what it loaded, so every tensor that
reaches the "server" is compared with the trainer's. The GPU run (benchmarks/device/e2e_gpu.py) pushes through
the real engine.
"""

from __future__ import annotations

import base64
import pickle

import pytest
import torch

from grpo_core.sync.send.ipc_trainer import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine, bucket_update
from grpo_core.sync.source import ModelWeightSource
from grpo_core.sync.wire.buckets import plan_buckets


def copy_share(buffer: torch.Tensor) -> dict[str, tuple]:
    # The arena is reused for the next bucket as soon as the post returns: the stand-in keeps its own bytes.
    return {"GPU-standin": (buffer.clone().numpy().tobytes(),)}


class UnpackingServer:
    """The weight-transfer routes, as vLLM's IPC engine answers them for a packed update."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.loaded: dict[str, torch.Tensor] = {}
        self.finished_version: str | None = None

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.calls.append("init")
        assert init_info == {}

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, update_info: dict) -> None:
        self.calls.append("update")
        assert update_info["packed"] is True
        handle = pickle.loads(base64.b64decode(update_info["ipc_handles_pickled"]))
        (raw,) = handle["GPU-standin"]
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        assert sum(update_info["tensor_sizes"]) == flat.numel()
        offset = 0
        for name, dtype, shape, size in zip(update_info["names"], update_info["dtype_names"], update_info["shapes"],
                                            update_info["tensor_sizes"]):
            part = flat[offset : offset + size].view(getattr(torch, dtype)).reshape(shape)
            self.loaded[name] = part.clone()
            offset += size

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish")
        self.finished_version = weight_version


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 50, bias=False))


@pytest.mark.parametrize("bucket_bytes", [1, 1024, 1 << 20])
def test_every_weight_arrives_whole_in_bounded_buckets(bucket_bytes):
    model = small_model()
    source = ModelWeightSource(model, wire_dtype=torch.bfloat16)
    server = UnpackingServer()
    engine = IPCTrainerWeightTransferEngine.trainer_init(IPCTrainerInitInfo(rank=0, bucket_bytes=bucket_bytes),
                                                         client=server, source=source, share=copy_share)
    engine.next_weight_version = "7"
    engine.send_weights()
    plan = plan_buckets(source.metadata(), bucket_bytes)
    assert server.calls == ["init", "start", *["update"] * len(plan), "finish"]
    assert server.finished_version == "7"
    expected = {name: t.detach().to(torch.bfloat16) for name, t in model.named_parameters()}
    assert set(server.loaded) == set(expected)
    for name, tensor in expected.items():
        assert server.loaded[name].dtype == torch.bfloat16
        assert torch.equal(server.loaded[name], tensor), name
    assert engine.last_stats is not None and engine.last_stats.buckets == len(plan)


def test_a_second_push_carries_the_new_weights():
    model = small_model()
    source = ModelWeightSource(model)
    server = UnpackingServer()
    engine = IPCTrainerWeightTransferEngine.trainer_init(IPCTrainerInitInfo(rank=0, bucket_bytes=512), client=server,
                                                         source=source, share=copy_share)
    engine.send_weights()
    with torch.no_grad():
        model[1].weight.add_(1.0)
    engine.send_weights()
    assert torch.equal(server.loaded["1.weight"], model[1].weight.detach())


def test_update_body_is_the_packed_ipc_format():
    source = ModelWeightSource(small_model(), wire_dtype=torch.bfloat16)
    bucket = plan_buckets(source.metadata(), 1 << 30)[0]
    body = bucket_update(bucket, {"GPU-x": (1, 2)})
    assert set(body) == {"names", "dtype_names", "shapes", "tensor_sizes", "packed", "ipc_handles_pickled"}
    assert body["dtype_names"] == ["bfloat16"] * 4
    assert body["shapes"][0] == [50, 16] and body["tensor_sizes"][0] == 50 * 16 * 2
    assert pickle.loads(base64.b64decode(body["ipc_handles_pickled"])) == {"GPU-x": (1, 2)}


def test_a_rank_that_does_not_send_only_gathers():
    server = UnpackingServer()
    engine = IPCTrainerWeightTransferEngine.trainer_init(IPCTrainerInitInfo(rank=1, bucket_bytes=512), client=server,
                                                         source=ModelWeightSource(small_model()), share=copy_share)
    engine.send_weights()
    assert server.calls == []
