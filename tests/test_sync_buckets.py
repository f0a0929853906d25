"""Bucketed weight sync on the CPU: the bucket cut, the one-collective gather, the gloo wire.

* ``plan_buckets`` cuts where vLLM's packed NCCL format cuts (checked against vLLM's own packer);
* ``send_buckets`` over 2 gloo ranks with FSDP2 fills each bucket with every full tensor, cast, in
  one all-gather per bucket, also for tensors whose rows do not split evenly (a rank holding none);
* the gloo engine sends 2 FSDP2 ranks' weights in several buckets to an in-process receiver that
  gets every tensor exactly, and ``ProtocolWeightSync`` resolves the rendezvous address from the
  server URL (a server on 127.0.0.2) and keeps to a port range.

Run: ``.venv/bin/python -m pytest tests/test_sync_buckets.py``.
"""

from __future__ import annotations

import json
import os
import random
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from grpo_core.sync.send.bucket_stream import local_tensors, send_buckets
from grpo_core.sync.wire.buckets import plan_buckets, tensor_nbytes, update_info
from grpo_core.vllm_server.process import free_port
from tests.child_processes import run_ranks


def _meta(shapes, dtype=torch.bfloat16):
    return [SimpleNamespace(name=f"p{i}", dtype=dtype, shape=tuple(s)) for i, s in enumerate(shapes)]


@pytest.mark.parametrize("seed", range(6))
def test_buckets_cut_where_vllms_packer_cuts(seed):
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    rng = random.Random(seed)
    shapes = [(rng.randint(1, 40), rng.randint(1, 9)) for _ in range(rng.randint(1, 30))]
    meta = _meta(shapes)
    threshold = rng.choice([1, 16, 64, 200, 1000, 10**6])
    # A threshold hit exactly does not close a bucket (vLLM closes only past it).
    if seed == 0:
        threshold = tensor_nbytes(torch.bfloat16, shapes[0])
    tensors = iter([(m.name, torch.zeros(m.shape, dtype=m.dtype)) for m in meta])
    vllm_cuts = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vLLM warns of every tensor larger than the threshold
        while (chunk := pack_tensors(tensors, lambda item: item[1], threshold)) is not None:
            vllm_cuts.append(chunk.names)
    plan = plan_buckets(meta, threshold)
    assert [b.names for b in plan] == vllm_cuts
    assert all(b.nbytes == sum(s.nbytes for s in b.slots) for b in plan)
    assert [b.first for b in plan] == [sum(len(c) for c in vllm_cuts[:i]) for i in range(len(vllm_cuts))]


def test_update_info_is_what_vllms_receiver_parses():
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    info = update_info(_meta([(3, 4), (5,)]))
    parsed = NCCLWeightTransferUpdateInfo(**info)
    assert parsed.dtype_names == ["bfloat16", "bfloat16"] and parsed.shapes == [[3, 4], [5]]


def test_a_single_rank_fills_buckets_in_order_and_cast():
    torch.manual_seed(0)
    tensors = [("a", torch.randn(3, 4)), ("b", torch.randn(5)), ("c", torch.randn(2, 2, 2)), ("d", torch.randn(()))]
    meta = [SimpleNamespace(name=n, dtype=torch.bfloat16, shape=tuple(t.shape)) for n, t in tensors]
    plan = plan_buckets(meta, 20)
    sent = []
    stats = send_buckets(plan, iter(tensors), lambda buf: sent.append(buf.clone()), torch.device("cpu"))
    assert len(sent) == len(plan) == stats.buckets > 1
    flat = torch.cat([t.bfloat16().reshape(-1).view(torch.uint8) for _, t in tensors])
    assert torch.equal(torch.cat(sent), flat)
    assert stats.bytes == flat.numel() and stats.collectives == 0 and stats.scratch_bytes == 0


def test_a_source_that_disagrees_with_its_metadata_is_named():
    meta = _meta([(2,), (2,)])
    with pytest.raises(RuntimeError, match="'p1'.*'x'|'x'.*'p1'"):
        send_buckets(plan_buckets(meta, 100), iter([("p0", torch.zeros(2)), ("x", torch.zeros(2))]), None, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="more tensors"):
        tensors = iter([("p0", torch.zeros(2)), ("p1", torch.zeros(2)), ("p2", torch.zeros(2))])
        send_buckets(plan_buckets(meta, 100), tensors, None, torch.device("cpu"))


# ------------------------------------------------------------------------------------------ two ranks
class _Odd(torch.nn.Module):
    """Rows that split unevenly over 2 ranks (3 → 2+1, 1 → 1+0) next to even ones."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, n) for n in (3, 4, 1))
        self.norm = torch.nn.Parameter(torch.randn(1, 4))


def _build(shard: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _Odd()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    if shard:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, full


class _Receiver:
    """The server side of the gloo transfer, in rank 0's process: vLLM's worker engine as the plugin
    registers it, loading into a dict."""

    def __init__(self, base_url: str):
        from grpo_core.vllm_plugin.gloo_engine import GlooWeightTransferEngine

        self.base_url = base_url
        self.received: dict[str, torch.Tensor] = {}
        model = SimpleNamespace(load_weights=lambda weights: self.received.update((n, t.clone()) for n, t in weights))
        config = SimpleNamespace(model_config=None, parallel_config=SimpleNamespace(data_parallel_index=0, world_size=1, rank=0))
        self.engine = GlooWeightTransferEngine(None, config, torch.device("cpu"), model)
        self.calls: list[tuple[str, object]] = []

    def world_size(self) -> int:
        return 1

    def pause(self, mode: str = "keep", clear_cache: bool = True, timeout: float | None = None) -> None:
        self.calls.append(("pause", mode))

    def resume(self, timeout: float | None = None) -> None:
        self.calls.append(("resume", None))

    def init_weight_transfer_engine(self, init_info: dict, timeout: float | None = None) -> None:
        self.calls.append(("init", init_info))
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def start_weight_update(self, timeout: float | None = None) -> None:
        pass  # the layerwise-reload bookkeeping needs a vLLM model; not what is checked here

    def update_weights(self, update_info: dict, timeout: float | None = None) -> None:
        self.calls.append(("update", update_info))
        self.engine.update_weights(update_info)

    def finish_weight_update(self, weight_version=None, timeout: float | None = None) -> None:
        self.calls.append(("finish", weight_version))


def _two_rank_checks(rank: int, port: int, out_dir: str) -> None:
    from grpo_core.sync.protocol import ProtocolWeightSync
    from grpo_core.sync.source import ModelWeightSource

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    report: dict = {}
    model, full = _build(shard=True)
    for dtype in (torch.bfloat16, None):
        source = ModelWeightSource(model, wire_dtype=dtype)
        plan = plan_buckets(source.metadata(), 60)
        sent: list[torch.Tensor] = []
        send = (lambda buf: sent.append(buf.clone())) if rank == 0 else None
        stats = send_buckets(plan, local_tensors(source), send, torch.device("cpu"))
        if rank == 0:
            expected = torch.cat([t.to(dtype or t.dtype).reshape(-1).view(torch.uint8) for t in full.values()])
            report[f"flat_equal_{dtype}"] = torch.equal(torch.cat(sent), expected)
            report[f"buckets_{dtype}"] = len(plan)
            report[f"collectives_{dtype}"] = stats.collectives
            report[f"sizes_match_{dtype}"] = [b.numel() for b in sent] == [b.nbytes for b in plan]

    # The gloo engine end to end: several buckets, the server "on" 127.0.0.2, a port range.
    receiver = _Receiver("http://127.0.0.2:1") if rank == 0 else None
    lo = 20000 + port % 20000
    sync = ProtocolWeightSync(receiver, ModelWeightSource(model), backend="gloo", rank=rank,
                              port_range=(lo, lo + 50), bucket_bytes=60)
    sync.push(7)
    dist.barrier()
    if rank == 0:
        init = next(info for call, info in receiver.calls if call == "init")
        update = next(info for call, info in receiver.calls if call == "update")
        report["init_address"] = init["master_address"]
        report["init_port_in_range"] = lo <= init["master_port"] <= lo + 50
        report["group_sizes"] = update["group_sizes"]
        report["received_exact"] = set(receiver.received) == set(full) and all(
            torch.equal(receiver.received[n], full[n]) for n in full
        )
        report["finish_version"] = [v for call, v in receiver.calls if call == "finish"]
        report["paused_then_resumed"] = [c for c, _ in receiver.calls if c in ("pause", "resume")]
        report["bytes_sent"] = sync.engine.bytes_sent
        report["full_bytes"] = sum(t.numel() * t.element_size() for t in full.values())
        receiver.engine.shutdown()
        with open(os.path.join(out_dir, "report.json"), "w") as f:
            json.dump(report, f)
    sync.close()
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_report(tmp_path_factory) -> dict:
    out_dir = str(tmp_path_factory.mktemp("buckets"))
    run_ranks(_two_rank_checks, (free_port(), out_dir), nprocs=2)
    with open(os.path.join(out_dir, "report.json")) as f:
        return json.load(f)


def test_two_fsdp_ranks_fill_each_bucket_exactly_with_one_gather_per_bucket(two_rank_report):
    for dtype in ("torch.bfloat16", "None"):
        assert two_rank_report[f"flat_equal_{dtype}"], dtype
        assert two_rank_report[f"sizes_match_{dtype}"], dtype
        assert two_rank_report[f"buckets_{dtype}"] > 2
        # Every bucket here holds sharded tensors, so one all-gather each, never one per tensor.
        assert two_rank_report[f"collectives_{dtype}"] == two_rank_report[f"buckets_{dtype}"]


def test_the_gloo_engine_sends_sharded_weights_in_buckets_exactly(two_rank_report):
    r = two_rank_report
    assert r["received_exact"]
    assert len(r["group_sizes"]) > 2 and sum(r["group_sizes"]) == 8
    assert r["bytes_sent"] == r["full_bytes"]
    assert r["finish_version"] == ["7"] and r["paused_then_resumed"] == ["pause", "resume"]


def test_the_rendezvous_is_offered_where_the_server_can_dial_it(two_rank_report):
    assert two_rank_report["init_address"] == "127.0.0.1"  # lo's address, the route to 127.0.0.2
    assert two_rank_report["init_port_in_range"]


def test_the_double_buffer_arena_holds_any_two_consecutive_buckets():
    from grpo_core.sync.send.bucket_stream import arena_bytes

    plan = plan_buckets(_meta([(300,), (10,), (100,), (120,)]), 150)  # buckets of 600, 220, 240 bytes
    assert [b.nbytes for b in plan] == [600, 220, 240]
    # Not 2 × 600: the lone large tensor shares the arena with the smaller bucket beside it.
    assert arena_bytes(plan) == 820
    assert arena_bytes(plan[:1]) == 600


def test_the_nccl_sender_puts_vllms_own_packed_chunks_on_the_wire():
    """Byte for byte what vLLM's packer makes of the same weights, with the update info and calls of
    vLLM's protocol (the communicator is a recorder: NCCL needs GPUs)."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    from grpo_core.sync.send.nccl_trainer import BucketedNCCLTrainerEngine
    from grpo_core.sync.source import ModelWeightSource

    torch.manual_seed(0)
    model = _Odd()
    source = ModelWeightSource(model, wire_dtype=torch.bfloat16)
    calls: list[tuple[str, object]] = []
    client = SimpleNamespace(
        start_weight_update=lambda: calls.append(("start", None)),
        update_weights=lambda info: calls.append(("update", info)),
        finish_weight_update=lambda version=None: calls.append(("finish", version)),
    )
    wire: list[torch.Tensor] = []
    engine = BucketedNCCLTrainerEngine(client=client, source=source, bucket_bytes=40)
    engine.comm = SimpleNamespace(broadcast=lambda t, src, stream=None: wire.append(t.clone()))
    engine.next_weight_version = "3"
    engine.send_weights()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected, tensors = [], iter(source)
        while (chunk := pack_tensors(tensors, lambda item: item[1], 40)) is not None:
            expected.append(chunk.packed_tensor)
    assert len(wire) == len(expected) > 2
    assert all(torch.equal(a, b) for a, b in zip(wire, expected))
    assert [c for c, _ in calls] == ["start", "update", "finish"] and calls[-1][1] == "3"
    info = NCCLWeightTransferUpdateInfo(**calls[1][1])
    assert info.names == [m.name for m in source.metadata()] and set(info.dtype_names) == {"bfloat16"}
