#!/usr/bin/env bash
# Pack flash-linear-attention with tilelang (its Gated DeltaNet backward on Hopper with the image's Triton 3.6)
# and FlashQLA (fused TileLang forward and backward kernels, which fla dispatches to for heads of 128)
# for a GPU machine without network, in two folders under 64 MiB each (the most one device call carries):
# .gdna (call 1: tilelang, fla-core, flash-qla and their small needs) and .gdnb (call 2, on the same warm machine:
# z3-solver, which tilelang imports, and pydantic). Python 3.12, manylinux x86_64, as the device image has.
#
#     bash benchmarks/device/pack_gdn.sh        # writes .gdna/ and .gdnb/ at the repository root
#     bash benchmarks/device/pack_gdn.sh tilelang_cache.tgz   # the same, with TileLang's compiled kernels
#
# The cache argument: a device call's `tar czf $OUT/tilelang_cache.tgz -C ~ .tilelang` after a run that compiled
# FlashQLA's kernels (about 5 MB). .gdna's setup restores it, and the next machine skips the compile (about 110 s per
# head count on an H200 since the backend's probe runs at the model's head count; some 7 minutes before).
#
# On the device: `source .gdna/setup.sh` in call 1, `source .gdnb/setup.sh` in call 2 (both install into
# /tmp/site, which outlives the checkout's carried folders on a warm machine). tilelang pins
# apache-tvm-ffi < 0.1.13 and FlashAttention-4 accepts >= 0.1.11, so both scripts pin 0.1.12: .fa4a, .fa4b,
# .gdna and .gdnb install into one environment (four calls on the same warm machine).
set -euo pipefail
cd "$(dirname "$0")/../.."
get() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$1" "${@:2}"
}
rm -rf .gdna .gdnb && mkdir -p .gdna/w .gdnb/w
get .gdna/w tilelang==0.1.15 fla-core==0.6.0 flash-qla==0.1.3 einops==0.8.2 apache-tvm-ffi==0.1.12 torch-c-dlpack-ext==0.1.5 ml-dtypes==0.7.0
# pydantic: the project's config imports it and the device image lacks it (same versions as the lock file)
get .gdnb/w z3-solver==4.15.4.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
cp benchmarks/device/gdna_setup.sh .gdna/setup.sh && cp benchmarks/device/gdnb_setup.sh .gdnb/setup.sh
if [ -n "${1:-}" ]; then cp "$1" .gdna/tilelang_cache.tgz; fi
du -sh .gdna .gdnb
