"""Full-weight sync over NCCL between GPUs: the trainer's bucketed sender against a receiver on the last GPU.

The trainer (ranks 0..N-1 under ``torchrun``, FSDP2 on GPUs 0..N-1, a Qwen3-1.7B-shaped policy with
fp32 master weights and bf16 compute, random weights) pushes its weights in bf16 to a stand-in vLLM
server on the last GPU (``nccl_sync_receiver.py``), which applies what arrives to its own bf16 copy of
the model. Through the product's own path: ``ProtocolWeightSync`` → ``BucketedNCCLTrainerEngine`` →
vLLM's ``PyNcclCommunicator``, with the rendezvous address resolved from the server's URL and a port
from a port range; the receiver runs vLLM's ``NCCLWeightTransferEngine``. Where vLLM cannot be imported,
``--transport torch`` runs the same wire format and the same sender code (``packed_send.send_packed``)
over a ``torch.distributed`` NCCL group, and the results say so.

Measured in one run, per variant (medians over ``--repeats`` syncs after one warm-up; the weights are
perturbed before every sync, so each sync carries new values):

* ``bucketed:MB``: this project's sender with that bucket threshold; ``per_param`` the same sender
  with one tensor per bucket (one gather and one broadcast per parameter); ``vllm_engine:MB`` vLLM's
  own trainer engine (``full_tensor()`` per parameter, packed) on the same communicator; ``push:MB``
  a whole ``ProtocolWeightSync.push`` (pause, sync, resume);
* ``transfer_s``: gather + send + receive + apply, from the moment the trainer sends
  ``/update_weights`` to the moment the receiver has applied the last tensor (its clock: the same
  host's monotonic clock); ``sync_s``: the engine's whole ``send_weights`` (``/start_weight_update``
  to the answer of ``/finish_weight_update``, every HTTP round trip of the protocol included);
  ``host_s``: the trainer's host time to enqueue all gathers and sends;
* bytes, the NCCL broadcast bandwidth between the trainer's GPU 0 and the receiver's GPU measured
  in the same run (a plain broadcast of a buffer as large as the model's wire bytes), the ideal time
  bytes / bandwidth and the ratio transfer_s / ideal; the peak extra GPU memory of the sync on rank 0
  (measured, and the sender's own plan);
* after every sync, off the clock: every tensor the receiver holds equals the trainer's full weights
  cast to bf16, exactly (the receiver broadcasts each one back and rank 0 compares).

Command (2 GPUs: one trainer rank, then two trainer ranks with the receiver sharing GPU 1)::

    python3 -m benchmarks.sync.nccl_sync --trainer-ranks 1,2 --out benchmarks/results/nccl_sync.json

``--model tiny --repeats 1`` checks the script quickly on any 2 GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Iterator

import httpx
import torch
import torch.distributed as dist


from grpo_core.sync.send.bucket_stream import TransferStats  # noqa: E402
from grpo_core.sync.send.packed_send import send_packed  # noqa: E402
from grpo_core.sync.wire.address import choose_port, parse_port_range, rendezvous_address  # noqa: E402
from benchmarks.sync.nccl_sync_receiver import (  # noqa: E402
    TorchNcclComm,
    allow_nccl_without_suspend,
    build_model,
    current_stream,
    synchronize,
    use_cuda_platform,
)
from benchmarks.bench_io import ROOT, write_report  # noqa: E402

MB = 2**20


def probe_vllm(shim: dict) -> str | None:
    """None when vLLM's NCCL transfer classes import here and its NCCL wrapper loads NCCL, else why not.
    ``shim`` receives what had to be adjusted for that (``allow_nccl_without_suspend``)."""
    try:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator  # noqa: F401
        from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary
        from vllm.distributed.utils import StatelessProcessGroup  # noqa: F401
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine  # noqa: F401
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - the reason is the result
        return f"import: {type(exc).__name__}: {exc}"
    if torch.cuda.is_available():
        try:
            use_cuda_platform()
            try:
                NCCLLibrary()
            except AttributeError as exc:
                shim["first_error"] = f"{type(exc).__name__}: {exc}"
                shim["nccl_symbols_dropped"] = allow_nccl_without_suspend()
                # PyNcclCommunicator silently disables itself when this fails (its broadcasts do nothing).
                NCCLLibrary()
        except Exception as exc:  # noqa: BLE001
            return f"vLLM's NCCL wrapper: {type(exc).__name__}: {exc}"
    return None


# ------------------------------------------------------------------------------------------ trainer
class HarnessSource:
    """The trainer's weights for ``--transport torch`` (vLLM's ``WeightSource`` does not import there):
    the same two channels as ``ModelWeightSource``, bf16 on the wire."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def metadata(self) -> list[Any]:
        from types import SimpleNamespace

        return [SimpleNamespace(name=n, dtype=torch.bfloat16, shape=tuple(p.shape)) for n, p in self.module.named_parameters()]

    def iter_local(self):
        return ((n, p.detach()) for n, p in self.module.named_parameters())

    def __iter__(self):
        for name, param in self.module.named_parameters():
            full = param.detach()
            full = full.full_tensor() if hasattr(full, "full_tensor") else full
            yield name, full.to(torch.bfloat16)


class TorchSender:
    """``BucketedNCCLTrainerEngine`` without vLLM: the same init handshake and ``send_packed``."""

    def __init__(self, control: Any, source: HarnessSource, rank: int, port_range, bucket_bytes: int, device):
        self.control, self.source, self.bucket_bytes, self.comm = control, source, bucket_bytes, None
        self.last_stats: TransferStats | None = None
        if rank != 0:
            return
        address = rendezvous_address(control.base_url)
        port = choose_port(address, port_range)
        info = dict(master_address=address, master_port=port, rank_offset=1, world_size=2, packed=True,
                    packed_buffer_size_bytes=bucket_bytes, packed_num_buffers=2)
        pending = _in_thread(control.init_weight_transfer_engine, info)
        self.comm = TorchNcclComm(address, port, 0, 2, device)
        pending.join_result()

    def send_weights(self) -> None:
        self.last_stats = send_packed(self.control, self.source, self.comm, self.bucket_bytes)


class TimedClient:
    """The control client, noting when ``/update_weights`` is sent (the transfer's start)."""

    def __init__(self, client: Any):
        self.client, self.update_sent = client, 0.0

    def update_weights(self, update_info: Any, timeout: float | None = None) -> None:
        self.update_sent = time.perf_counter()
        self.client.update_weights(update_info, timeout=timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


class _in_thread(threading.Thread):
    """Runs ``fn(*args, **kwargs)`` on a thread at once; ``join_result`` returns or raises what it did."""

    def __init__(self, fn, *args, **kwargs):
        super().__init__(daemon=True)
        self.fn, self.args, self.kwargs, self.error, self.value = fn, args, kwargs, None, None
        self.start()

    def run(self) -> None:
        try:
            self.value = self.fn(*self.args, **self.kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in join_result
            self.error = exc

    def join_result(self):
        self.join()
        if self.error is not None:
            raise self.error
        return self.value


def perturb(model: torch.nn.Module) -> None:
    """Change every weight a little (an optimizer step's worth), shard by shard."""
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.add_(torch.randn_like(local), alpha=1e-3)


def verify(source: Any, comm: Any, url: str | None) -> tuple[bool, int]:
    """Every tensor the receiver holds equals the trainer's full weight in bf16 (all ranks iterate)."""
    pending = _in_thread(httpx.post, f"{url}/harness/verify", timeout=600) if url else None
    equal, count = True, 0
    for _name, full in source:
        if comm is not None:
            got = torch.empty_like(full)
            comm.broadcast(got, src=1, stream=current_stream(got.device))
            equal &= torch.equal(got, full)
            count += 1
    if pending is not None:
        pending.join_result().raise_for_status()
    return equal, count


def bandwidth(comm: Any, url: str, nbytes: int, iters: int, device: torch.device) -> list[float]:
    """Seconds per plain broadcast of ``nbytes`` from this GPU to the receiver's (the first is warm-up)."""
    buffer = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    pending = _in_thread(httpx.post, f"{url}/harness/bandwidth", json={"nbytes": nbytes, "iters": iters + 1}, timeout=600)
    times = []
    for _ in range(iters + 1):
        synchronize(device)
        start = time.perf_counter()
        comm.broadcast(buffer, src=0, stream=current_stream(device))
        synchronize(device)
        times.append(time.perf_counter() - start)
    pending.join_result().raise_for_status()
    return times[1:]


def run_trainer(args) -> None:
    from grpo_core.models.fsdp import FSDPSettings, shard_policy
    from grpo_core.vllm_server.control import VLLMControlClient

    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if args.smoke:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    model = build_model(args.model, device, torch.float32, seed=0)
    # fp32 master weights, bf16 compute, as the trainer runs on GPUs (the CPU smoke test: fp32 only)
    shard_policy(model, FSDPSettings(bf16=not args.smoke), device)
    control = TimedClient(VLLMControlClient(args.receiver_url)) if rank == 0 else None
    url = args.receiver_url if rank == 0 else None
    port_range = parse_port_range(args.port_range)
    default_bytes = int(args.default_bucket_mb * MB)
    if args.transport == "vllm":
        from grpo_core.sync.protocol import ProtocolWeightSync
        from grpo_core.sync.source import ModelWeightSource

        use_cuda_platform()
        allow_nccl_without_suspend()
        source: Any = ModelWeightSource(model, wire_dtype=torch.bfloat16)
        sync = ProtocolWeightSync(control, source, backend="nccl", rank=rank, port_range=port_range,
                                  bucket_bytes=default_bytes)
        sender, comm = sync.engine, sync.engine.comm
    else:
        source = HarnessSource(model)
        sync = None
        sender = TorchSender(control, source, rank, port_range, default_bytes, device)
        comm = sender.comm
    wire_bytes = sum(m.dtype.itemsize * _numel(m.shape) for m in source.metadata())
    report: dict[str, Any] = {"world_size": dist.get_world_size(), "wire_bytes": wire_bytes, "variants": {}}
    if rank == 0:
        report["rendezvous"] = {"address": getattr(sync, "master_address", None) or rendezvous_address(args.receiver_url)}
        times = bandwidth(comm, url, wire_bytes, args.bw_iters, device)
        bw = wire_bytes / statistics.median(times)
        report["bandwidth"] = {"bytes": wire_bytes, "times_s": times, "bytes_per_s": bw}
        print(f"NCCL broadcast GPU0 -> receiver: {bw / 1e9:.1f} GB/s over {wire_bytes / 1e9:.2f} GB", flush=True)
    dist.barrier()
    for variant in args.variants.split(","):
        kind, _, size = variant.partition(":")
        bucket = 1 if kind == "per_param" else int(float(size or args.default_bucket_mb) * MB)
        if rank == 0:
            httpx.post(f"{url}/harness/packing", json={"bytes": bucket}, timeout=60).raise_for_status()
        run = _variant_runner(kind, bucket, sender, sync, control, source, rank, comm)
        rows = []
        for rep in range(args.warmup + args.repeats):
            perturb(model)
            synchronize(device)
            dist.barrier()
            cuda = device.type == "cuda"
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device) if cuda else 0
            start = time.perf_counter()
            stats = run()
            seconds = time.perf_counter() - start
            peak = torch.cuda.max_memory_allocated(device) - base if cuda else 0
            row = {"sync_s": seconds, "peak_extra_bytes": peak}
            if rank == 0:
                timing = httpx.get(f"{url}/harness/timing", timeout=60).json()
                row["recv_done_s"] = timing["update_end"] - start
                # gather + send + receive + apply, from the moment /update_weights is sent
                row["transfer_s"] = timing["update_end"] - control.update_sent
                row["arrived"], row["expected"] = timing["arrived"], timing["expected"]
            if stats is not None:
                row.update(buckets=stats.buckets, bytes=stats.bytes, planned_extra_bytes=stats.extra_bytes,
                           collectives=stats.collectives, host_s=stats.host_s)
            dist.barrier()
            row["equal"], row["verified_tensors"] = verify(source, comm, url)
            if rep >= args.warmup:
                rows.append(row)
        if rank == 0:
            report["variants"][variant] = _summarise(rows, report)
            print(variant, json.dumps({k: v for k, v in report["variants"][variant].items() if k != "runs"}), flush=True)
    if rank == 0:
        write_report(args.out, report, announce=False)
    dist.barrier()
    if sync is not None:
        sync.close()
    dist.destroy_process_group()


def _variant_runner(kind: str, bucket: int, sender: Any, sync: Any, control: Any, source: Any, rank: int, comm: Any):
    if kind in ("bucketed", "per_param"):
        def run():
            sender.bucket_bytes = bucket
            sender.send_weights()
            return sender.last_stats
        return run
    if kind == "push":
        def run():
            sender.bucket_bytes = bucket
            sync.push(1)
            return sender.last_stats
        return run
    if kind == "vllm_engine":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

        engine = NCCLTrainerWeightTransferEngine(client=control, source=source, is_sender=rank == 0, packed=True,
                                                 packed_buffer_size_bytes=bucket, packed_num_buffers=2)
        engine.model_update_group = comm  # the same communicator, opened once by the product's engine

        def run():
            engine.send_weights()
        return run
    raise ValueError(f"unknown variant {kind!r}")


def _summarise(rows: list[dict], report: dict) -> dict:
    med = lambda key: statistics.median(r[key] for r in rows) if rows and key in rows[0] else None  # noqa: E731
    out = {"runs": rows, "sync_s": med("sync_s"), "recv_done_s": med("recv_done_s"),
           "transfer_s": med("transfer_s"), "host_s": med("host_s"),
           "peak_extra_bytes": max(r["peak_extra_bytes"] for r in rows),
           "planned_extra_bytes": rows[0].get("planned_extra_bytes"), "buckets": rows[0].get("buckets"),
           "collectives": rows[0].get("collectives"),
           "all_equal": all(r["equal"] for r in rows), "verified_tensors": rows[0]["verified_tensors"],
           "all_arrived": all(r["arrived"] == r["expected"] for r in rows)}
    bw = report.get("bandwidth", {}).get("bytes_per_s")
    if bw:
        ideal = report["wire_bytes"] / bw
        out.update(ideal_s=ideal, ratio=out["transfer_s"] / ideal, ratio_sync=out["sync_s"] / ideal)
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# ------------------------------------------------------------------------------------------ launcher
def launch(args) -> None:
    shim: dict[str, Any] = {}
    why_not = probe_vllm(shim)
    transport = args.transport if args.transport != "auto" else ("vllm" if why_not is None else "torch")
    if args.smoke:
        transport, args.model = "torch", "tiny"
    print(f"transport: {transport}" + (f" (vLLM classes did not import: {why_not})" if why_not else ""), flush=True)
    if transport == "torch":  # these two run vLLM's trainer engine and ProtocolWeightSync
        args.variants = ",".join(v for v in args.variants.split(",") if v.split(":")[0] not in ("vllm_engine", "push"))
    gpus = torch.cuda.device_count()
    combined: dict[str, Any] = {
        "env": {"torch": torch.__version__, "python": platform.python_version(), "gpus": gpus,
                "device": torch.cuda.get_device_name(0) if gpus else "cpu",
                "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpus else None},
        "transport": transport, "vllm_unusable": why_not, "vllm_shim": shim, "command": " ".join(sys.argv),
        "runs": {}}
    for n in (int(x) for x in args.trainer_ranks.split(",")):
        receiver_gpu = gpus - 1 if not args.smoke else -1
        with running_receiver("--device", str(receiver_gpu), "--transport", transport, "--model", args.model) as url:
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
                out = tmp.name
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                   "-m", "benchmarks.sync.nccl_sync", "--role", "trainer", "--receiver-url", url, "--transport", transport,
                   "--out", out] + _passthrough(args)
            try:
                subprocess.run(cmd, check=True, timeout=args.timeout, cwd=ROOT)
                with open(out) as f:
                    run = json.load(f)
            except (subprocess.SubprocessError, OSError, ValueError) as exc:
                run = {"error": f"{type(exc).__name__}: {exc}"}  # the next rank count still runs
            run["trainer_gpus"], run["receiver_gpu"] = list(range(n)), receiver_gpu
            combined["runs"][f"trainer_ranks_{n}"] = run
        write_report(args.out, combined, announce=False)
    print_table(combined)


@contextlib.contextmanager
def running_receiver(*receiver_args: str, timeout: float = 600) -> Iterator[str]:
    """``nccl_sync_receiver.py`` started with ``receiver_args`` on a free loopback port; yields its URL
    once it answers, and stops it (``/harness/stop``, then a kill after 30 s) however the block ends."""
    port = choose_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.sync.nccl_sync_receiver", "--port", str(port), *receiver_args],
                            cwd=ROOT)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the receiver exited with {proc.returncode} before answering")
            try:
                httpx.get(f"{url}/get_world_size", timeout=2).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise TimeoutError("the receiver did not answer") from None
                time.sleep(0.5)
        yield url
    finally:
        try:
            httpx.post(f"{url}/harness/stop", timeout=10)
        except httpx.HTTPError:
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _passthrough(args) -> list[str]:
    return ["--model", args.model, "--variants", args.variants, "--repeats", str(args.repeats), "--warmup",
            str(args.warmup), "--bw-iters", str(args.bw_iters), "--port-range", args.port_range,
            "--default-bucket-mb", str(args.default_bucket_mb)] + (["--smoke"] if args.smoke else [])


def print_table(combined: dict) -> None:
    print(f"\ntransport {combined['transport']}; medians. transfer = /update_weights sent -> last tensor applied "
          "(gather + send + receive + apply); sync = start_weight_update .. finish_weight_update answered; "
          "ideal = bytes / broadcast bandwidth; ratio = transfer / ideal")
    print(f"{'ranks':>5} {'variant':>18} {'GB':>6} {'GB/s bw':>8} {'ideal ms':>8} {'xfer ms':>8} {'sync ms':>8} "
          f"{'ratio':>6} {'host ms':>7} {'buckets':>7} {'peak MiB':>8} {'plan MiB':>8} {'equal':>5}")
    for name, run in combined["runs"].items():
        if "error" in run:
            print(f"{name}: {run['error']}")
            continue
        bw = run["bandwidth"]["bytes_per_s"]
        for variant, v in run["variants"].items():
            host = f"{1e3 * v['host_s']:7.1f}" if v.get("host_s") is not None else f"{'-':>7}"
            print(f"{run['world_size']:>5} {variant:>18} {run['wire_bytes'] / 1e9:6.2f} {bw / 1e9:8.1f} "
                  f"{1e3 * v['ideal_s']:8.2f} {1e3 * v['transfer_s']:8.2f} {1e3 * v['sync_s']:8.2f} {v['ratio']:6.2f} "
                  f"{host} {v['buckets'] or '-':>7} {v['peak_extra_bytes'] / MB:8.0f} "
                  f"{(v['planned_extra_bytes'] or 0) / MB:8.0f} {str(v['all_equal']):>5}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=("launch", "trainer"), default="launch")
    ap.add_argument("--trainer-ranks", default="1,2", help="trainer rank counts to run, one receiver run each")
    ap.add_argument("--transport", choices=("auto", "vllm", "torch"), default="auto")
    ap.add_argument("--model", default="qwen3-1.7b")
    ap.add_argument("--variants", default="bucketed:64,bucketed:256,bucketed:1024,per_param,vllm_engine:1024,push:256")
    ap.add_argument("--default-bucket-mb", type=float, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--bw-iters", type=int, default=5)
    ap.add_argument("--port-range", default="40000-40100")
    ap.add_argument("--receiver-url")
    ap.add_argument("--timeout", type=float, default=540)
    ap.add_argument("--out", default="benchmarks/results/nccl_sync.json")
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny model: checks the script, times nothing real")
    args = ap.parse_args()
    if args.role == "trainer":
        run_trainer(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
