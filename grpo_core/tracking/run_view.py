"""How a training run reads in MLflow's UI: the experiment's view, the charts that come first, the params and
the links. Pure functions; ``tracker.py``, the trainer and the flow apply them.

What MLflow's UI does with a run was read from its bundled JavaScript (``mlflow/server/js/build``, 3.17) and
checked in a browser against a real server (``docs/screenshots.py``):

- An experiment page opens on the GenAI views (traces, an empty overview) unless the URL says
  ``workflowType=machine_learning``: the UI keeps a workflow type of its own (that URL parameter, else the
  browser's last choice, else ``genai``) and in 3.17 takes the experiment's kind from it. Releases whose UI
  still reads the experiment's own kind take it from the tag ``mlflow.experimentKind``. So an experiment is
  created with that tag set to a training kind (``EXPERIMENT_TAGS``), and every link carries the parameter
  (``experiment_url``, ``run_url``).
- The runs table shows no metric column until someone picks one. A view saved as the experiment tag
  ``mlflow.sharedViewState.<key>`` is what the UI loads for a link with ``viewStateShareKey=<key>``; the
  experiment gets one that shows the headline metrics (``RUNS_VIEW``), and its link names it.
- A run's metric charts are grouped in sections named by the metric up to its last ``/``. Sections are sorted
  as JavaScript sorts strings (by code point: digits before capitals before ``_`` before lower case); the
  metrics without a ``/`` ("Model metrics") and ``system/`` come after all of them. The metrics a person reads
  to judge a run are therefore repeated under ``HEADLINE_SECTION`` (``with_headline``), which sorts first; the
  originals keep TRL's names (``reward``, ``loss``), so searches and comparisons with TRL runs still work.
- Params are strings, and searches compare them as strings (``params.learning_rate = '0.0002'``). A value is
  written as Python's ``str`` writes it (``param_text``), as transformers' MLflow callback does for a TRL run.
"""

from __future__ import annotations

import json
from typing import Any

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_EXPERIMENT_KIND = "custom_model_development"
"""The kind MLflow's UI itself writes for a "Machine learning" experiment (its other choice is GenAI)."""
TRAINING_WORKFLOW = "workflowType=machine_learning"
"""The URL parameter that makes MLflow's UI show runs, not GenAI traces."""
LOCAL_UI = "http://127.0.0.1:5000"
"""Where ``mlflow ui`` serves by default: the UI of a store that is a file or a database, not a server."""

HEADLINE_SECTION = "0_headline"
"""Sorts before every other section of metric charts (a digit comes before any letter)."""
HELDOUT_ACCURACY = "eval/accuracy"
"""The held-out accuracy the flow logs before training (step 0) and after the final weight sync (the last step)."""
HEADLINE_METRICS: dict[str, str] = {
    "reward": "reward",
    HELDOUT_ACCURACY: "heldout_accuracy",
    "loss": "loss",
    # How far apart sampler and trainer were on the step's trained tokens: the k3 estimate of KL(sampler || trainer)
    # per token (never negative, unlike the mean log-ratio ``sampling/logprob_diff_mean``, whose terms cancel).
    # The other mismatch metrics, and each one per staleness: the ``mismatch`` sections (docs/mismatch.md).
    "mismatch/k3_token": "mismatch_k3_token",
    "rollout/generated_tok_s": "tokens_per_s",
    "sample/staleness_mean": "staleness_mean",
}
"""Metrics repeated under ``HEADLINE_SECTION``: the source's name to the chart's name in that section."""


RUNS_VIEW = "training"
"""The key of the experiment's runs view (``runs_view_state``) in the tag ``mlflow.sharedViewState.<key>``."""


def runs_view_state() -> dict[str, Any]:
    """The runs table's state the experiment's link opens: the registered model and the headline metrics as
    columns, under their own names (the UI lays metric columns out sorted by name)."""
    return {"selectedColumns": ["attributes.`Models`", *(f"metrics.`{name}`" for name in HEADLINE_METRICS)]}


EXPERIMENT_TAGS = {EXPERIMENT_KIND_TAG: TRAINING_EXPERIMENT_KIND,
                   f"mlflow.sharedViewState.{RUNS_VIEW}": json.dumps(runs_view_state())}
"""Tags of an experiment this package makes: its kind, and the runs view its links open."""


def headline_name(source: str) -> str:
    return f"{HEADLINE_SECTION}/{HEADLINE_METRICS[source]}"


def with_headline(metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` and, for each headline metric among them, its copy under ``HEADLINE_SECTION``."""
    return {**metrics, **{headline_name(k): v for k, v in metrics.items() if k in HEADLINE_METRICS}}


# ---------------------------------------------------------------------------------------------- metrics
MULTI_TURN_METRICS = frozenset({
    "rollout/later_turns", "rollout/clean_turns", "rollout/fork_turns", "rollout/realign_turns",
    "rollout/fork_frac", "rollout/realign_frac", "rollout/realigned_tokens", "rollout/dropped_sequences",
})
"""Counters of turns after a rollout's first (re-tokenisation: clean, realigned, forked): zero in every step of a
run whose rollouts are one generation each."""


def constant_metrics(*, multi_turn: bool, world_size: int, lr_scheduler_type: str, weight_sync_encoding: str,
                     weight_sync_transport: str) -> frozenset[str]:
    """Step metrics whose value the run's settings fix: charted, they are flat lines. Each one's value is a param
    or a tag of the run instead, and the trainer's ``log_history`` keeps them all:

    - ``learning_rate`` under the ``constant`` schedule: the ``learning_rate`` param;
    - ``sync/mode``: the ``sync/mode`` tag names it;
    - ``sync/dense_bytes`` (the model's size in the wire dtype), and ``sync/bytes`` where every push is dense:
      tags of those names (``constant_tags``);
    - the multi-turn counters (``MULTI_TURN_METRICS``) of a run whose rollouts are single generations: 0;
    - ``batch/row_cost_imbalance`` on one rank: 1.
    """
    out = {"sync/mode", "sync/dense_bytes"}
    if lr_scheduler_type == "constant":
        out.add("learning_rate")
    if weight_sync_encoding == "dense" and weight_sync_transport == "group":
        out.add("sync/bytes")
    if not multi_turn:
        out |= MULTI_TURN_METRICS
    if world_size == 1:
        out.add("batch/row_cost_imbalance")
    return frozenset(out)


TAGGED_CONSTANTS = frozenset({"sync/bytes", "sync/dense_bytes"})
"""Constant metrics whose value no param or tag holds otherwise."""


def constant_tags(values: dict[str, float]) -> dict[str, str]:
    """Tags for the values of constant metrics that no param or tag holds otherwise (``TAGGED_CONSTANTS``)."""
    return {k: str(int(v)) if float(v).is_integer() else str(v) for k, v in values.items() if k in TAGGED_CONSTANTS}


# ---------------------------------------------------------------------------------------------- params
def param_text(value: Any) -> str | None:
    """A param's text: Python's ``str`` of a number, a bool or a string (``0.0002``, ``8``, ``True``), JSON of a
    list or a mapping; None for a setting left unset (None, an empty list or mapping), which is not logged."""
    if value is None or (isinstance(value, (list, tuple, dict)) and not value):
        return None
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, default=str)
    return str(value)


def as_params(values: dict[str, Any]) -> dict[str, str]:
    """``values`` as param texts, unset ones left out (``param_text``)."""
    return {k: text for k, v in values.items() if (text := param_text(v)) is not None}


def resolved_tags(values: dict[str, Any]) -> dict[str, str]:
    """What settings left to the run (``auto``, None) became, as tags ``resolved.<setting>``: a tag, not a param,
    because a resumed attempt may resolve them again on another machine."""
    return {f"resolved.{k}": text for k, v in values.items() if (text := param_text(v)) is not None}


def _lora_param(key: str) -> str:
    """A peft ``LoraConfig`` key under TRL's ``ModelConfig`` name (``r`` -> ``lora_r``)."""
    return key if key.startswith(("lora_", "use_")) else f"lora_{key}"


JOB_PARAM_NAMES = {"model": "model_name_or_path", "dataset": "dataset_name"}
"""Job keys a TRL script takes under another name (TRL's ``ModelConfig`` and ``ScriptArguments``)."""
UNLOGGED_JOB_KEYS = frozenset({"trainer", "server", "tracking", "peft_config", "rendezvous_address", "rendezvous_port"})
"""Job keys that are not one setting each (logged field by field) or say where the run happens, not what it trains."""
UNLOGGED_SERVER_KEYS = frozenset({"managed", "base_url", "startup_timeout_s"})
"""Server keys that say where or whether the flow starts the server, not how it serves."""


def job_params(job: dict[str, Any]) -> dict[str, Any]:
    """The job's settings beyond the trainer's, one param each under the name a TRL user knows: ``model_name_or_path``,
    ``dataset_name``, ``reward_funcs``; LoRA as ``use_peft`` and ``lora_*`` (``lora_r``, ``lora_alpha``,
    ``lora_target_modules``); the vLLM server's options as ``vllm_<option>`` (``vllm_max_model_len``). ``job`` is a
    ``JobConfig`` as a dict. Values stay as they are (``vllm_env`` a mapping): the tracker drops credential-like keys
    (``tracker.redact``) before it writes them as text."""
    values: dict[str, Any] = {JOB_PARAM_NAMES.get(k, k): v for k, v in job.items() if k not in UNLOGGED_JOB_KEYS}
    lora = job.get("peft_config")
    values["use_peft"] = lora is not None
    values.update({_lora_param(k): v for k, v in (lora or {}).items()})
    values.update({f"vllm_{k}": v for k, v in (job.get("server") or {}).items() if k not in UNLOGGED_SERVER_KEYS})
    return values


# ---------------------------------------------------------------------------------------------- links
def ui_base(tracking_uri: str) -> str:
    """The address of the MLflow UI that shows the store at ``tracking_uri``: the server itself, or where
    ``mlflow ui --backend-store-uri <store>`` serves for a file or database store."""
    return tracking_uri.rstrip("/") if tracking_uri.startswith(("http://", "https://")) else LOCAL_UI


def ui_command(tracking_uri: str) -> str | None:
    """The command that serves the UI of a file or database store (None for a server, which serves its own)."""
    if tracking_uri.startswith(("http://", "https://")):
        return None
    return f"mlflow ui --backend-store-uri {tracking_uri}"


def experiment_url(tracking_uri: str, experiment_id: str) -> str:
    """The experiment's runs (not its GenAI views) in the UI, with the headline metrics as columns."""
    return f"{ui_base(tracking_uri)}/#/experiments/{experiment_id}/runs?{TRAINING_WORKFLOW}&viewStateShareKey={RUNS_VIEW}"


def run_url(tracking_uri: str, experiment_id: str, run_id: str, tab: str | None = None) -> str:
    """A run's page (``tab``: ``model-metrics``, ``artifacts``, ...) in the UI."""
    path = f"runs/{run_id}" + (f"/{tab}" if tab else "")
    return f"{ui_base(tracking_uri)}/#/experiments/{experiment_id}/{path}?{TRAINING_WORKFLOW}"
