# The trainer image: the Prefect flow-run pod and the training pods of the Kubernetes deployment.
# Built on the same vLLM image as the server so that torch, NCCL and vLLM's weight-transfer client
# are the builds the server speaks to.
#
#   docker build -f infra/images/trainer.Dockerfile --build-arg GRPO_GIT_COMMIT=$(git rev-parse HEAD) -t REGISTRY/grpo-trainer:TAG .
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}

WORKDIR /opt/grpo
COPY . .

# Editable install: the flow's entry point (flows/train_flow.py), the `flows` package and the job
# templates in infra/kubernetes/ are then all the same files under /opt/grpo, where the deployment's
# pull step (set_working_directory: /opt/grpo) starts the flow run.
RUN python3 -m pip freeze | grep -iE '^(torch|vllm|transformers|tokenizers)==' > /tmp/keep.txt \
 && python3 -m pip install --no-cache-dir -c /tmp/keep.txt -e '.[flows]' \
 && python3 -c "import flows.kubernetes, grpo_core.launch"

# Images have no .git: the commit is passed in so that MLflow runs are still tagged with it.
ARG GRPO_GIT_COMMIT=""
ENV PYTHONUNBUFFERED=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    GRPO_GIT_COMMIT=${GRPO_GIT_COMMIT}
ENTRYPOINT []
CMD ["python3", "-m", "grpo_core.launch", "--help"]
