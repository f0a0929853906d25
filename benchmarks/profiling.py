"""Timing and profiling helpers shared by the benchmarks: ``time_ms`` (milliseconds a call, CUDA events on a GPU),
and for the ``--profile`` options (``packing/tree_packing.py``, ``models/moe_training.py`` and the scripts built on
it, ``models/moe_experts.py``): where a step's CUDA time goes by
kind of kernel, where the host waits for the GPU, where compiled layers break their graphs, and which matmuls get
operands cuBLAS serves slowly.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import re
import time
from collections.abc import Callable

import torch

KERNEL_KINDS = (  # substrings of CUDA kernel names, first match wins
    ("short convolution", ("causal_conv", "conv1d", "conv_depthwise")),
    ("gated delta rule", ("gated_delta", "delta_rule", "chunk_fwd", "chunk_bwd", "chunk_local", "chunk_scaled", "wy_",
                          "w_u", "solve_tril", "inverse_kernel", "kkt", "l2norm")),
    ("grouped matmul (experts)", ("grouped", "moe")),
    ("attention backward", ("flash_bwd", "attn_bwd", "_bwd_")),
    ("attention forward", ("flash_fwd", "attn_fwd", "_fwd_")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "sm100_", "cublas")),
    ("gather / scatter", ("index", "gather", "scatter")),
    ("reduction", ("reduce", "softmax", "norm", "triton_red", "triton_per")),
    ("elementwise / copy", ("elementwise", "vectorized", "copy", "fill", "cat", "triton_poi")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


PYTHON_FRAME = re.compile(r"\(\d+\): ")  # how the profiler names a Python function's event ("file.py(12): f")


def op_site(op, frames: int = 4) -> str:
    """Where a host op ran: it and the ops it ran under (the three innermost, then the autograd node it ran in, or
    else the outermost op), the innermost op's input shapes (recorded with ``record_shapes``), and the nearest Python
    frames outside torch's own code (with ``with_stack``, the profiler records them as parent events; older profilers
    as an event's ``stack``). A backward on autograd's own thread has no Python frames; its node names it."""
    ops, python, stack, parent = [], [], [], op
    while parent is not None:
        if PYTHON_FRAME.search(parent.name):
            if "/torch/" not in parent.name and len(python) < frames:
                python.append(parent.name)
        elif not parent.name.startswith("<built-in"):
            ops.append(parent)
        if not stack and getattr(parent, "stack", None):
            stack = [f for f in parent.stack if "/torch/" not in f][:frames]
        parent = parent.cpu_parent
    names = [o.name for o in ops]
    shown = names[:3]
    if len(names) > 3:
        nodes = [n for n in names[3:] if n.startswith("autograd::engine::evaluate_function")]
        shown += ["...", (nodes or names[3:])[-1]]
    shapes = getattr(ops[0], "input_shapes", None) if ops else None
    where = python or stack
    return (" < ".join(shown or ["(no op)"]) + (f" {list(shapes)}" if shapes else "")
            + (" @ " + " | ".join(where) if where else ""))


def wait_site(event, frames: int = 4) -> str:
    """Where a host wait (a runtime call such as ``cudaStreamSynchronize``) came from: the site of the op it ran under
    (``op_site``)."""
    return op_site(event.cpu_parent, frames)


def launch_sites(events, kernels: set[str], per_kernel: int = 3) -> dict[str, list[dict]]:
    """For each kernel named in ``kernels``, the host sites (``op_site``) that launched it most often: the profiler
    attaches each kernel to the op that launched it (a CPU event's ``kernels``)."""
    sites: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for e in events:
        for k in getattr(e, "kernels", None) or ():
            if k.name in kernels:
                sites[k.name][op_site(e)] += 1
    return {name[:160]: [{"site": site[:600], "calls": n} for site, n in counter.most_common(per_kernel)]
            for name, counter in sites.items()}


def profile_call(step, top: int = 15, wait_sites: bool = False) -> dict:
    """CUDA kernel time of one ``step()``: the ``top`` kernels by time, the time per ``kernel_kind``, the host ops by the
    GPU time of what they launched, the host's waits for the GPU, and GPU busy time against wall time.
    ``wait_sites``: also record Python stacks and input shapes, and report where the host waits for the GPU
    (``host_wait_sites``: each wait drains the launch queue, so a few per layer leave the GPU idle while the host
    catches up) and where the top kernels were launched from (``launch_sites``)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=wait_sites,
                 record_shapes=wait_sites) as prof:
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3
    per_kernel = collections.defaultdict(lambda: [0, 0.0])
    spans = []
    waits = collections.Counter()  # host calls that wait for the GPU: each one drains the launch queue
    sites = collections.Counter()
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            if e.name in HOST_WAITS:
                waits[e.name] += 1
                if wait_sites:
                    sites[wait_site(e)] += 1
            continue
        per_kernel[e.name][0] += 1
        per_kernel[e.name][1] += e.time_range.elapsed_us() / 1e3
        spans.append((e.time_range.start, e.time_range.end))
    total = sum(ms for _, ms in per_kernel.values())
    busy_us, reach = 0.0, float("-inf")  # union of kernel spans: time the GPU ran anything
    for start, end in sorted(spans):
        busy_us += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    kinds = collections.Counter()
    for name, (_, ms) in per_kernel.items():
        kinds[kernel_kind(name)] += ms
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:top]
    # host ops by the GPU time of the kernels they (and the ops under them) launched: compiled regions, custom
    # autograd functions and their backwards name the layer's parts that kernel names alone do not
    ops = sorted((a for a in prof.key_averages() if a.device_time_total > 0), key=lambda a: -a.device_time_total)
    # wall - busy is time the GPU waited for the host (launches, Python, graph breaks); the profiler's own
    # overhead inflates it, so compare it between modes rather than read it as absolute
    return {"kernel_ms": total, "busy_ms": busy_us / 1e3, "wall_ms": wall_ms, "kernels": len(spans),
            "host_waits": dict(waits),
            **({"host_wait_sites": [{"site": k[:600], "calls": n} for k, n in sites.most_common(top)],
                "launch_sites": launch_sites(prof.events(), {name for name, _ in ranked})}
               if wait_sites else {}),
            "by_kind_ms": dict(kinds.most_common()),
            "top": [{"kernel": n[:160], "calls": c, "ms": ms, "share": ms / total} for n, (c, ms) in ranked],
            "ops": [{"op": a.key[:160], "calls": a.count, "ms": a.device_time_total / 1e3,
                     "self_ms": a.self_device_time_total / 1e3} for a in ops[:top]]}


MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm")


def misaligned_matmuls(step, top: int = 12) -> list[dict]:
    """The matmuls of one ``step()`` with an operand whose leading dimension is not a multiple of 16 bytes, by op,
    shapes and strides: cuBLAS serves those with slow kernels for narrow alignments (a leading dimension of an odd
    row length, for example). Recorded by a dispatch mode, which also sees the matmuls compiled code calls; a matmul
    of a backward names the autograd node that ran it (``backward_of``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    found = collections.Counter()

    def misaligned(t: torch.Tensor) -> bool:
        if t.dim() < 2:
            return False
        inner, outer = t.stride()[-1], t.stride()[-2]
        if 0 in (inner, outer):  # a broadcast view: materialised before any kernel reads it
            return False
        lead = outer if inner == 1 else inner if outer == 1 else 1
        return (lead * t.element_size()) % 16 != 0 or (t.data_ptr() % 16) != 0

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in MATMUL_OPS:
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                if any(misaligned(t) for t in tensors):
                    node = torch._C._current_autograd_node()  # the backward node running it; None in a forward
                    found[(func.__name__, tuple((tuple(t.shape), t.stride()) for t in tensors),
                           None if node is None else node.name())] += 1
            return func(*args, **(kwargs or {}))

    with Record():
        step()
    return [{"op": op, "operands": [list(map(list, o)) for o in operands], "calls": n,
             **({"backward_of": node} if node else {})}
            for (op, operands, node), n in found.most_common(top)]


def print_profile(mode: str, prof: dict) -> None:
    print(f"profile {mode}: {prof['kernel_ms']:.0f} ms of CUDA kernels ({prof['kernels']} launches), GPU busy "
          f"{prof['busy_ms']:.0f} of {prof['wall_ms']:.0f} ms wall; host waits {prof.get('host_waits')}; by kind: "
          + ", ".join(f"{k} {ms:.0f}" for k, ms in prof["by_kind_ms"].items()), flush=True)
    for t in prof["top"]:
        print(f"  {t['ms']:8.1f} ms {t['share']:6.1%} {t['calls']:6d}x  {t['kernel'][:110]}", flush=True)
    print("  host ops by GPU time (with the ops under them; self)", flush=True)
    for o in prof.get("ops", []):
        print(f"  {o['ms']:8.1f} ms {o['self_ms']:8.1f} ms {o['calls']:6d}x  {o['op'][:100]}", flush=True)
    if prof.get("host_wait_sites"):
        print("  host waits by site (the ops they ran under < ...; Python frames)", flush=True)
        for w in prof["host_wait_sites"]:
            print(f"  {w['calls']:6d}x  {w['site'][:300]}", flush=True)


class _BreakSites(logging.Handler):
    """Counts the user-code locations in torch's ``graph_breaks`` log records."""

    SITE = re.compile(r"in user code at (\S+:\d+)")

    def __init__(self, sites: collections.Counter):
        super().__init__(logging.DEBUG)
        self.sites = sites

    def emit(self, record: logging.LogRecord) -> None:
        found = self.SITE.search(record.getMessage())
        if found:
            self.sites[found.group(1)] += 1


@contextlib.contextmanager
def graph_break_sites():
    """Within: torch logs every graph break (with its stack, on stderr), and the Counter yielded counts them by the
    user-code line they happened at, which the dynamo counters (reasons only) do not name."""
    sites: collections.Counter = collections.Counter()
    handler = _BreakSites(sites)
    torch._logging.set_logs(graph_breaks=True)
    logging.getLogger("torch._dynamo").addHandler(handler)
    try:
        yield sites
    finally:
        logging.getLogger("torch._dynamo").removeHandler(handler)
        torch._logging.set_logs()


def time_ms(fn: Callable[[], object], repeats: int, dev: torch.device) -> float:
    """Milliseconds per call after five warm-up calls: CUDA events on a GPU, the wall clock on the CPU."""
    for _ in range(5):
        fn()
    if dev.type != "cuda":
        start_s = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start_s) * 1e3 / repeats
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats
