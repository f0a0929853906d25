#!/usr/bin/env bash
# Pack vLLM's CUDA build (0.25.0) and the packages of requirements-cuda.lock that the GPU machine's image lacks,
# for a machine without network that takes at most 64 MiB a call: one xz archive of the installed files, split
# into folders .vcuda1, .vcuda2, ... of at most 56 MB each (the checkout travels beside them).
#
#     bash benchmarks/device/pack_vllm_cuda.sh      # writes .vcuda1/ ... .vcudaN/ at the repository root
#
# On the device, on one warm machine, one call per folder in order, each carrying its folder:
#     bash .vcudaK/setup.sh                         # stages part K in /tmp/vcuda; the last part installs all
#     export PYTHONPATH=$PWD:/tmp/site              # then every later command on that machine
#
# What the archive leaves out of vLLM's wheel, each unused on a Hopper GPU serving a bf16 model: the
# FlashAttention-2 kernels (191 MB; Hopper runs FlashAttention-3's), the Rust front end `vllm-rs` (38 MB; the
# Python API server is the one started), the Blackwell attention sources (third_party/fmha_sm100) and DeepGEMM's
# C++ headers (FP8 GEMMs), and the extensions built for Python 3.13 and 3.14 (the machine has 3.12). Which
# packages of the lock are not carried, and why: NOT_CARRIED in cuda_carry.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
vllm_version=$(sed -n 's/^vllm==\(.*\)$/\1/p' requirements-cuda.lock)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
           --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64)
python3 -m benchmarks.device.cuda_carry --list > "$tmp/carry.txt"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$tmp/wheels" -r "$tmp/carry.txt" "vllm==$vllm_version" 2>&1 | grep -v "is ignored" || true
n_wanted=$(( $(wc -l < "$tmp/carry.txt") + 1 ))
n_got=$(ls "$tmp/wheels" | wc -l)
if [ "$n_got" -ne "$n_wanted" ]; then
  echo "pack_vllm_cuda: $n_got wheels downloaded, $n_wanted wanted" >&2; exit 1
fi
# Installed as pip would install them on the machine (files, dist-info with entry points, console scripts)
python3 -m pip install -q --no-deps --no-compile --no-index --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" --target "$tmp/site" "$tmp"/wheels/*.whl
rm -rf "$tmp/site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$tmp/site/vllm/vllm-rs" \
  "$tmp/site/vllm/third_party/fmha_sm100" "$tmp/site/vllm/third_party/deep_gemm/include"
find "$tmp/site" -name '*.cpython-313-*.so' -delete -o -name '*.cpython-314-*.so' -delete
find "$tmp/site" -name __pycache__ -prune -exec rm -rf {} +
python3 -m benchmarks.device.cuda_carry --list | sort > "$tmp/site/.vcuda-carried.txt"
echo "vllm==$vllm_version" >> "$tmp/site/.vcuda-carried.txt"
(cd "$tmp/site" && tar -cf - . | xz -6 -T2 > "$tmp/vcuda.tar.xz")
(cd "$tmp" && split -b 56000000 -d -a 1 vcuda.tar.xz vcuda.part)
parts=$(ls "$tmp"/vcuda.part* | wc -l)
rm -rf .vcuda[0-9]*
k=0
for part in "$tmp"/vcuda.part*; do
  k=$((k + 1))
  mkdir -p ".vcuda$k"
  mv "$part" ".vcuda$k/"
  sed "s/@PARTS@/$parts/" benchmarks/device/vcuda_setup.sh > ".vcuda$k/setup.sh"
done
sha256sum "$tmp/vcuda.tar.xz" | cut -c1-64 > ".vcuda$k/archive.sha256"
du -sh .vcuda[0-9]*
echo "pack_vllm_cuda: $parts parts; on one warm device machine, call K carries .vcudaK and runs 'bash .vcudaK/setup.sh'"
