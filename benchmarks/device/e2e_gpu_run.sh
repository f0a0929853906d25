#!/usr/bin/env bash
# On the GPU machine, after the packed set-up (pack_vllm_cuda.sh's parts, each `bash .vcudaK/setup.sh`): the whole
# run through benchmarks/device/e2e_gpu.py, bounded by E2E_LIMIT_S (the driver keeps what ran when the bound
# stops it), with the server's and the trainer's logs copied into $OUT beside the record.
#
#     BENCH_COMMIT=abc1234 bash benchmarks/device/e2e_gpu_run.sh --out $OUT/e2e_gpu.json --kill-at-step 100
#
# The built tiny model travels in .e2e_cache/tiny (GRPO_CORE_CACHE), so the machine does not build it again.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD:/tmp/site" PATH="/tmp/site/bin:$PATH" GRPO_CORE_CACHE="$PWD/.e2e_cache" HF_HUB_OFFLINE=1 \
  PYTHONUNBUFFERED=1
timeout -s TERM "${E2E_LIMIT_S:-540}" python3 -m benchmarks.device.e2e_gpu "$@"
rc=$?
for log in /tmp/e2e_gpu/*/out/vllm_server.log /tmp/e2e_gpu/*/out/train.log; do
  [ -f "$log" ] && tail -c 4000000 "$log" > "${OUT:-/tmp}/$(basename "$(dirname "$(dirname "$log")")")-$(basename "$log")"
done
exit $rc
