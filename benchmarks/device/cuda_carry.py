"""Which packages of requirements-cuda.lock travel to the GPU machine, and a check of what is installed there.

The GPU machine's image holds torch 2.11.0+cu130 and about two hundred other packages
(`cuda_image_packages.txt`) and has no network. `pack_vllm_cuda.sh` carries the lock's other packages, less
those named in `NOT_CARRIED` (each with the reason a run here does not import it). On the machine,
`python3 -m benchmarks.device.cuda_carry --check` prints every package of the lock with the version that
Python there resolves, and exits non-zero when a carried package is missing or a package that a run imports
does not import.

    python3 -m benchmarks.device.cuda_carry --list     # the names==versions to download (pack_vllm_cuda.sh)
    python3 -m benchmarks.device.cuda_carry --check    # on the GPU machine, after the set-up
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements-cuda.lock"
IMAGE = Path(__file__).with_name("cuda_image_packages.txt")

# Not carried: each is imported only by a feature a run on this machine does not use. The serving path of a
# dense or mixture-of-experts bf16 model in vLLM 0.25 imports none of them (vLLM checks for each before use).
NOT_CARRIED: dict[str, str] = {
    **dict.fromkeys(
        [
            "flashinfer-python", "flashinfer-cubin", "tilelang", "z3-solver",
            "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-cu13", "quack-kernels",
            "humming-kernels", "tokenspeed-mla", "tokenspeed-triton", "cuda-tile", "nvidia-cudnn-frontend",
            "fastsafetensors", "cuda-python", "nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-cuda-tileiras",
            "nvidia-nvvm", "nvidia-cuda-cccl",
        ],
        "optional vLLM kernels (FlashInfer, TileLang, CuTe DSL, DeepGEMM-style paths): vLLM falls back without them "
        "(its GPU sampler once FLASHINFER_SAMPLER_ENV is 0, which the server's launch sets where FlashInfer is "
        "missing). apache-tvm-ffi and torch-c-dlpack-ext are carried: the API server imports tvm_ffi",
    ),
    **dict.fromkeys(["pynvvideocodec", "torchcodec"], "video inputs of multimodal models"),
    **dict.fromkeys(
        ["boto3", "botocore", "s3transfer", "aiobotocore", "s3fs", "prefect-aws", "aioitertools"],
        "S3 storage: the GPU run writes to local storage (jmespath is carried: the API server imports it)",
    ),
    **dict.fromkeys(
        [
            "moto", "cfn-lint", "aws-xray-sdk", "py-partiql-parser", "responses", "ipykernel", "ipython",
            "ipython-pygments-lexers", "jedi", "parso", "debugpy", "comm", "matplotlib-inline", "stack-data",
            "asttokens", "executing", "pure-eval", "prompt-toolkit", "pexpect", "ptyprocess", "jupyter-client",
            "jupyter-core", "nbclient", "nbformat", "fastjsonschema", "tornado", "kubernetes-validate", "pyflakes",
            "jsonschema-path", "openapi-schema-validator", "openapi-spec-validator", "pathable", "lazy-object-proxy",
            "joserfc", "xmltodict", "playwright", "pyee", "greenlet-playwright",
        ],
        "the test suite, the notebooks and the browser checks: not run on the GPU machine",
    ),
    "uv": "the installer of scripts/setup.sh: the GPU machine installs from carried parts",
    # vLLM's own wheel is carried as a stripped archive instead (pack_vllm_cuda.sh says what it leaves out)
    "vllm": "carried as its own archive, not as a wheel",
}

# What a run imports on the GPU machine: each must import there after the set-up.
RUN_IMPORTS = [
    "vllm", "vllm.entrypoints.openai.api_server", "vllm.distributed.weight_transfer", "vllm.vllm_flash_attn",
    "torch", "transformers", "prefect", "mlflow", "grpo_core", "flows.train_flow",
]


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.lower())


def lock_pins(lock: Path = LOCK) -> dict[str, str]:
    """name -> version, for every package pinned in a uv lock file."""
    pins = {}
    for line in lock.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9_.-]*)==(\S+)", line)
        if match:
            pins[normalise(match[1])] = match[2]
    return pins


def image_packages(path: Path = IMAGE) -> set[str]:
    return {normalise(l) for l in path.read_text().split() if l and not l.startswith("#")}


def carried(pins: dict[str, str], image: set[str]) -> dict[str, str]:
    """The lock's packages that travel: not on the image, not named in NOT_CARRIED."""
    return {name: version for name, version in pins.items() if name not in image and name not in NOT_CARRIED}


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def check(pins: dict[str, str], image: set[str]) -> dict:
    """Every pin's state on this machine, and the run's imports; `ok` is false when a carried one is missing."""
    travel = carried(pins, image)
    rows, missing, differs = [], [], []
    for name, want in sorted(pins.items()):
        have = installed_version(name)
        if name == "vllm":
            source = "carried (archive)"
        elif name in travel:
            source = "carried"
        elif name in image:
            source = "image"
        else:
            source = "not carried: " + NOT_CARRIED[name]
        if have is None and (name in travel or name == "vllm"):
            missing.append(name)
        elif have is not None and have != want and not have.startswith(want + "+"):
            differs.append({"package": name, "lock": want, "installed": have, "from": source})
        rows.append({"package": name, "lock": want, "installed": have, "from": source})
    failed_imports = {}
    for module in RUN_IMPORTS:
        try:
            importlib.import_module(module)
        except Exception as exc:  # every failure is reported with its module, then the check fails
            failed_imports[module] = f"{type(exc).__name__}: {exc}"[:300]
    return {
        "ok": not missing and not failed_imports,
        "missing_carried": missing,
        "differs_from_lock": differs,
        "failed_imports": failed_imports,
        "packages": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--list", action="store_true", help="print the carried packages as name==version")
    mode.add_argument("--check", action="store_true", help="check this machine against the lock")
    parser.add_argument("--out", type=Path, help="--check: also write the whole report here as JSON")
    args = parser.parse_args(argv)
    pins, image = lock_pins(), image_packages()
    if args.list:
        print("\n".join(f"{n}=={v}" for n, v in sorted(carried(pins, image).items()) if n != "vllm"))
        return 0
    report = check(pins, image)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    for row in report["differs_from_lock"]:
        print(f"cuda set-up: {row['package']} {row['installed']} here, {row['lock']} in the lock ({row['from']})")
    for name in report["missing_carried"]:
        print(f"cuda set-up: MISSING {name}=={pins[name]}: a carried part did not arrive; run every part's setup.sh")
    for module, error in report["failed_imports"].items():
        print(f"cuda set-up: import {module} FAILED: {error}")
    carried_n = sum(1 for r in report["packages"] if r["from"].startswith("carried"))
    print(
        f"cuda set-up: {'OK' if report['ok'] else 'FAILED'}: {len(pins)} pinned, {carried_n} carried, "
        f"{len(report['differs_from_lock'])} differ from the lock, vllm {installed_version('vllm')}, "
        f"torch {installed_version('torch')}"
    )
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
