"""The receiving end of ``benchmarks/sync/nccl_sync.py``: a stand-in vLLM server on the last GPU.

It holds its own bf16 copy of the model (other random weights than the trainer's) and answers the
HTTP routes a vLLM server in dev mode answers for a weight sync (``/get_world_size``, ``/pause``,
``/resume``, ``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``, ``/update_weight_version``), so the trainer runs the product's
``ProtocolWeightSync`` and ``VLLMControlClient`` unchanged. Behind the routes:

* transport ``vllm``: vLLM's own ``NCCLWeightTransferEngine`` (its ``PyNcclCommunicator`` over a
  ``StatelessProcessGroup``, its packed consumer), loading into this model through ``load_weights``.
  The weight-transfer modules come from vLLM's CPU build, whose files report a CPU platform; this
  process is told it runs on CUDA (``use_cuda_platform``), which vLLM's GPU build would detect;
* transport ``torch``: the same packed format received over a ``torch.distributed`` NCCL group
  (``TorchNcclComm``, ``TorchPackedReceiver``), for machines where vLLM cannot be imported.

vLLM 0.32's NCCL wrapper also insists on two symbols of NCCL ≥ 2.29.7 that the transfer never
calls (``allow_nccl_without_suspend``); torch 2.11 ships NCCL 2.28.9.

Harness-only routes under ``/harness/``: set the packing threshold, receive broadcasts for the
bandwidth measurement, send every weight back for verification, report timings, stop.

Run by ``nccl_sync.py``; by hand: ``python3 -m benchmarks.sync.nccl_sync_receiver --port 8765 --device 1``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist


from grpo_core.sync.wire.buckets import plan_buckets  # noqa: E402

SHAPES = {  # Qwen3 dense shapes (config.json of the public checkpoints)
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True),
}


def build_model(shape: str, device: torch.device, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """A Qwen3-shaped causal LM with random weights (transformers' init, seeded), built on ``device``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**SHAPES[shape], rope_theta=1_000_000.0, max_position_embeddings=40960)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    model.config.use_cache = False
    return model.to(dtype)


def use_cuda_platform() -> None:
    """Tell vLLM's platform layer this process runs on CUDA (its CPU-build files say CPU otherwise).

    Only what the weight-transfer path reads is set: the platform kind (for vLLM's current-stream
    bookkeeping) and the device type; no kernel of the CPU build is loaded.
    """
    import vllm.platforms as platforms
    from vllm.platforms.interface import Platform, PlatformEnum

    current = platforms._current_platform
    if current is not None and current.is_cuda():
        return

    class CudaPlatform(Platform):
        _enum = PlatformEnum.CUDA
        device_name = "cuda"
        device_type = "cuda"
        dispatch_key = "CUDA"
        dist_backend = "nccl"
        device_control_env_var = "CUDA_VISIBLE_DEVICES"

    platforms._current_platform = CudaPlatform()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def current_stream(device: torch.device) -> Any:
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def allow_nccl_without_suspend() -> list[str]:
    """Let vLLM 0.32's NCCL wrapper load an NCCL older than 2.29.7; returns the symbols dropped.

    The wrapper binds ``ncclCommSuspend`` and ``ncclCommResume`` eagerly and refuses a library
    without them, although ``PyNcclCommunicator`` checks ``has_symbol`` before it uses either (to
    suspend a communicator's memory, which no weight transfer does). Those two, and only when the
    loaded library lacks them, are taken off its table; any other missing symbol still fails.
    """
    import ctypes

    from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary
    from vllm.utils.nccl import find_nccl_library

    library = ctypes.CDLL(find_nccl_library())
    dropped = [f.name for f in NCCLLibrary.exported_functions
               if f.name in ("ncclCommSuspend", "ncclCommResume") and not hasattr(library, f.name)]
    NCCLLibrary.exported_functions = [f for f in NCCLLibrary.exported_functions if f.name not in dropped]
    return dropped


class TorchNcclComm:
    """An NCCL group outside the default process group, from ``torch.distributed`` alone (gloo on the
    CPU, for ``--smoke``); offers the ``broadcast(tensor, src, stream)`` of vLLM's ``PyNcclCommunicator``."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, device: torch.device):
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timedelta(seconds=300))
        prefixed = dist.PrefixStore("weight-transfer", store)
        if device.type == "cuda":
            self.pg: Any = dist.ProcessGroupNCCL(prefixed, rank, world_size)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timedelta(seconds=300))
        self.device = device

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        if self.device.type != "cuda":
            self.pg.broadcast([tensor], opts).wait()
            return
        with torch.cuda.stream(stream or torch.cuda.current_stream(self.device)):
            self.pg.broadcast([tensor], opts).wait()  # the stream waits; the host does not

    def destroy(self) -> None:
        self.pg.shutdown()


class TorchPackedReceiver:
    """vLLM's packed NCCL receive, over ``TorchNcclComm``: buckets cut by the same rule, in order."""

    def __init__(self, model: Any, device: torch.device):
        self.model = model
        self.device = device
        self.model_update_group: TorchNcclComm | None = None
        self.packed_buffer_size_bytes = 0

    def init_transfer_engine(self, info: dict[str, Any]) -> None:
        self.packed_buffer_size_bytes = info["packed_buffer_size_bytes"]
        self.model_update_group = TorchNcclComm(info["master_address"], info["master_port"], info["rank_offset"],
                                                info["world_size"], self.device)

    def update_weights(self, info: dict[str, Any]) -> None:
        meta = [SimpleNamespace(name=n, dtype=getattr(torch, d), shape=tuple(s))
                for n, d, s in zip(info["names"], info["dtype_names"], info["shapes"])]
        for bucket in plan_buckets(meta, self.packed_buffer_size_bytes):
            buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device)
            self.model_update_group.broadcast(buffer, src=0)
            self.model.load_weights([
                (s.name, buffer[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape)) for s in bucket.slots
            ])
        synchronize(self.device)


class Applier:
    """What vLLM's engine loads into: copies each received tensor into the model, by name."""

    def __init__(self, model: torch.nn.Module):
        self.params = dict(model.named_parameters())
        self.arrived: set[str] = set()

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in weights:
                self.params[name].copy_(tensor)
                self.arrived.add(name)


class Receiver:
    """Route handlers (each returns the JSON body)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, transport: str):
        self.device = device
        self.applier = Applier(model)
        if transport == "vllm":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
            # Imported by the engine's receive; first imported under the CUDA platform it pulls in
            # vLLM's flash-attention kernels, which the CPU build lacks.
            from vllm.model_executor.model_loader import mtp_validation  # noqa: F401

            use_cuda_platform()
            allow_nccl_without_suspend()
            config = SimpleNamespace(model_config=None,
                                     parallel_config=SimpleNamespace(data_parallel_index=0, world_size=1, rank=0))
            self.engine: Any = NCCLWeightTransferEngine(None, config, device, self.applier)
        else:
            self.engine = TorchPackedReceiver(self.applier, device)
        self.names: list[str] = []
        self.timing: dict[str, float] = {}
        self.version = "default"

    @property
    def comm(self) -> Any:
        return self.engine.model_update_group

    def handle(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # each request runs on its own thread
        if route == "/get_world_size":
            return {"world_size": 1}
        if route in ("/pause", "/resume"):
            return {"status": route[1:] + "d"}
        if route == "/init_weight_transfer_engine":
            info = body["init_info"]
            if isinstance(self.engine, TorchPackedReceiver):
                self.engine.init_transfer_engine(info)
            else:
                self.engine.init_transfer_engine(self.engine.parse_init_info(info))
            return {"message": "Weight transfer initialized"}
        if route == "/start_weight_update":
            self.applier.arrived.clear()
            return {"message": "Weight update started"}
        if route == "/update_weights":
            info = body["update_info"]
            self.names = list(info["names"])
            self.timing["update_begin"] = time.perf_counter()
            self.engine.update_weights(info)
            self.timing["update_end"] = time.perf_counter()
            return {"message": "Weights updated"}
        if route == "/finish_weight_update":
            missing = set(self.names) - self.applier.arrived
            if missing:
                raise RuntimeError(f"{len(missing)} tensors never arrived, e.g. {sorted(missing)[:3]}")
            self.version = (body or {}).get("weight_version") or self.version
            return {"message": "Weight update finished"}
        if route == "/update_weight_version":
            self.version = body["new_version"]
            return {"success": True}
        if route == "/harness/packing":
            self.engine.packed_buffer_size_bytes = int(body["bytes"])
            return {}
        if route == "/harness/bandwidth":
            buffer = torch.empty(int(body["nbytes"]), dtype=torch.uint8, device=self.device)
            for _ in range(int(body["iters"])):
                self.comm.broadcast(buffer, src=0, stream=current_stream(self.device))
                synchronize(self.device)
            return {}
        if route == "/harness/verify":
            for name in self.names:  # the trainer receives them in this order and compares
                self.comm.broadcast(self.applier.params[name].data.contiguous(), src=1,
                                    stream=current_stream(self.device))
            synchronize(self.device)
            return {}
        if route == "/harness/timing":
            return dict(self.timing, arrived=len(self.applier.arrived), expected=len(self.names), version=self.version)
        raise KeyError(route)


def serve(receiver: Receiver, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = json.loads(self.rfile.read(length) or b"null") if length else None
            route = urlsplit(self.path).path
            if route == "/harness/stop":
                status, reply = 200, {}
                threading.Thread(target=server.shutdown, daemon=True).start()
            else:
                try:
                    status, reply = 200, receiver.handle(route, body or {})
                except KeyError:
                    status, reply = 404, {"error": {"message": f"no route {route}"}}
                except Exception as exc:  # noqa: BLE001 - reported as vLLM reports worker errors
                    status, reply = 500, {"error": {"message": f"{type(exc).__name__}: {exc}", "code": 500}}
                    print(f"receiver: {route} failed: {exc!r}", file=sys.stderr, flush=True)
            data = json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _answer

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    return server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--device", type=int, required=True, help="GPU index; -1: the CPU (--smoke)")
    ap.add_argument("--transport", choices=("vllm", "torch"), required=True)
    ap.add_argument("--model", default="qwen3-1.7b")
    ap.add_argument("--model-path", help="load this saved model (bf16) instead of a random --model shape")
    args = ap.parse_args()
    device = torch.device("cuda", args.device) if args.device >= 0 else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.model_path:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.bfloat16).to(device)
    else:
        model = build_model(args.model, device, torch.bfloat16, seed=1)
    server = serve(Receiver(model, device, args.transport), args.port)
    print(f"receiver ready on port {args.port}, GPU {args.device}, transport {args.transport}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
