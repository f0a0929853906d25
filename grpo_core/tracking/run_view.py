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
- The runs table shows no metric column until someone picks one. A saved view is the experiment tag
  ``mlflow.sharedViewState.<key>`` holding ``{"name", "createdAt", "updatedAt", "state"}`` (times in ms, the
  state as JSON text): the UI lists it under "Views" (by name) and loads it for a link with
  ``viewStateShareKey=<key>``; a tag in another form is still loaded by such a link but not listed, so a reload
  or a bookmark loses it. The experiment gets one that shows the headline metrics (``RUNS_VIEW``,
  ``saved_view``), and its link names it.
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
import time
from typing import Any

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_EXPERIMENT_KIND = "custom_model_development"
"""The kind MLflow's UI itself writes for a "Machine learning" experiment (its other choice is GenAI)."""
TRAINING_WORKFLOW = "workflowType=machine_learning"
"""The URL parameter that makes MLflow's UI show runs, not GenAI traces."""

HEADLINE_SECTION = "0_headline"
"""Sorts before every other section of metric charts (a digit comes before any letter)."""
HELDOUT_ACCURACY = "heldout_accuracy"
"""The held-out accuracy the flow logs before training (step 0) and after the final weight sync (the last step): a
name without ``/``, so a search needs no quoting (``metrics.heldout_accuracy > 0.5``)."""
HELDOUT_CI95 = ("heldout_accuracy_ci95_low", "heldout_accuracy_ci95_high")
"""The bounds of its 95% interval over problems, at the same steps."""
CHART_ONLY_HEADLINES = ("mismatch/k3_token",)
"""Headline metrics charted but not listed as columns of the runs table: a run's last per-token KL says little as one
number, and the UI sorts metric columns by name, where this one would push the reward out of the first three."""
HEADLINE_METRICS: dict[str, str] = {
    "reward": "reward",
    HELDOUT_ACCURACY: HELDOUT_ACCURACY,
    "loss": "train_loss",
    # How far apart sampler and trainer were on the step's trained tokens: the k3 estimate of KL(sampler || trainer)
    # per token (never negative, unlike the mean log-ratio ``sampling/logprob_diff_mean``, whose terms cancel).
    # The other mismatch metrics, and each one per staleness: the ``mismatch`` sections (docs/mismatch.md).
    "mismatch/k3_token": "sampler_mismatch_k3",
    "rollout/generated_tok_s": "tokens_per_s",
    "sample/staleness_mean": "staleness_mean",
    # What the run generated and did not train, over the run so far (``training/waste.py``, docs/metrics.md): the
    # share of generated tokens dropped as stale, and the trained completions' mean length over the generated ones'.
    "waste/discarded_share_total": "wasted_token_share",
    "waste/length_ratio_total": "trained_to_generated_length",
}
"""Metrics repeated under ``HEADLINE_SECTION``: the source's name to the chart's name in that section. The UI lays a
section's charts out sorted by name, three to a row on a 1366-pixel screen: the names put the held-out accuracy and
the reward in the first row (``heldout_accuracy``, ``reward``, ``sampler_mismatch_k3``), the rest after."""


RUNS_VIEW = "training"
"""The key of the experiment's saved runs view (``saved_view``) in the tag ``mlflow.sharedViewState.<key>``."""
RUNS_VIEW_NAME = "Training: headline metrics"
"""The name the UI lists that view under ("Views")."""
SAVED_VIEW_PREFIX = "mlflow.sharedViewState."


def runs_view_state() -> dict[str, Any]:
    """The runs table's state the experiment's view holds: the registered model and the headline metrics as
    columns, under their own names (the UI lays metric columns out sorted by name: ``heldout_accuracy``, ``loss`` and
    ``reward`` first, on screen at 1366 pixels; the interval is on the run's page)."""
    return {"selectedColumns": ["attributes.`Models`", *(f"metrics.`{name}`" for name in HEADLINE_METRICS
                                                         if name not in CHART_ONLY_HEADLINES)]}


def saved_view(name: str, state: dict[str, Any], created_at_ms: int, updated_at_ms: int | None = None) -> str:
    """A saved view's tag value as MLflow's UI writes and lists it: its name, creation and update times (ms since
    the epoch) and the view's state as JSON text."""
    return json.dumps({"name": name, "createdAt": created_at_ms, "updatedAt": updated_at_ms or created_at_ms,
                       "state": json.dumps(state)})


def read_saved_view(value: str) -> tuple[str, dict[str, Any]] | None:
    """The name and state of a saved view's tag value, or None when the UI would not list it (another form)."""
    try:
        view = json.loads(value)
        if isinstance(view, dict) and isinstance(view.get("name"), str) and isinstance(view.get("state"), str) \
                and isinstance(view.get("createdAt"), (int, float)) and not isinstance(view["createdAt"], bool):
            return view["name"], json.loads(view["state"])
    except (TypeError, ValueError):
        pass
    return None


def experiment_tags(now_ms: int | None = None) -> dict[str, str]:
    """Tags of an experiment this package makes: its kind, and the runs view its links open (created ``now_ms``)."""
    created = int(time.time() * 1000) if now_ms is None else now_ms
    return {EXPERIMENT_KIND_TAG: TRAINING_EXPERIMENT_KIND,
            f"{SAVED_VIEW_PREFIX}{RUNS_VIEW}": saved_view(RUNS_VIEW_NAME, runs_view_state(), created)}


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


TRL_TRAINER_FIELDS = frozenset({
    # transformers' TrainingArguments
    "output_dir", "max_steps", "num_train_epochs", "logging_steps", "seed", "run_name", "report_to", "eval_strategy",
    "eval_steps", "learning_rate", "lr_scheduler_type", "warmup_steps", "weight_decay", "adam_beta1", "adam_beta2",
    "adam_epsilon", "max_grad_norm", "per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16",
    "gradient_checkpointing", "save_strategy", "save_steps", "save_total_limit", "resume_from_checkpoint",
    "ignore_data_skip",
    # TRL's GRPOConfig and AsyncGRPOConfig
    "num_generations", "num_generations_eval", "max_completion_length", "temperature", "top_p", "top_k",
    "chat_template_kwargs", "max_tool_calling_iterations", "fork_threshold_tokens", "reward_weights", "scale_rewards",
    "epsilon", "epsilon_high", "token_budget", "max_staleness", "queue_maxsize", "weight_sync_steps",
    "vllm_server_base_url", "vllm_server_timeout", "request_timeout", "log_completions", "num_completions_to_print",
})
"""``AsyncGRPOConfig`` fields that TRL (or transformers) has under the same name and meaning: logged under that name,
so a search written for a TRL run (``params.learning_rate``) finds ours."""
OWN_PREFIX = "grpo."
"""Params of this project's own settings (no TRL counterpart) are ``grpo.<setting>``: they sort together, apart from
TRL's, and a TRL name cannot be mistaken for one of ours."""
HELDOUT_BEFORE_AFTER = "heldout_before_after"
"""``do_eval`` as a param name: here it means the flow's held-out evaluation before and after training, which
beside ``eval_strategy=no`` (no evaluation during training) would read as a contradiction under transformers' name."""


def local_output_dir(output_dir: str) -> bool:
    return "://" not in output_dir


def trainer_param_values(values: dict[str, Any], server_urls: list[str] | None = None) -> dict[str, Any]:
    """The trainer's settings (``AsyncGRPOConfig`` as a dict) as params of what the run used: TRL's under TRL's names
    (``TRL_TRAINER_FIELDS``), the rest as ``grpo.<name>``; ``vllm_server_base_url`` the server(s) the run used
    (``server_urls``, where the flow started them), one URL or a list; ``do_eval`` as ``grpo.heldout_before_after``;
    a local ``output_dir`` as its folder's name (the machine's path is the tag ``resolved.output_dir``,
    ``machine_tags``)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key == "vllm_server_base_url" and server_urls:
            value = server_urls[0] if len(server_urls) == 1 else list(server_urls)
        elif key == "output_dir" and local_output_dir(str(value)):
            value = str(value).rstrip("/").rsplit("/", 1)[-1] or str(value)
        elif key == "do_eval":
            key = HELDOUT_BEFORE_AFTER
        out[key if key in TRL_TRAINER_FIELDS else f"{OWN_PREFIX}{key}"] = value
    return out


def machine_tags(output_dir: str) -> dict[str, str]:
    """Where this run's files are on the machine that ran it (a tag: another machine resolves it elsewhere)."""
    from pathlib import Path

    where = str(Path(output_dir).absolute()) if local_output_dir(output_dir) else output_dir
    return {"resolved.output_dir": where}


JOB_PARAM_NAMES = {"model": "model_name_or_path", "dataset": "dataset_name"}
"""Job keys a TRL script takes under another name (TRL's ``ModelConfig`` and ``ScriptArguments``)."""
TRL_JOB_KEYS = frozenset({"model_name_or_path", "dataset_name", "reward_funcs"})
"""Job keys under TRL's script names; the job's other keys are this project's (``OWN_PREFIX``)."""
UNLOGGED_JOB_KEYS = frozenset({"trainer", "server", "tracking", "peft_config", "rendezvous_address", "rendezvous_port"})
"""Job keys that are not one setting each (logged field by field) or say where the run happens, not what it trains."""
UNLOGGED_SERVER_KEYS = frozenset({"managed", "base_url", "startup_timeout_s"})
"""Server keys that say where or whether the flow starts the server, not how it serves."""


def job_params(job: dict[str, Any]) -> dict[str, Any]:
    """The job's settings beyond the trainer's, one param each: under the name a TRL user knows where TRL has one
    (``model_name_or_path``, ``dataset_name``, ``reward_funcs``; LoRA as ``use_peft`` and ``lora_*``: ``lora_r``,
    ``lora_alpha``, ``lora_target_modules``), else ``grpo.<key>`` (``grpo.max_resumes``), and the vLLM server's
    options as ``grpo.server.<option>`` (``grpo.server.max_model_len``). ``job`` is a ``JobConfig`` as a dict. Values
    stay as they are (``grpo.server.env`` a mapping): the tracker drops credential-like keys (``tracker.redact``)
    before it writes them as text."""
    values: dict[str, Any] = {}
    for key, value in job.items():
        if key in UNLOGGED_JOB_KEYS:
            continue
        name = JOB_PARAM_NAMES.get(key, key)
        values[name if name in TRL_JOB_KEYS else f"{OWN_PREFIX}{name}"] = value
    lora = job.get("peft_config")
    values["use_peft"] = lora is not None
    values.update({_lora_param(k): v for k, v in (lora or {}).items()})
    values.update({f"{OWN_PREFIX}server.{k}": v for k, v in (job.get("server") or {}).items()
                   if k not in UNLOGGED_SERVER_KEYS})
    return values


# ---------------------------------------------------------------------------------------------- links
def serves_ui(tracking_uri: str) -> bool:
    """Whether ``tracking_uri`` is a server, whose address is its UI's; a file or database store has a UI only while
    something serves it (``grpo ui``), at an address chosen then."""
    return tracking_uri.startswith(("http://", "https://"))


def grpo_command() -> str:
    """This installation's ``grpo`` command by its full path, so that it runs as printed in a new shell (one where
    the virtual environment is not active): the ``grpo`` script beside this Python, else this Python with ``-m``."""
    import shlex
    import sys
    from pathlib import Path

    script = Path(sys.executable).with_name("grpo")
    if script.is_file():
        return shlex.quote(str(script.absolute()))
    return f"{shlex.quote(str(Path(sys.executable).absolute()))} -m flows.cli"


def ui_command(tracking_uri: str, target: str) -> str | None:
    """The command that serves the UI of a file or database store and prints the run's links (None for a server,
    which serves its own): ``grpo ui <target>``, ``target`` a run's output folder or the store's URI."""
    import shlex

    if serves_ui(tracking_uri):
        return None
    return f"{grpo_command()} ui {shlex.quote(target)}"


def ui_base(address: str) -> str:
    """The UI's address without a trailing ``/``: a tracking server's URI, or where ``grpo ui`` serves a store."""
    if not serves_ui(address):
        raise ValueError(f"{address} is a store, not a UI address: serve it (grpo ui) and link to where that serves")
    return address.rstrip("/")


def experiment_url(ui: str, experiment_id: str) -> str:
    """The experiment's runs (not its GenAI views) in the UI at ``ui``, opened on its saved headline view."""
    return f"{ui_base(ui)}/#/experiments/{experiment_id}/runs?{TRAINING_WORKFLOW}&viewStateShareKey={RUNS_VIEW}"


def run_url(ui: str, experiment_id: str, run_id: str, tab: str | None = None) -> str:
    """A run's page (``tab``: ``model-metrics``, ``artifacts``, ...) in the UI at ``ui``."""
    path = f"runs/{run_id}" + (f"/{tab}" if tab else "")
    return f"{ui_base(ui)}/#/experiments/{experiment_id}/{path}?{TRAINING_WORKFLOW}"


def model_version_url(ui: str, name: str, version: str) -> str:
    """A registered model version's page in the UI at ``ui``."""
    return f"{ui_base(ui)}/#/models/{name}/versions/{version}?{TRAINING_WORKFLOW}"
