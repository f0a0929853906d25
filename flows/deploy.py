"""Register ``prefect.yaml``'s deployments with a Prefect server: work pools first, then ``prefect deploy``.

    grpo deploy                                   every deployment in ./prefect.yaml
    grpo deploy --name embedded-default           only these (repeat --name)
    PREFECT_API_URL=http://host:4200/api grpo deploy

``prefect deploy`` refuses a deployment whose work pool does not exist, and a pool's base job
template is what makes the flow pod (Kubernetes) or process (local) look the way the flow expects.
So each pool a selected deployment names is created, or has its template updated, from
``infra/work-pools/`` before the deployments are registered, with Prefect's own
``prefect work-pool create --overwrite``. Registration itself is Prefect's own ``prefect deploy``, so
``prefect.yaml`` means exactly what Prefect's documentation says it means, with one addition: each
deployment's ``job`` is registered whole, every value the run will use written out (``full_jobs``), so the
UI's run form shows the defaults the run takes (the two reward functions, ``report_to: mlflow``) instead
of empty fields. ``prefect deploy --all`` on the file itself registers the same runs with a sparser form.

Deployments run where the worker runs: ``outputs/deployments/<name>`` under this checkout, and their
MLflow runs go to a SQLite store there unless the worker's environment sets ``MLFLOW_TRACKING_URI``
(README, "Deploy and trigger from Prefect").
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from flows.train_flow import grpo_train
from grpo_core.launch.job import JobConfig

POOLS_INDEX = Path("infra") / "work-pools" / "pools.yaml"


@dataclass(frozen=True)
class PoolSpec:
    """One work pool as ``infra/work-pools/pools.yaml`` declares it."""

    name: str
    type: str
    base_job_template: dict[str, Any]


def load_project(path: str | Path) -> dict[str, Any]:
    """``prefect.yaml`` as data (anchors and merge keys resolved by the YAML loader)."""
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict) or not data.get("deployments"):
        raise ValueError(f"{path}: no deployments declared")
    return data


def selected_deployments(project: dict[str, Any], names: list[str] | None) -> list[dict[str, Any]]:
    """The deployments called ``names`` (all when None); an unknown name is an error listing the known ones."""
    deployments = project["deployments"]
    if not names:
        return list(deployments)
    known = {d["name"]: d for d in deployments}
    # ``prefect deploy --name`` also accepts flow-name/deployment-name; match on the deployment part.
    wanted = [n.split("/")[-1] for n in names]
    missing = [n for n in wanted if n not in known]
    if missing:
        raise ValueError(f"no deployment named {missing}; prefect.yaml declares {sorted(known)}")
    return [known[n] for n in wanted]


def load_pool_specs(root: str | Path) -> dict[str, PoolSpec]:
    """Every pool in ``infra/work-pools/pools.yaml`` under ``root``, with its base job template loaded."""
    index_path = Path(root) / POOLS_INDEX
    index = yaml.safe_load(index_path.read_text())
    specs = {}
    for name, entry in index.items():
        template = json.loads((index_path.parent / entry["template"]).read_text())
        specs[name] = PoolSpec(name, entry["type"], template)
    return specs


def work_pool_command(spec: PoolSpec, template_path: Path) -> list[str]:
    """``prefect work-pool create`` for ``spec``: creates the pool, or replaces the template of one that exists."""
    return [sys.executable, "-m", "prefect", "--no-prompt", "work-pool", "create", spec.name, "--type", spec.type,
            "--base-job-template", str(template_path), "--overwrite"]


def ensure_work_pools(specs: list[PoolSpec], root: Path) -> None:
    """Create or update each pool through Prefect's CLI (a pool of another type is refused by Prefect)."""
    index = yaml.safe_load((root / POOLS_INDEX).read_text())
    for spec in specs:
        template = (root / POOLS_INDEX).parent / index[spec.name]["template"]
        subprocess.run(work_pool_command(spec, template), cwd=root, check=True)


def deploy_command(file: Path, names: list[str] | None) -> list[str]:
    """The ``prefect deploy`` command line (non-interactive) for ``names`` or all deployments."""
    cmd = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--prefect-file", str(file)]
    if names:
        for name in names:
            cmd += ["--name", name]
    else:
        cmd.append("--all")
    return cmd


def full_jobs(project: dict[str, Any]) -> dict[str, Any]:
    """``project`` with each deployment's ``job`` parameter replaced by the whole ``JobConfig`` it validates to:
    every value written out, defaults included, as the run will use them (an invalid job fails here, named)."""
    out = copy.deepcopy(project)
    for deployment in out["deployments"]:
        parameters = deployment.get("parameters") or {}
        if "job" in parameters:
            try:
                parameters["job"] = JobConfig.model_validate(parameters["job"]).model_dump(mode="json")
            except ValueError as exc:
                raise ValueError(f"deployment {deployment['name']!r}: {exc}") from exc
    return out


def deploy_all(file: str | Path = "prefect.yaml", names: list[str] | None = None) -> list[str]:
    """Ensure the work pools, then register the deployments with their jobs whole (``full_jobs``); returns their
    names as ``flow/deployment``.

    Runs in the folder that holds ``file``: entry points and ``infra/`` are relative to it.
    """
    path = Path(file).absolute()
    root = path.parent
    project = load_project(path)
    deployments = selected_deployments(project, names)
    specs = load_pool_specs(root)
    pool_names = sorted({d["work_pool"]["name"] for d in deployments})
    unknown = [p for p in pool_names if p not in specs]
    if unknown:
        raise ValueError(f"work pools {unknown} have no template in {POOLS_INDEX}")
    resolved = yaml.safe_dump(full_jobs(project), sort_keys=False)
    ensure_work_pools([specs[p] for p in pool_names], root)
    short_names = [n.split("/")[-1] for n in names] if names else None
    # Beside the original, so that whatever Prefect resolves against the file's folder resolves the same.
    with tempfile.NamedTemporaryFile("w", dir=root, prefix=".grpo-deploy-", suffix=".yaml") as full:
        full.write(resolved)
        full.flush()
        subprocess.run(deploy_command(Path(full.name), short_names), cwd=root, check=True)
    # Every deployment here runs the same flow; its name comes from the @flow decorator.
    return [f"{grpo_train.name}/{d['name']}" for d in deployments]
