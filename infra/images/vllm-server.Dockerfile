# The vLLM server image: vLLM's CUDA image plus this package. Installing the package is all the
# server needs: its `vllm.general_plugins` entry point (grpo_core.vllm_plugin.entry_point:register) is
# loaded by every vLLM process at start-up and registers the weight-transfer backends.
#
#   docker build -f infra/images/vllm-server.Dockerfile -t REGISTRY/grpo-vllm-server:TAG .
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}

WORKDIR /opt/grpo
COPY pyproject.toml README.md ./
COPY grpo_core ./grpo_core
COPY flows ./flows

# Pin what the base image ships (torch, vLLM, transformers) so that installing this package cannot
# swap the CUDA builds underneath vLLM.
RUN python3 -m pip freeze | grep -iE '^(torch|vllm|transformers|tokenizers)==' > /tmp/keep.txt \
 && python3 -m pip install --no-cache-dir -c /tmp/keep.txt . \
 && python3 -c "from importlib.metadata import entry_points; \
assert 'grpo_core.vllm_plugin.entry_point:register' in [e.value for e in entry_points(group='vllm.general_plugins')]"

ENV VLLM_SERVER_DEV_MODE=1
# The command line comes from the flow (VLLMServerSpec.command()); this default only documents it.
ENTRYPOINT []
CMD ["python3", "-m", "vllm.entrypoints.openai.api_server", "--help"]
