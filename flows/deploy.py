"""Register ``prefect.yaml``'s deployments with a Prefect server: work pools first, then ``prefect deploy``.

    grpo deploy                                   every deployment in ./prefect.yaml
    grpo deploy --name embedded-default           only these (repeat --name)
    PREFECT_API_URL=http://host:4200/api grpo deploy

``prefect deploy`` refuses a deployment whose work pool does not exist, and a pool's base job
template is what makes the flow pod (Kubernetes) or process (local) look the way the flow expects.
So each pool a selected deployment names is created, or has its template updated, from
``infra/work-pools/`` before the deployments are registered. Registration itself is Prefect's own
``prefect deploy``, so ``prefect.yaml`` means exactly what Prefect's documentation says it means.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

POOLS_INDEX = Path("infra") / "work-pools" / "pools.yaml"


@dataclass(frozen=True)
class PoolSpec:
    """One work pool as ``infra/work-pools/pools.yaml`` declares it."""

    name: str
    type: str
    base_job_template: dict[str, Any]
    description: str = ""


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
        specs[name] = PoolSpec(name, entry["type"], template, entry.get("description", ""))
    return specs


async def ensure_work_pools(specs: list[PoolSpec]) -> list[str]:
    """Create each pool, or update the template of one that exists; returns what was done per pool."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound

    done = []
    async with get_client() as client:
        for spec in specs:
            try:
                existing = await client.read_work_pool(spec.name)
            except ObjectNotFound:
                await client.create_work_pool(
                    WorkPoolCreate(
                        name=spec.name, type=spec.type, base_job_template=spec.base_job_template,
                        description=spec.description,
                    )
                )
                done.append(f"created work pool {spec.name} ({spec.type})")
                continue
            if existing.type != spec.type:
                raise ValueError(
                    f"work pool {spec.name!r} exists with type {existing.type!r}, but infra/ declares "
                    f"{spec.type!r}; delete it (prefect work-pool delete {spec.name}) or rename it"
                )
            await client.update_work_pool(
                spec.name, WorkPoolUpdate(base_job_template=spec.base_job_template, description=spec.description)
            )
            done.append(f"updated work pool {spec.name} ({spec.type})")
    return done


def deploy_command(file: Path, names: list[str] | None) -> list[str]:
    """The ``prefect deploy`` command line (non-interactive) for ``names`` or all deployments."""
    cmd = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--prefect-file", str(file)]
    if names:
        for name in names:
            cmd += ["--name", name]
    else:
        cmd.append("--all")
    return cmd


def deploy_all(file: str | Path = "prefect.yaml", names: list[str] | None = None) -> list[str]:
    """Ensure the work pools, then register the deployments; returns their names as ``flow/deployment``.

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
    for line in asyncio.run(ensure_work_pools([specs[p] for p in pool_names])):
        print(line)
    short_names = [n.split("/")[-1] for n in names] if names else None
    subprocess.run(deploy_command(path, short_names), cwd=root, check=True)
    # Every deployment here runs the same flow; its name comes from the @flow decorator.
    from flows.train_flow import grpo_train

    return [f"{grpo_train.name}/{d['name']}" for d in deployments]
