"""The vLLM server and the training nodes as Kubernetes jobs: the cluster side of ``flows/provision.py``.

The flow runs in a pod of the ``grpo-kubernetes`` work pool and calls the same four provisioner
methods as on one machine. Each call renders a template from ``infra/kubernetes/`` and sends it to
the API server of the cluster the pod runs in:

    start_server   Job + Service from vllm-server.yaml, per replica of a fleet; returns
                   http://<service>.<namespace>.svc:8000, the replica's stable URL for the run
    restart_server a new Job for the replica behind the same Service (same URL)
    run_training   Indexed Job (one pod per node, torchrun inside) + headless Service from training.yaml
    server_alive / stop_server   read / delete the server's Job (and Service)

Settings come from the flow pod's environment (``GRPO_K8S_*``, set by the work pool's base job
template), so the flow's code does not change between a laptop and a cluster. Every pod mounts one
ReadWriteMany volume at the same path: the job file, logs and model cache the flow writes are where
the server and the trainers read them.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import httpx
import yaml

from flows.provision import Provisioner, TrainingLaunch
from grpo_core.vllm_server.process import VLLMServerSpec

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "infra" / "kubernetes"
SERVER_PORT = 8000
_SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass
class KubernetesSettings:
    """Where and how the jobs run; ``from_env`` reads each field from ``GRPO_K8S_*`` / ``GRPO_*_IMAGE``."""

    trainer_image: str
    """Image of the training pods (infra/images/trainer.Dockerfile)."""
    server_image: str
    """Image of the vLLM server pod (infra/images/vllm-server.Dockerfile)."""
    namespace: str = "grpo"
    """Namespace of every job and service the provisioner creates."""
    service_account: str = "grpo-runner"
    """Service account of the server and training pods."""
    workspace_claim: str = "grpo-workspace"
    """ReadWriteMany PersistentVolumeClaim mounted by every pod."""
    workspace_path: str = "/workspace"
    """Where that claim is mounted, in every pod (job files and outputs must live under it)."""
    storage_config: str = "grpo-storage"
    """ConfigMap with the S3 endpoint and bucket, loaded as environment variables."""
    storage_secret: str = "grpo-s3-credentials"
    """Secret with the S3 access key pair, loaded as environment variables."""
    server_gpus: int = 1
    """GPUs of the vLLM server pod (match --tensor-parallel-size in server.extra_args)."""
    gpus_per_node: int | None = None
    """GPUs per training pod; None: one per training process (``nproc_per_node``)."""

    def __post_init__(self) -> None:
        for name in ("trainer_image", "server_image", "namespace"):
            if not getattr(self, name):
                raise ValueError(f"KubernetesSettings.{name} is empty; set {_ENV[name]}")
        if self.server_gpus < 0 or (self.gpus_per_node is not None and self.gpus_per_node < 0):
            raise ValueError("KubernetesSettings: GPU counts must be >= 0")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "KubernetesSettings":
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            raw = env.get(_ENV[field.name])
            if raw is None or raw == "":
                continue
            values[field.name] = int(raw) if field.name in ("server_gpus", "gpus_per_node") else raw
        if "namespace" not in values and (_SA_DIR / "namespace").exists():
            values["namespace"] = (_SA_DIR / "namespace").read_text().strip()
        values.setdefault("trainer_image", "")
        values.setdefault("server_image", "")
        return cls(**values)


_ENV = {
    "trainer_image": "GRPO_TRAINER_IMAGE",
    "server_image": "GRPO_SERVER_IMAGE",
    "namespace": "GRPO_K8S_NAMESPACE",
    "service_account": "GRPO_K8S_SERVICE_ACCOUNT",
    "workspace_claim": "GRPO_K8S_WORKSPACE_CLAIM",
    "workspace_path": "GRPO_K8S_WORKSPACE_PATH",
    "storage_config": "GRPO_K8S_STORAGE_CONFIG",
    "storage_secret": "GRPO_K8S_STORAGE_SECRET",
    "server_gpus": "GRPO_K8S_SERVER_GPUS",
    "gpus_per_node": "GRPO_K8S_GPUS_PER_NODE",
}

# ------------------------------------------------------------------------------------------ rendering
_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


def render(template: Any, values: Mapping[str, Any]) -> Any:
    """Fill ``{{ name }}`` placeholders: a string that is only a placeholder becomes the value itself
    (list, mapping, number); one inside a longer string is substituted as text. A placeholder without
    a value raises ``KeyError`` naming it, so a template and its renderer cannot drift apart silently."""
    if isinstance(template, dict):
        return {key: render(value, values) for key, value in template.items()}
    if isinstance(template, list):
        return [render(item, values) for item in template]
    if not isinstance(template, str):
        return template
    whole = _PLACEHOLDER.fullmatch(template.strip())
    if whole:
        return _value(whole.group(1), values)
    return _PLACEHOLDER.sub(lambda m: str(_value(m.group(1), values)), template)


def _value(name: str, values: Mapping[str, Any]) -> Any:
    if name not in values:
        raise KeyError(f"template placeholder {{{{ {name} }}}} has no value; given: {sorted(values)}")
    return values[name]


def render_template(file_name: str, values: Mapping[str, Any], template_dir: Path = TEMPLATE_DIR) -> list[dict]:
    """Every document of ``infra/kubernetes/<file_name>``, rendered."""
    documents = yaml.safe_load_all((template_dir / file_name).read_text())
    return [render(doc, values) for doc in documents if doc]


def _common_values(settings: KubernetesSettings, name: str, component: str, instance: str | None = None) -> dict[str, Any]:
    selector = {"app.kubernetes.io/instance": instance or name}
    return {
        "name": name,
        "namespace": settings.namespace,
        "selector": selector,
        "labels": {**selector, "app.kubernetes.io/name": "grpo", "app.kubernetes.io/component": component},
        "service_account": settings.service_account,
        "workspace_claim": settings.workspace_claim,
        "workspace_path": settings.workspace_path,
        "storage_config": settings.storage_config,
        "storage_secret": settings.storage_secret,
    }


def _cache_env(settings: KubernetesSettings) -> list[dict[str, Any]]:
    # Model downloads and the tiny model are built once on the shared volume, not in every pod.
    return [
        {"name": "HF_HOME", "value": f"{settings.workspace_path}/hf-cache"},
        {"name": "GRPO_CORE_CACHE", "value": f"{settings.workspace_path}/cache"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]


def server_manifests(settings: KubernetesSettings, spec: VLLMServerSpec, name: str, job: str | None = None) -> list[dict]:
    """The Service ``name`` and the Job (``job``, default ``name``) that serve ``spec`` on port 8000 of every pod
    interface; the Service selects the pods of any Job rendered for the same ``name`` (a restarted replica)."""
    pod_spec = dataclasses.replace(spec, host="0.0.0.0", port=SERVER_PORT)
    # The flow's interpreter path means nothing in the server image; its `python3` does.
    command = ["python3", *pod_spec.command(SERVER_PORT)[1:]]
    # Only the server's own settings travel (vLLM's variables and the spec's extras), not the flow pod's.
    added = {k: v for k, v in pod_spec.environment().items() if k.startswith("VLLM_") or k in pod_spec.env}
    env = [{"name": k, "value": v} for k, v in sorted(added.items())] + _cache_env(settings)
    values = {
        **_common_values(settings, job or name, "vllm-server", instance=name),
        "service": name,
        "image": settings.server_image,
        "command": command,
        "env": env,
        "port": SERVER_PORT,
        "gpus": str(settings.server_gpus),
    }
    return render_template("vllm-server.yaml", values)


def training_command(launch: TrainingLaunch, name: str) -> list[str]:
    """The training pod's command: the same entry point as on one machine, under torchrun for >1 process.

    Node 0 is pod 0 of the Indexed Job (reached by the headless Service's name); each pod's node rank
    is its completion index, which Kubernetes expands into ``$(NODE_RANK)``.
    """
    entry = launch.entry_args()  # "-m grpo_core.launch <args>"
    if launch.world_size == 1:
        return ["python3", *entry]
    pod_launch = dataclasses.replace(launch, rendezvous_address=f"{name}-0.{name}")
    return ["torchrun", *pod_launch.torchrun_args(node_rank="$(NODE_RANK)"), *entry]


def training_manifests(settings: KubernetesSettings, launch: TrainingLaunch, name: str) -> list[dict]:
    """The headless Service and Indexed Job of one training attempt."""
    node_rank = {
        "name": "NODE_RANK",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}},
    }
    gpus = launch.nproc_per_node if settings.gpus_per_node is None else settings.gpus_per_node
    values = {
        **_common_values(settings, name, "trainer"),
        "image": settings.trainer_image,
        "command": training_command(launch, name),
        "env": [node_rank, *_cache_env(settings)],
        "nnodes": launch.nnodes,
        "gpus": str(gpus),
        "rendezvous_port": launch.rendezvous_port,  # the port torchrun dials on pod 0
    }
    return render_template("training.yaml", values)


# ------------------------------------------------------------------------------------------ API client
_PATHS = {
    ("v1", "Service"): "api/v1/namespaces/{namespace}/services",
    ("batch/v1", "Job"): "apis/batch/v1/namespaces/{namespace}/jobs",
    ("v1", "Pod"): "api/v1/namespaces/{namespace}/pods",
}


class KubernetesApi:
    """The few REST calls the provisioner makes; httpx is enough, so no Kubernetes client library."""

    def __init__(self, base_url: str, token_file: Path | None, ca_file: Path | bool, transport: Any = None):
        self._client = httpx.Client(base_url=base_url, verify=str(ca_file) if isinstance(ca_file, Path) else ca_file,
                                    transport=transport, timeout=30.0)
        self._token_file = token_file

    @classmethod
    def in_cluster(cls) -> "KubernetesApi":
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise RuntimeError("not inside a Kubernetes pod (KUBERNETES_SERVICE_HOST is unset)")
        return cls(f"https://{host}:{port}", _SA_DIR / "token", _SA_DIR / "ca.crt")

    def _headers(self) -> dict[str, str]:
        # Read per request: the kubelet rotates projected service-account tokens under our feet.
        if self._token_file is None:
            return {}
        return {"Authorization": f"Bearer {self._token_file.read_text().strip()}"}

    def _path(self, api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
        path = _PATHS[(api_version, kind)].format(namespace=namespace)
        return f"/{path}/{name}" if name else f"/{path}"

    def create(self, manifest: dict) -> dict:
        meta = manifest["metadata"]
        reply = self._client.post(self._path(manifest["apiVersion"], manifest["kind"], meta["namespace"]),
                                  json=manifest, headers=self._headers())
        reply.raise_for_status()
        return reply.json()

    def read(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        reply = self._client.get(self._path(api_version, kind, namespace, name), headers=self._headers())
        if reply.status_code == 404:
            return None
        reply.raise_for_status()
        return reply.json()

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        # Background propagation: the Job's pods go with it.
        reply = self._client.delete(self._path(api_version, kind, namespace, name), headers=self._headers(),
                                    params={"propagationPolicy": "Background"})
        if reply.status_code != 404:
            reply.raise_for_status()

    def pods(self, namespace: str, job_name: str) -> list[dict]:
        reply = self._client.get(self._path("v1", "Pod", namespace), headers=self._headers(),
                                 params={"labelSelector": f"batch.kubernetes.io/job-name={job_name}"})
        reply.raise_for_status()
        return reply.json().get("items", [])

    def pod_log(self, namespace: str, pod: str, tail_lines: int = 500) -> str:
        reply = self._client.get(f"{self._path('v1', 'Pod', namespace, pod)}/log", headers=self._headers(),
                                 params={"tailLines": tail_lines})
        return reply.text if reply.status_code == 200 else f"(no log: HTTP {reply.status_code})"


# ------------------------------------------------------------------------------------------ provisioner
def job_failed(job: dict) -> bool:
    status = job.get("status", {})
    if any(c.get("type") == "Failed" and c.get("status") == "True" for c in status.get("conditions") or []):
        return True
    return status.get("failed", 0) > 0


def job_succeeded(job: dict) -> bool:
    return job.get("status", {}).get("succeeded", 0) >= job["spec"].get("completions", 1)


def exit_code(pods: list[dict]) -> int:
    """The first non-zero container exit code of the pods; -9 when a pod vanished without one (preempted)."""
    for pod in pods:
        for status in pod.get("status", {}).get("containerStatuses") or []:
            code = (status.get("state", {}).get("terminated") or {}).get("exitCode")
            if code:
                # Like subprocess: a signal death is negative (137 = 128 + SIGKILL → -9).
                return -(code - 128) if code > 128 else code
    return -9


class KubernetesProvisioner(Provisioner):
    """Server and training attempts as Jobs in ``settings.namespace`` (see the module docstring)."""

    def __init__(self, settings: KubernetesSettings, api: KubernetesApi, poll_s: float = 10.0):
        self.settings = settings
        self.api = api
        self.poll_s = poll_s
        self.run_token = uuid.uuid4().hex[:8]  # one flow run's objects share it; names stay unique per run
        self.servers: dict[str, tuple[str, str]] = {}  # url -> (service, current job)
        self.specs: dict[str, VLLMServerSpec] = {}
        self.replica_starts: dict[int, int] = {}
        self.attempts = 0

    @classmethod
    def from_env(cls) -> "KubernetesProvisioner":
        return cls(KubernetesSettings.from_env(), KubernetesApi.in_cluster())

    def _delete(self, name: str) -> None:
        ns = self.settings.namespace
        self.api.delete("batch/v1", "Job", ns, name)
        self.api.delete("v1", "Service", ns, name)

    def start_server(self, spec: VLLMServerSpec, log_dir: str, timeout_s: float, replica: int = 0,
                     replicas: int = 1) -> str:
        ns = self.settings.namespace
        # Stable per replica for the run; a task retry (a new fleet) gets fresh names: a deleted Service or Job
        # lingers while its pods terminate, and creating one of the same name would be refused as AlreadyExists.
        starts = self.replica_starts.get(replica, 0)
        self.replica_starts[replica] = starts + 1
        service = f"grpo-{self.run_token}-server-{replica}" + (f"-r{starts}" if starts else "")
        url = f"http://{service}.{ns}.svc:{SERVER_PORT}"
        self.specs[url] = spec
        self._start_job(url, service, f"{service}-0", timeout_s, with_service=True)
        return url

    def restart_server(self, base_url: str, timeout_s: float) -> None:
        service, job = self.servers[base_url]
        self.api.delete("batch/v1", "Job", self.settings.namespace, job)
        number = int(job.rsplit("-", 1)[1]) + 1
        self._start_job(base_url, service, f"{service}-{number}", timeout_s, with_service=False)

    def _start_job(self, url: str, service: str, job: str, timeout_s: float, with_service: bool) -> None:
        ns = self.settings.namespace
        for manifest in server_manifests(self.settings, self.specs[url], service, job=job):
            if manifest["kind"] == "Job" or with_service:
                self.api.create(manifest)
        self.servers[url] = (service, job)
        deadline = time.monotonic() + timeout_s
        failure = f"did not become ready within {timeout_s:.0f} s"
        while time.monotonic() < deadline:
            status = self.api.read("batch/v1", "Job", ns, job)
            if status is None or job_failed(status):
                failure = f"failed before serving:\n{self._log_tail(job)}"
                break
            if status.get("status", {}).get("ready", 0) >= 1:  # the readiness probe answered /v1/models
                return
            time.sleep(self.poll_s)
        if with_service:
            self.stop_server(url)
        else:
            self.api.delete("batch/v1", "Job", ns, job)  # the Service stays: a later restart keeps the URL
        raise RuntimeError(f"vLLM server job {ns}/{job} {failure}")

    def trains_on_gpu(self) -> bool:
        return True  # training pods ask for nvidia.com/gpu (KubernetesSettings.gpus_per_node)

    def server_alive(self, base_url: str) -> bool:
        if base_url not in self.servers:
            return False
        job = self.api.read("batch/v1", "Job", self.settings.namespace, self.servers[base_url][1])
        return job is not None and not job_failed(job) and job.get("status", {}).get("active", 0) >= 1

    def stop_server(self, base_url: str) -> None:
        names = self.servers.pop(base_url, None)
        if names is not None:
            service, job = names
            self.api.delete("batch/v1", "Job", self.settings.namespace, job)
            self.api.delete("v1", "Service", self.settings.namespace, service)

    def run_training(self, launch: TrainingLaunch, on_start: Callable[[int], None] | None = None) -> int:
        """Run one attempt as an Indexed Job; ``on_start`` is not called (there is no local pid)."""
        ns = self.settings.namespace
        self.attempts += 1
        name = f"grpo-{self.run_token}-train-{self.attempts}"
        try:
            for manifest in training_manifests(self.settings, launch, name):
                self.api.create(manifest)
            while True:
                job = self.api.read("batch/v1", "Job", ns, name)
                if job is None:
                    return -9  # deleted from outside (an operator, a namespace cleanup): treat as preempted
                if job_succeeded(job):
                    return 0
                if job_failed(job):
                    return exit_code(self.api.pods(ns, name))
                time.sleep(self.poll_s)
        finally:
            # Keep the node-0 log beside the flow's other outputs, then free the GPUs at once.
            if launch.log_file:
                with open(launch.log_file, "a") as log:
                    log.write(f"--- {ns}/{name} (node 0) ---\n{self._log_tail(name)}\n")
            self._delete(name)

    def _log_tail(self, job_name: str) -> str:
        try:
            pods = self.api.pods(self.settings.namespace, job_name)
        except httpx.HTTPError as exc:
            return f"(pods of {job_name} unreadable: {exc})"
        pods.sort(key=lambda p: p["metadata"].get("annotations", {}).get("batch.kubernetes.io/job-completion-index", ""))
        if not pods:
            return f"(no pods for {job_name})"
        return self.api.pod_log(self.settings.namespace, pods[0]["metadata"]["name"])
