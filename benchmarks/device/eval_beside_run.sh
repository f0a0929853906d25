#!/usr/bin/env bash
# On the GPU machine, after the packed set-up (pack_vllm_cuda.sh's parts, each `bash .vcudaK/setup.sh`): held-out
# evaluation beside training against none and against a blocking one (benchmarks/staleness/eval_beside.py), the
# server sharing the trainer's GPU as the flow places it. Bounded by EVB_LIMIT_S; each arm is written to the record
# as it ends, so a bound loses only the running arm. The server's log is copied into $OUT beside the record.
#
#     EVB_LIMIT_S=560 bash benchmarks/device/eval_beside_run.sh --out $OUT/eval_beside_gpu.json --arms none,beside
#
# The built tiny model travels in .e2e_cache/tiny (GRPO_CORE_CACHE), so the machine does not build it again.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD:/tmp/site" PATH="/tmp/site/bin:$PATH" GRPO_CORE_CACHE="$PWD/.e2e_cache" HF_HUB_OFFLINE=1 \
  PYTHONUNBUFFERED=1 TMPDIR=/tmp/eval_beside_gpu
rm -rf "$TMPDIR" && mkdir -p "$TMPDIR"
timeout -s TERM "${EVB_LIMIT_S:-540}" python3 -m benchmarks.staleness.eval_beside "$@"
rc=$?
for log in "$TMPDIR"/eval_beside-*/server/vllm_server.log; do
  [ -f "$log" ] && tail -c 4000000 "$log" > "${OUT:-/tmp}/eval_beside-vllm_server.log"
done
exit $rc
