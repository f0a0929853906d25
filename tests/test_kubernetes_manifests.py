"""The Kubernetes path, offline: every manifest we render or ship validates against the Kubernetes schema.

Schemas come from ``kubernetes-validate`` (the Kubernetes OpenAPI definitions as JSON schemas, shipped
in the wheel). Strict mode is used: an unknown or misspelt field fails, as ``kubectl apply
--validate=strict`` would. The provisioner itself is driven against a small recording stand-in for the
API server, to check which objects it creates and how it reads job status; no cluster is involved.
"""

from __future__ import annotations

import copy
import json
import shlex
from pathlib import Path

import httpx
import kubernetes_validate
import pytest
import yaml
from prefect.utilities.templating import apply_values

from flows.kubernetes import (
    KubernetesApi,
    KubernetesProvisioner,
    KubernetesSettings,
    render,
    server_manifests,
    training_command,
    training_manifests,
)
from flows.provision import TrainingLaunch
from grpo_core.vllm_server.process import VLLMServerSpec

K8S_VERSION = "1.33.0"
ROOT = Path(__file__).resolve().parent.parent
INFRA = ROOT / "infra"

SETTINGS = KubernetesSettings(trainer_image="registry.example/grpo-trainer:1", server_image="registry.example/grpo-vllm:1")


def validate(manifest: dict) -> None:
    kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


def launch(nproc: int = 1, nnodes: int = 1) -> TrainingLaunch:
    return TrainingLaunch(
        job_file="/workspace/runs/a/job.json", server_url="http://grpo-x-server-0.grpo.svc:8000",
        model_path="Qwen/Qwen3-0.6B", mlflow_run_id="abc", tracking_uri="http://mlflow.grpo.svc:5000",
        result_file="/workspace/runs/a/result.json", nproc_per_node=nproc, nnodes=nnodes,
        log_file=None,
    )


def by_kind(manifests: list[dict]) -> dict[str, dict]:
    return {m["kind"]: m for m in manifests}


def test_validator_rejects_a_misspelt_field():
    # Without this, a validator that accepts anything would make every other test here pass.
    job = by_kind(server_manifests(SETTINGS, VLLMServerSpec(model="m"), "grpo-t-server-0"))["Job"]
    broken = copy.deepcopy(job)
    broken["spec"]["template"]["spec"]["containres"] = broken["spec"]["template"]["spec"].pop("containers")
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(broken)
    wrong_type = copy.deepcopy(job)
    wrong_type["spec"]["backoffLimit"] = "none"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(wrong_type)


def test_server_manifests_validate_and_run_the_spec_command():
    spec = VLLMServerSpec(model="Qwen/Qwen3-0.6B", dtype="bfloat16", weight_transfer_backend="nccl",
                          enable_lora=True, extra_args=["--tensor-parallel-size", "2"])
    manifests = server_manifests(SETTINGS, spec, "grpo-t-server-0")
    assert [m["kind"] for m in manifests] == ["Service", "Job"]
    for manifest in manifests:
        validate(manifest)
    service, job = manifests
    pod = job["spec"]["template"]
    container = pod["spec"]["containers"][0]
    # The pod runs exactly the spec's command line, bound to every interface on the service's port.
    expected = ["python3", *VLLMServerSpec(**{**spec.__dict__, "host": "0.0.0.0", "port": 8000}).command(8000)[1:]]
    assert container["command"] == expected
    assert container["image"] == SETTINGS.server_image
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert "PATH" not in env  # the flow pod's own environment does not leak into the server pod
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["port"] == container["ports"][0]["containerPort"] == 8000
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"


@pytest.mark.parametrize("nproc,nnodes", [(1, 1), (4, 1), (8, 2)])
def test_training_manifests_validate_for_each_topology(nproc, nnodes):
    name = "grpo-t-train-1"
    manifests = training_manifests(SETTINGS, launch(nproc, nnodes), name)
    for manifest in manifests:
        validate(manifest)
    kinds = by_kind(manifests)
    job, service = kinds["Job"], kinds["Service"]
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == nnodes
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["template"]["spec"]["subdomain"] == service["metadata"]["name"] == name
    assert service["spec"]["clusterIP"] == "None"
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == str(nproc)
    command = container["command"]
    # The same entry point and arguments as a local launch, whatever wraps it.
    assert command[command.index("-m") :] == launch(nproc, nnodes).entry_args()
    if nproc * nnodes == 1:
        assert command[0] == "python3"
    else:
        assert command[0] == "torchrun"
        assert f"--nnodes={nnodes}" in command and f"--nproc-per-node={nproc}" in command
    if nnodes == 1:
        assert "--standalone" in command or nproc == 1  # one pod: torchrun's rendezvous stays inside it
    else:
        # Pod 0 hosts the rendezvous on the port its Service and container open; each pod's rank is its index.
        assert f"--master-addr={name}-0.{name}" in command
        assert f"--master-port={service['spec']['ports'][0]['port']}" in command
        assert service["spec"]["ports"][0]["port"] == container["ports"][0]["containerPort"]
        env_names = [e["name"] for e in container["env"]]
        assert "NODE_RANK" in env_names and "--node-rank=$(NODE_RANK)" in command


def test_training_command_keeps_every_launch_argument():
    cmd = training_command(launch(2, 2), "grpo-t-train-1")
    for flag, value in [("--server-url", "http://grpo-x-server-0.grpo.svc:8000"), ("--mlflow-run-id", "abc"),
                        ("--tracking-uri", "http://mlflow.grpo.svc:5000"), ("--result", "/workspace/runs/a/result.json")]:
        assert cmd[cmd.index(flag) + 1] == value


def test_render_types_and_missing_placeholders():
    assert render({"a": "{{ n }}", "b": "x-{{ n }}-y", "c": ["{{ l }}"]}, {"n": 3, "l": [1]}) == {
        "a": 3, "b": "x-3-y", "c": [[1]]}
    with pytest.raises(KeyError, match="gpus"):
        render({"limits": "{{ gpus }}"}, {"name": "x"})


def test_settings_from_env_require_images():
    env = {"GRPO_TRAINER_IMAGE": "t:1", "GRPO_SERVER_IMAGE": "s:1", "GRPO_K8S_NAMESPACE": "ml", "GRPO_K8S_SERVER_GPUS": "4"}
    settings = KubernetesSettings.from_env(env)
    assert (settings.namespace, settings.server_gpus, settings.gpus_per_node) == ("ml", 4, None)
    with pytest.raises(ValueError, match="GRPO_SERVER_IMAGE"):
        KubernetesSettings.from_env({"GRPO_TRAINER_IMAGE": "t:1"})


def test_work_pool_template_renders_a_valid_job():
    """The Kubernetes work pool's base job template, filled with its defaults as the worker would."""
    template = json.loads((INFRA / "work-pools" / "kubernetes.json").read_text())
    variables = {k: v.get("default") for k, v in template["variables"]["properties"].items()}
    variables.update(name="grpo-train-abc", labels={"prefect.io/flow-run-id": "abc"}, env={},
                     command="prefect flow-run execute")
    config = apply_values(template["job_configuration"], variables)
    manifest = config["job_manifest"]
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    # The worker turns the command string into args; mirror that so the schema sees what it sends.
    container["args"] = shlex.split(container["args"])
    validate(manifest)
    env = {e["name"]: e["value"] for e in container["env"]}
    # Everything KubernetesSettings.from_env needs is set in the flow pod.
    settings = KubernetesSettings.from_env(env)
    assert settings.trainer_image == variables["image"] and settings.server_image == variables["server_image"]
    assert settings.server_gpus == 1
    assert manifest["spec"]["template"]["spec"]["serviceAccountName"] == "grpo-runner"


def _shipped_manifests() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(INFRA.rglob("*.yaml")):
        text = path.read_text()
        if "{{" in text or path.parent.name == "work-pools":
            continue  # templates: validated once rendered, above
        out += [(f"{path.relative_to(ROOT)}#{i}", doc) for i, doc in enumerate(yaml.safe_load_all(text)) if doc]
    return out


@pytest.mark.parametrize("where,manifest", _shipped_manifests(), ids=lambda v: v if isinstance(v, str) else "")
def test_shipped_manifests_validate(where, manifest):
    validate(manifest)


def test_shipped_manifests_are_found():
    names = {where.split("#")[0] for where, _ in _shipped_manifests()}
    assert {"infra/storage/storage.yaml", "infra/mlflow/mlflow-server.yaml", "infra/kubernetes/rbac.yaml",
            "infra/kubernetes/network-policy.yaml"} <= names


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_network_policy_admits_only_our_pods_to_the_server_and_trainers():
    """The policies select the pods the flow renders, by the labels it gives them: the vLLM server (its
    dev-mode routes pause it and replace its weights) takes the trainers on any port and the flow-run
    pod on the HTTP port only; the trainers take each other and the server; nothing else is let in."""
    policies = {d["metadata"]["name"]: d for d in yaml.safe_load_all((INFRA / "kubernetes" / "network-policy.yaml").read_text())}
    server_pod = by_kind(server_manifests(SETTINGS, VLLMServerSpec(model="m"), "grpo-t-server-0"))["Job"]["spec"]["template"]
    trainer_pod = by_kind(training_manifests(SETTINGS, launch(2, 2), "grpo-t-train-1"))["Job"]["spec"]["template"]
    pool = json.loads((INFRA / "work-pools" / "kubernetes.json").read_text())
    flow_pod = pool["job_configuration"]["job_manifest"]["spec"]["template"]
    pods = {"server": server_pod["metadata"]["labels"], "trainer": trainer_pod["metadata"]["labels"],
            "flow": flow_pod["metadata"]["labels"], "other": {"app.kubernetes.io/name": "something-else"}}

    def admitted(policy: dict, source: str) -> list[object]:
        """The ports ``source`` may reach (["any"] for all), [] when it is not let in."""
        ports: list[object] = []
        for rule in policy["spec"]["ingress"]:
            if any(_selects(peer["podSelector"], pods[source]) for peer in rule["from"]):
                ports += [p["port"] for p in rule.get("ports", [])] or ["any"]
        return ports

    server, trainer = policies["grpo-vllm-server"], policies["grpo-trainer"]
    assert _selects(server["spec"]["podSelector"], pods["server"]) and not _selects(server["spec"]["podSelector"], pods["trainer"])
    assert _selects(trainer["spec"]["podSelector"], pods["trainer"])
    assert {p: admitted(server, p) for p in pods} == {"server": [], "trainer": ["any"], "flow": [8000], "other": []}
    assert {p: admitted(trainer, p) for p in pods} == {"server": ["any"], "trainer": ["any"], "flow": [], "other": []}
    assert all(p["spec"]["policyTypes"] == ["Ingress"] for p in policies.values())


# ------------------------------------------------------------------------------------------ provisioner
class RecordingCluster:
    """Just enough of an API server: stores created objects (schema-checked) and answers reads with
    the job statuses a test scripts, one per read, the last one sticking."""

    def __init__(self) -> None:
        self.objects: dict[str, dict] = {}
        self.deleted: list[str] = []
        self.statuses: dict[str, list[dict]] = {}
        self.pods: dict[str, list[dict]] = {}

    def handle(self, request: httpx.Request) -> httpx.Response:
        parts = request.url.path.strip("/").split("/")
        if request.method == "POST":
            body = json.loads(request.content)
            validate(body)
            self.objects[f"{parts[-1]}/{body['metadata']['name']}"] = body
            return httpx.Response(201, json=body)
        if request.method == "DELETE":
            self.deleted.append(f"{parts[-2]}/{parts[-1]}")
            self.objects.pop(f"{parts[-2]}/{parts[-1]}", None)
            return httpx.Response(200, json={})
        if parts[-1] == "pods":
            job = request.url.params["labelSelector"].split("=")[1]
            return httpx.Response(200, json={"items": self.pods.get(job, [])})
        if parts[-1] == "log":
            return httpx.Response(200, text="step 1 reward 0.5\n")
        key = f"{parts[-2]}/{parts[-1]}"
        if key not in self.objects:
            return httpx.Response(404, json={})
        script = self.statuses.get(parts[-1]) or [{}]
        status = script.pop(0) if len(script) > 1 else script[0]
        return httpx.Response(200, json={**self.objects[key], "status": status})


def provisioner(cluster: RecordingCluster) -> KubernetesProvisioner:
    api = KubernetesApi("https://k8s.invalid", None, False, transport=httpx.MockTransport(cluster.handle))
    return KubernetesProvisioner(SETTINGS, api, poll_s=0.0)


def test_provisioner_server_lifecycle():
    cluster = RecordingCluster()
    prov = provisioner(cluster)
    name = f"grpo-{prov.run_token}-server-0"
    job = f"{name}-0"
    # Pending, then running but loading the model, then ready.
    cluster.statuses[job] = [{}, {"active": 1}, {"active": 1, "ready": 1}]
    url = prov.start_server(VLLMServerSpec(model="m"), "/tmp", timeout_s=5)
    assert url == f"http://{name}.grpo.svc:8000"
    assert {f"services/{name}", f"jobs/{job}"} <= cluster.objects.keys()
    assert cluster.statuses[job] == [{"active": 1, "ready": 1}]  # it waited through both earlier states
    assert prov.server_alive(url)
    prov.stop_server(url)
    assert {f"jobs/{job}", f"services/{name}"} <= set(cluster.deleted)
    assert not prov.server_alive(url)


def test_provisioner_server_failure_is_reported():
    cluster = RecordingCluster()
    prov = provisioner(cluster)
    name = f"grpo-{prov.run_token}-server-0"
    cluster.statuses[f"{name}-0"] = [{"active": 1}, {"failed": 1}]
    with pytest.raises(RuntimeError, match="failed before serving"):
        prov.start_server(VLLMServerSpec(model="m"), "/tmp", timeout_s=5)
    assert {f"jobs/{name}-0", f"services/{name}"} <= set(cluster.deleted)


def test_fleet_replicas_render_validate_and_keep_their_names_across_a_restart():
    """N replicas: each its own Service (its stable URL for the run) and Job; a restarted replica is a new Job
    whose pod the same Service selects, so the trainers find it at the same URL."""
    cluster = RecordingCluster()
    prov = provisioner(cluster)
    spec = VLLMServerSpec(model="Qwen/Qwen3-0.6B", dtype="bfloat16", weight_transfer_backend="nccl")
    for i in range(3):
        cluster.statuses[f"grpo-{prov.run_token}-server-{i}-0"] = [{"active": 1, "ready": 1}]
    urls = [prov.start_server(spec.for_replica(i), "/tmp", timeout_s=5, replica=i, replicas=3) for i in range(3)]
    assert urls == [f"http://grpo-{prov.run_token}-server-{i}.grpo.svc:8000" for i in range(3)]
    services = {k: v for k, v in cluster.objects.items() if k.startswith("services/")}
    jobs = {k: v for k, v in cluster.objects.items() if k.startswith("jobs/")}
    assert len(services) == len(jobs) == 3  # every one validated (strict) as the cluster stand-in stored it
    seeds = sorted(int(j["spec"]["template"]["spec"]["containers"][0]["command"][
        j["spec"]["template"]["spec"]["containers"][0]["command"].index("--seed") + 1]) for j in jobs.values())
    assert seeds == [0, 1, 2]  # one spec, a sampling seed per replica
    # Replica 1's pod dies; the flow starts it again: a new Job, the same Service and URL.
    second = f"grpo-{prov.run_token}-server-1"
    cluster.statuses[f"{second}-0"] = [{"failed": 1}]
    assert not prov.server_alive(urls[1])
    cluster.statuses[f"{second}-1"] = [{"active": 1}, {"active": 1, "ready": 1}]
    prov.restart_server(urls[1], timeout_s=5)
    assert f"jobs/{second}-0" in cluster.deleted and f"jobs/{second}-1" in cluster.objects
    assert f"services/{second}" not in cluster.deleted and prov.server_alive(urls[1])
    service = cluster.objects[f"services/{second}"]
    pod = cluster.objects[f"jobs/{second}-1"]["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    others = [cluster.objects[f"jobs/grpo-{prov.run_token}-server-{i}-0"]["spec"]["template"] for i in (0, 2)]
    assert not any(service["spec"]["selector"].items() <= p["metadata"]["labels"].items() for p in others)
    for manifest in server_manifests(SETTINGS, spec.for_replica(1), second, job=f"{second}-1"):
        validate(manifest)


def test_provisioner_training_exit_codes(tmp_path):
    cluster = RecordingCluster()
    prov = provisioner(cluster)
    log_file = tmp_path / "train.log"

    # Success: the Job reports every completion (two nodes).
    first = f"grpo-{prov.run_token}-train-1"
    cluster.statuses[first] = [{"active": 2}, {"succeeded": 2}]
    cluster.pods[first] = [{"metadata": {"name": f"{first}-{i}"}, "status": {}} for i in (1, 0)]
    assert prov.run_training(TrainingLaunch(**{**launch(4, 2).__dict__, "log_file": str(log_file)})) == 0
    assert f"jobs/{first}" in cluster.deleted  # GPUs freed at once
    assert "step 1 reward 0.5" in log_file.read_text()

    # A node killed by SIGKILL (exit 137): reported like a local child killed by a signal.
    name = f"grpo-{prov.run_token}-train-2"
    cluster.statuses[name] = [{"failed": 1}]
    cluster.pods[name] = [{"metadata": {"name": f"{name}-0"},
                           "status": {"containerStatuses": [{"state": {"terminated": {"exitCode": 137}}}]}}]
    assert prov.run_training(launch(4, 2)) == -9

    # A Python error on a node: its exit code as is.
    name = f"grpo-{prov.run_token}-train-3"
    cluster.statuses[name] = [{"failed": 1}]
    cluster.pods[name] = [{"metadata": {"name": f"{name}-0"},
                           "status": {"containerStatuses": [{"state": {"terminated": {"exitCode": 1}}}]}}]
    assert prov.run_training(launch()) == 1
