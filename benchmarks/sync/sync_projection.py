"""Weight sync time on paper for 8B, 32B and 235B-A22B models, dense and sparse, from measured bytes and bandwidth.

Nothing runs on a GPU here: the time of a push is projected as

    seconds = overhead x bytes / bandwidth

with the figures this project measured (``benchmarks/results/nccl_sync.json``: a 3.44 GB bf16 push of the
1.7B shape took 1.11 x bytes / the 161 GB/s of vLLM's NCCL communicator between two H200s) and, for sparse
pushes, the share of bf16 elements one optimizer step changes (``benchmarks/results/sparse_share.json``,
per learning rate, when present). A sparse tensor moves 6 bytes per changed element (int32 index, bf16
value) against 2 per element dense, so a push at share s moves min(3 s, 1) of the dense bytes (per tensor;
the header of 8 bytes per tensor is left out). Parameter counts are the models' published ones.

The cross-node column assumes one 400 Gb/s NIC (50 GB/s) on the path, as when the rank that gathers the
model and the server's GPU sit on different nodes: an assumption, not a measurement of this project.

    python -m benchmarks.sync.sync_projection --out benchmarks/results/sync_projection.json
    python -m benchmarks.sync.sync_projection --smoke --out /tmp/sync_projection.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any
from benchmarks.bench_io import write_report

MODELS = {
    # name: (parameters, published full-sync seconds and their setting, or None)
    "Qwen3-8B": (8.19e9, None),
    "Qwen3-32B": (32.8e9, (2.3, "16+16 H200")),
    "Qwen3-235B-A22B": (235.1e9, (23.7, "MoE, published full sync")),
}
BF16_BYTES = 2
SPARSE_BYTES_PER_CHANGE = 4 + 2  # int32 index + bf16 value
NVLINK_GB_S = 161.0  # vLLM PyNcclCommunicator broadcast, 2 x H200 (benchmarks/README.md, NCCL weight sync)
OVERHEAD = 1.11  # measured push transfer / ideal at 256 MiB buckets, same run
NIC_GB_S = 50.0  # one 400 Gb/s NIC: assumed


def sparse_fraction(share: float) -> float:
    """Bytes of a sparse push over the dense bytes at changed share ``share``."""
    return min(SPARSE_BYTES_PER_CHANGE * share / BF16_BYTES, 1.0)


def shares_from(path: Path) -> dict[str, float]:
    """Median changed share per learning rate from the H200 measurement, if it is there."""
    if not path.exists():
        return {}
    report = json.loads(path.read_text())
    # sparse_share.py writes, per learning rate under "summary", the share of every measured step.
    return {str(lr): float(statistics.median(entry["share_per_step"]))
            for lr, entry in (report.get("summary") or {}).items() if entry.get("share_per_step")}


def project(shares: dict[str, float]) -> list[dict[str, Any]]:
    rows = []
    for name, (params, published) in MODELS.items():
        dense = params * BF16_BYTES
        row: dict[str, Any] = {
            "model": name, "params": params, "dense_gb": dense / 1e9,
            "dense_s_nvlink": OVERHEAD * dense / (NVLINK_GB_S * 1e9),
            "dense_s_nic": OVERHEAD * dense / (NIC_GB_S * 1e9),
            "published_s": published[0] if published else None,
            "published_setting": published[1] if published else None,
            "sparse": {},
        }
        for lr, share in shares.items():
            f = sparse_fraction(share)
            row["sparse"][lr] = {"share": share, "bytes_fraction": f, "gb": f * dense / 1e9,
                                 "s_nvlink": f * row["dense_s_nvlink"], "s_nic": f * row["dense_s_nic"]}
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shares", default="benchmarks/results/sparse_share.json")
    ap.add_argument("--out", default="benchmarks/results/sync_projection.json")
    ap.add_argument("--smoke", action="store_true", help="the same arithmetic (it needs no device); for the smoke suite")
    args = ap.parse_args()
    shares = shares_from(Path(args.shares))
    rows = project(shares)
    for row in rows:
        published = f"{row['published_s']} s ({row['published_setting']})" if row["published_s"] else "-"
        sparse = "; ".join(f"lr {lr}: share {v['share']:.4f} -> {v['gb']:.1f} GB, {v['s_nvlink']:.3f} s / {v['s_nic']:.2f} s"
                           for lr, v in row["sparse"].items()) or "shares not measured yet"
        print(f"{row['model']}: dense {row['dense_gb']:.1f} GB, {row['dense_s_nvlink']:.3f} s at {NVLINK_GB_S:g} GB/s "
              f"(NVLink, measured), {row['dense_s_nic']:.2f} s at {NIC_GB_S:g} GB/s (one NIC, assumed); "
              f"published {published}; sparse: {sparse}")
    write_report(args.out, {"nvlink_gb_s": NVLINK_GB_S, "overhead": OVERHEAD, "nic_gb_s": NIC_GB_S, "shares": shares,
                            "rows": rows})


if __name__ == "__main__":
    main()
