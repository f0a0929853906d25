#!/usr/bin/env bash
# Pack FlashAttention-4 and its CuTe DSL compiler for a GPU machine without network, in two folders
# under 64 MiB each (the most one device call carries): .fa4a (call 1) and .fa4b (call 2, on the
# same warm machine right after). Python 3.12, manylinux x86_64, as the device image has.
#
#     bash benchmarks/device/pack_fa4.sh        # writes .fa4a/ and .fa4b/ at the repository root
#
# On the device: `source .fa4a/setup.sh` in call 1, `source .fa4b/setup.sh` in call 2.
set -euo pipefail
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
get() {
  python3 -m pip download -q --no-deps --only-binary=:all: --pre --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$1" "${@:2}"
}
rm -rf .fa4a .fa4b && mkdir -p .fa4a/w .fa4b/w "$tmp/cutlass" "$tmp/cw"
get .fa4a/w flash-attn-4==4.0.0b36 quack-kernels==0.6.5 apache-tvm-ffi==0.1.12 torch-c-dlpack-ext==0.1.5 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
cp .fa4a/w/pydantic* .fa4a/w/annotated_types* .fa4a/w/typing_* .fa4b/w/
get "$tmp/cw" nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
  nvidia-cutlass-dsl-libs-cu13==4.8.1
for w in "$tmp"/cw/*.whl; do python3 -m zipfile -e "$w" "$tmp/cutlass"; done
(cd "$tmp/cutlass" && tar -cf - . | xz -9 -T2 > "$tmp/cutlass.tar.xz")
(cd "$tmp" && split -b 28000000 -d cutlass.tar.xz cutlass.tar.xz.part)
mv "$tmp/cutlass.tar.xz.part00" .fa4a/ && mv "$tmp"/cutlass.tar.xz.part0[1-9] .fa4b/
cp benchmarks/device/fa4a_setup.sh .fa4a/setup.sh && cp benchmarks/device/fa4b_setup.sh .fa4b/setup.sh
rm -rf "$tmp"
du -sh .fa4a .fa4b
