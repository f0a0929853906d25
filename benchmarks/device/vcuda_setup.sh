#!/usr/bin/env bash
# One part of the packed vLLM CUDA set (pack_vllm_cuda.sh): stage it in /tmp/vcuda, which a warm machine keeps
# between calls; once all @PARTS@ parts are there, check the archive and unpack it into /tmp/site, write the
# project's own entry points (the vLLM plugin and the `grpo` command) and check the whole set against the lock.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p /tmp/vcuda
cp "$here"/vcuda.part* /tmp/vcuda/
[ -f "$here/archive.sha256" ] && cp "$here/archive.sha256" /tmp/vcuda/
have=$(ls /tmp/vcuda/vcuda.part* | wc -l)
echo "vcuda: $have of @PARTS@ parts staged in /tmp/vcuda ($(du -sh /tmp/vcuda | cut -f1))"
if [ "$have" -lt @PARTS@ ]; then
  exit 0
fi
if [ ! -f /tmp/vcuda/archive.sha256 ] || \
   [ "$(cat /tmp/vcuda/vcuda.part* | sha256sum | cut -c1-64)" != "$(cat /tmp/vcuda/archive.sha256)" ]; then
  echo "vcuda: FAILED: the staged parts do not make the packed archive (a part missing or from another pack)" >&2
  exit 1
fi
rm -rf /tmp/site && mkdir -p /tmp/site
if command -v xz >/dev/null 2>&1; then
  cat /tmp/vcuda/vcuda.part* | xz -d -T0 | tar -x -C /tmp/site
else  # Python's own lzma where the image has no xz
  cat /tmp/vcuda/vcuda.part* | python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('/tmp/site')"
fi
rm -rf /tmp/vcuda
# The project's own metadata: vLLM finds its plugin through entry points, and `grpo` is the command users run.
repo=$(cd "$here/.." && pwd)
version=$(sed -n 's/^version *= *"\(.*\)"/\1/p' "$repo/pyproject.toml" | head -n1)
info=/tmp/site/grpo_core-${version:-0}.dist-info
mkdir -p "$info" /tmp/site/bin
printf 'Metadata-Version: 2.1\nName: grpo-core\nVersion: %s\n' "${version:-0}" > "$info/METADATA"
printf '[vllm.general_plugins]\ngrpo_core_weight_transfer = grpo_core.vllm_plugin.entry_point:register\n\n[console_scripts]\ngrpo = flows.cli:main\n' > "$info/entry_points.txt"
printf '#!/usr/bin/env python3\nimport sys\nfrom flows.cli import main\nsys.exit(main())\n' > /tmp/site/bin/grpo
chmod +x /tmp/site/bin/grpo
echo "vcuda: unpacked $(wc -l < /tmp/site/.vcuda-carried.txt) packages into /tmp/site ($(du -sh /tmp/site | cut -f1))"
cd "$repo"
PYTHONPATH="$repo:/tmp/site" python3 -m benchmarks.device.cuda_carry --check --out /tmp/site/.vcuda-check.json
