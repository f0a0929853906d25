"""``AsyncGRPOConfig``: every setting of a run, declared once, typed, bounded and documented.

Each field's type (``Literal`` choices, ``Field`` bounds), default and docstring are declared here only. From that
come the checks at construction (pydantic, strict), the job file and the Prefect parameter form
(``grpo_core.launch.job``), the vLLM server command (``VLLMServerSpec.for_run``) and the objective's ``LossConfig``.
Nothing is rewritten after construction: values that depend on others or on the device come from ``resolved_*``
methods. Field names follow TRL's ``AsyncGRPOConfig`` / ``TrainingArguments``, so a config written for that trainer
reads the same here; it stays a ``@dataclass`` that a script extends the same way (``class MyConfig(AsyncGRPOConfig)``).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, TypeAdapter

from grpo_core.config_checks import ConfigError, check_fields, check_known_keys, fail_field, parse_kernel_ref
from grpo_core.config_sections import Section, settings_type
from grpo_core.staleness import samples_ahead
from grpo_core.vllm_lines import ipc_unavailable


LoraRank = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]
"""The values vLLM accepts as the server's largest LoRA rank (``ServerOptions.max_lora_rank``)."""

AttentionBackendName = Literal["auto", "kernels", "flash_attn_cute", "torch_varlen", "aten_flash", "reference"]
"""Kernels of tree attention (``grpo_core.models.attention.backends`` loads them and orders ``auto``'s choice)."""

AUTO_DENSE_MAX_LOGITS = 2**32
"""``logprob_chunk_size="auto"``: a row whose trained tokens x vocabulary exceed this takes the chunked head
(2^32 fp32 logits are 16 GiB; 28k trained tokens at Qwen3's 151,936-token vocabulary). Below it the dense head,
which fits and is faster at the row sizes measured (benchmarks/README.md, "The log-prob head's share of the
remaining gap")."""
AUTO_CHUNK_LOGITS = 2**29
"""``logprob_chunk_size="auto"``: logits per chunk (2 GiB in fp32; 3,533 tokens at a 151,936-token vocabulary)."""

TRL_COMPATIBILITY_ONLY = frozenset({"ignore_data_skip"})
"""Fields accepted so that a TRL config reads the same, with the only value that behaves here."""


@dataclass
class AsyncGRPOConfig:
    """Configuration of an asynchronous GRPO run (trainer, rollout worker and weight sync)."""

    __pydantic_config__ = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    # ---- output, steps and logging --------------------------------------------------------------
    output_dir: str = "outputs/grpo"
    """Where checkpoints, the server log and the LoRA serving cache go; any fsspec URL (``s3://...``)."""
    max_steps: int = 200
    """Optimizer steps to train; <= 0 trains for ``num_train_epochs`` passes over the prompts instead."""
    num_train_epochs: Annotated[float, Field(ge=0)] = 1.0
    """Passes over the prompts, used only when ``max_steps`` <= 0."""
    logging_steps: Annotated[int, Field(ge=1)] = 1
    """Log metrics (and completions, see ``log_completions``) every N optimizer steps."""
    seed: int = 0
    """Seed for data order, sampling and dropout."""
    run_name: str | None = None
    """Name of the tracking run; default: ``<model>-<task>-<config hash>`` from the flow, else the output folder's name."""
    report_to: Literal["mlflow", "none"] = "none"
    """Where metrics go: ``none`` (the default, as in transformers' ``TrainingArguments`` and so TRL: metrics stay in
    ``trainer.state.log_history``) or ``mlflow`` (the server in ``MLFLOW_TRACKING_URI``, else MLflow's default store;
    needs the ``mlflow`` package, in the ``flows`` extra). A job run by the flow tracks in MLflow by default."""
    tracking_flush_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    """Metrics, tags and checkpoint references reach MLflow from a queue that keeps retrying while the server is
    unreachable (training goes on; nothing is lost or logged twice); when training ends (or fails) the trainer waits up
    to this long for the queue to drain, then names what it could not deliver."""
    log_completions: bool = False
    """Log a table of prompts, completions and rewards to the tracker every ``logging_steps``."""
    num_completions_to_log: Annotated[int, Field(ge=1)] | None = None
    """With ``log_completions``: rows of each logged step in the table, its first groups (None: every completion of
    the step, as TRL logs them). They go to a table MLflow's UI shows as one: ``completions/step-N.json``, or in a run
    too long for a file per step, a file per block of steps (``grpo_core/tracking/tables.py``)."""
    num_completions_to_print: Annotated[int, Field(ge=0)] = 3
    """With ``log_completions``: the rows of the console's completions table (``print_completions_steps``)."""
    print_completions_steps: Annotated[int, Field(ge=1)] = 20
    """With ``log_completions``: print a compact table of ``num_completions_to_print`` completions (reward, each reward
    function's score, prompt and completion cut to a line) every N optimizer steps, at a step that is also logged; the
    console otherwise gets one line per logged step. Every logged step's completions go to the tracker in full."""

    # ---- evaluation -----------------------------------------------------------------------------
    # One set of held-out settings, under transformers' and TRL's names; a job's flow derives its evaluation
    # before and after training from them too (``runs_evaluation``).
    do_eval: bool = False
    """Evaluate on the held-out prompts, as transformers' ``do_eval`` tells a training script to: the job flow
    samples ``eval_dataset`` (the data set's ``eval`` split) from the server before training and after the final
    weight sync, scored by ``reward_funcs`` (``eval_accuracy_before``/``_after``: the first one's mean)."""
    eval_strategy: Literal["no", "steps"] = "no"
    """``steps``: sample ``eval_dataset`` from the server every ``eval_steps`` (right after a weight sync) and log
    ``eval/reward`` and each reward function's mean; ``no``: never."""
    eval_steps: Annotated[int, Field(ge=1)] = 50
    """Evaluate every N optimizer steps when ``eval_strategy`` is ``steps``."""
    num_generations_eval: Annotated[int, Field(ge=1)] | None = None
    """Completions per evaluation prompt; None: ``num_generations``."""
    eval_beside_training: bool = False
    """With ``eval_strategy="steps"``: run each evaluation in a thread beside training instead of in the step. The
    step does not wait for it; its ``eval/*`` metrics are logged against the step whose weights it evaluated, once it
    ends, with ``eval/version_share``: the share of its completions sampled entirely under those weights (the server
    takes later pushes meanwhile). One runs at a time; one due while another runs is skipped (``eval/skipped``).
    The job flow's evaluation before and after training is unchanged."""
    eval_beside_prompts_in_flight: Annotated[int, Field(ge=1)] = 32
    """Held-out prompts an evaluation beside training rolls out at once (each with ``num_eval_generations()``
    completions). Fewer leave more of the server to the training's rollouts, so steps wait less, and make the
    evaluation take longer (an evaluation still running when the next is due skips it: ``eval/skipped``). A blocking
    evaluation, in the step, always rolls out 32 at once."""

    # ---- optimisation ---------------------------------------------------------------------------
    learning_rate: Annotated[float, Field(gt=0)] = 1e-6
    """Peak AdamW learning rate."""
    lr_scheduler_type: Literal["constant", "constant_with_warmup", "linear", "cosine"] = "constant"
    """Learning-rate schedule (transformers' ``get_scheduler``): ``constant`` ignores ``warmup_steps``;
    ``constant_with_warmup``, ``linear`` and ``cosine`` warm up linearly first, then hold or decay to 0 at ``max_steps``."""
    warmup_steps: Annotated[int, Field(ge=0)] = 0
    """Linear warm-up steps (schedules other than ``constant``)."""
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    """AdamW weight decay."""
    adam_beta1: Annotated[float, Field(ge=0, lt=1)] = 0.9
    """AdamW beta1."""
    adam_beta2: Annotated[float, Field(ge=0, lt=1)] = 0.999
    """AdamW beta2."""
    adam_epsilon: Annotated[float, Field(gt=0)] = 1e-8
    """AdamW epsilon."""
    max_grad_norm: Annotated[float, Field(ge=0)] = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    per_device_train_batch_size: Annotated[int, Field(ge=1)] = 8
    """Samples each rank trains per micro-batch at most (a row also stops at ``token_budget``)."""
    gradient_accumulation_steps: Annotated[int, Field(ge=1)] = 1
    """Micro-batches per optimizer step."""
    bf16: bool | None = None
    """bfloat16 compute with fp32 master weights; checkpoints are written in bf16. None (default): on for CUDA
    devices that support it, as in TRL; fp32 on CPU, where the server samples in fp32 and the trainer's log-probs
    must match its (said once at start-up)."""
    fp16: bool = False
    """float16 compute with fp32 master weights and dynamic loss scaling (CUDA only); excludes ``bf16``."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    fsdp_reshard_after_forward: bool = True
    """FSDP2: free each decoder layer's gathered weights after its forward and gather them again for
    backward (less memory); False keeps them from forward to backward (one gather fewer per layer)."""
    fsdp_keep_weights_between_micro_batches: bool | Literal["auto"] = "auto"
    """FSDP2 on one rank: keep each decoder layer's gathered compute weights from one micro-batch's backward into
    the next micro-batch's forward, and free them after the step's last backward (the optimizer then changes the
    master weights). A step then gathers each layer once per micro-batch plus once, instead of twice per
    micro-batch; on one rank a gather is the cast of the fp32 master weights to bf16. The kept weights fill up as
    backward frees the activations, and the next forward frees each layer after it runs (with
    ``fsdp_reshard_after_forward``), so the peak is where it was unless rows are short and the model large
    (benchmarks/README.md, "FSDP2 and MFU": 0.97x the fwd+bwd time at the same peak). With
    ``fsdp_reshard_after_forward=False`` as well, a step gathers each layer once, for 2 bytes a parameter more at
    the peak. ``auto``: on with one rank and no ``fsdp_cpu_offload``, off otherwise. ``True`` is refused on several
    ranks (each would hold the whole model) and with ``fsdp_cpu_offload`` (the weights would stay on the GPU)."""
    fsdp_cpu_offload: bool = False
    """FSDP2: keep the sharded weights, gradients and optimizer state in host memory (CUDA only);
    the optimizer step then runs on the CPU."""
    compile_mode: Literal["auto", "none", "pointwise", "layers"] = "auto"
    """``torch.compile`` per decoder layer: ``none``; ``pointwise`` (the MLP and the norms: element-wise
    ops fuse, attention stays eager); ``layers`` (whole layers, tree attention traced too); ``auto``:
    ``layers`` when training on CUDA, ``none`` elsewhere. ``layers`` is the default on GPUs because it is
    both the fastest and, against an fp32 reference, no less accurate than eager bf16 in loss, log-probs and
    gradients; the first step pays the compilation. Figures: benchmarks/README.md, "MFU: FA2 against FA4" and
    "Compile numerics: the rule for the default"."""
    compile_graph_breaks: Literal["auto", "nested", "outer"] = "auto"
    """Where a compiled layer's graph ends when a kernel from outside PyTorch breaks it (tree attention's and Gated
    DeltaNet's kernels do; ``compile_mode="layers"`` only). ``nested``: the compiler resumes tracing inside the
    project's function that calls the kernel, so what crosses the break is the tensor that function hands the
    kernel, row-major (PyTorch's ``nested_graph_breaks``). ``outer``: PyTorch's default; the graph ends where the
    model's own code (transformers') calls that function, so what crosses is the model's transposed view, and the
    backward gets its gradient copied channel-first: a Gated DeltaNet layer's input projection then runs its two
    backward matmuls on a gradient whose leading dimension is the row's length, slow where that is not a multiple
    of 8 (``tests/test_compiled_layers.py``). ``auto``: ``nested`` where the installed PyTorch has it (2.9 and
    later), else ``outer``. The run's ``resolved.compile_graph_breaks`` tag records the choice."""
    attention_backend: AttentionBackendName = "auto"
    """Kernel of tree attention. ``auto``: the first that loads and passes a start-up probe on a small tree (output and
    gradients against the dense reference), in the order of the GPU type (``BACKEND_ORDER`` in
    ``grpo_core/models/attention/backends.py``; Hopper and Blackwell: ``kernels``, ``flash_attn_cute``,
    ``torch_varlen``, ``aten_flash``), else ``reference``; each one passed over is logged with its reason. A name
    forces that kernel, and start-up fails, naming the fix, where it cannot run. ``kernels``: a FlashAttention build
    loaded with the ``kernels`` package (see ``attention_kernel``); ``flash_attn_cute``: FlashAttention-4
    (``pip install flash-attn-4``); ``torch_varlen``: PyTorch's FlashAttention-2 (``varlen_attn``); ``aten_flash``:
    the same through an older PyTorch op; ``reference``: dense PyTorch attention, any device, memory growing with
    the square of the row (the only one on CPU). The run's ``resolved.attention_backend`` tag records the choice."""
    tree_attention_plan: Literal["auto", "split", "gather"] = "auto"
    """How a fused kernel runs a tree row's attention. ``split``: one call for every segment's own tokens and one
    per ancestor depth (the queries below each ancestor against its keys), merged by log-sum-exp; no key is copied
    per path, so nothing of the paths' length is computed or saved (``grpo_core/models/attention/split.py``). Needs a
    kernel with log-sum-exp entry points: ``flash_attn_cute``, ``torch_varlen``, ``aten_flash``. ``gather``: K/V
    copied along every root-to-segment path and one causal varlen call (any kernel; see ``tree_kv_regather``).
    ``auto``: per row, ``split`` where the row's paths hold at least 3 keys per token of the row
    (``SPLIT_MIN_PATHS_PER_TOKEN``; long prompts shared by many completions) and the kernel has the entry points and
    passes the start-up probe that way, else ``gather``: split is ahead where paths are long and behind where they
    are short (benchmarks/README.md, "Tree attention split by ancestor level"). ``resolved.attention_backend`` shows the
    plan (``+split``, ``+split/gather``). Ignored by ``reference``."""
    tree_kv_regather: Literal["eager", "always", "never"] = "eager"
    """The gather plan (``tree_attention_plan``): whether a tree row's attention keeps, for backward, the K/V it
    gathered along every root-to-segment path
    (several times the row's own K/V at high packing ratios) or gathers it again there (bitwise the same
    result). ``eager``: re-gather where attention runs eagerly (``compile_mode`` ``none``/``pointwise``, the CPU);
    compiled layers keep the copy. ``always``: under compiled layers too, by running each tree row's attention
    outside the compiled graph. ``never``: keep it. Re-gathering lowers a tree row's peak memory towards a flat
    row's for a small share of the step, a larger one under compiled layers (benchmarks/README.md, "Re-gathering
    K/V in backward")."""
    attention_kernel: str | None = None
    """The ``kernels`` backend's kernel: a Hub kernel at a major version or a revision
    (``kernels-community/flash-attn3@1``, ``owner/name@main``) or a local kernel folder (``/path``, ``./path``,
    ``~/path``). None: the GPU type's default (``DEFAULT_HUB_KERNELS``: FlashAttention-3 on Hopper, aiter on ROCm,
    none elsewhere), fetched into the Hugging Face cache on first use (``HF_HUB_OFFLINE=1``: cached ones only)."""
    logprob_chunk_size: Annotated[int, Field(ge=1)] | Literal["auto"] | None = None
    """Log-probs of a row's trained tokens this many at a time, from the final hidden states: each chunk's
    ``[chunk, vocab]`` logits exist only while it is computed and again in backward, never the row's whole
    ``[trained, vocab]`` (bf16 logits plus their fp32 log-softmax: 64k trained tokens of a 152k vocabulary are
    56 GiB). Costs the head's matmul once more in backward. None: one pass through the model's head
    (fastest while it fits); ``auto``: one pass while trained tokens x vocabulary <= 2^32, else chunks of 2^29
    logits' worth of tokens (``AUTO_DENSE_MAX_LOGITS``, ``AUTO_CHUNK_LOGITS``). Refused for models that rescale
    their logits after the head (Gemma's softcapping, Cohere's and Granite's scales)."""

    # ---- generation -----------------------------------------------------------------------------
    num_generations: Annotated[int, Field(ge=2)] = 8
    """Rollouts per prompt (one group); the advantage baseline is the group's mean reward."""
    max_completion_length: Annotated[int, Field(ge=1)] = 2048
    """Most tokens generated per rollout, summed over its turns (never past the server's context length)."""
    temperature: Annotated[float, Field(gt=0)] = 1.0
    """Sampling temperature; the trainer's log-probs use the same temperature."""
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    """Nucleus sampling; < 1 makes the trainer renormalise over each token's candidate set (set ``top_k`` too)."""
    top_k: Annotated[int, Field(ge=0)] = 0
    """Top-k sampling (0 = off); > 0 makes the trainer renormalise over each token's candidate set."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra keyword arguments for ``apply_chat_template`` when building prompts."""
    max_tool_calling_iterations: Annotated[int, Field(ge=0)] | None = None
    """Most tool-calling turns per rollout (None: until the model stops calling or the budget ends)."""
    tool_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    """Per-call timeout of a tool; a timed-out call returns its error to the model."""
    fork_threshold_tokens: Annotated[int, Field(ge=1)] = 1024
    """Multi-turn re-tokenisation drift (tokens) above which a turn forks a new sequence instead of realigning."""
    multi_turn_prompts: Literal["tokens", "messages"] = "tokens"
    """How each later turn of a multi-turn rollout gets its prompt. ``"tokens"``: the token ids the server returned,
    extended by the new messages only, so trained tokens are the sampled ones (``grpo_core.rollout.token_prompts``;
    a turn that cannot falls back and counts in ``rollout/token_path_fallbacks``). ``"messages"``: re-render the
    conversation and reconcile (CLEAN / REALIGN / FORK, ``fork_threshold_tokens``)."""

    environment: str | None = None
    """An existing environment as the run's data and rewards (``grpo_core.environments``, ``environments`` extra):
    ``"verifiers:<taskset id>"`` (an installed taskset: its tasks, rubric functions and weights) or
    ``"reasoning_gym:<generator name>"``; the trainer then takes neither ``reward_funcs`` nor ``train_dataset``."""
    environment_args: dict[str, Any] | None = None
    """Keyword arguments of ``environment``: the taskset config's fields, or the generator's (``grpo_core.environments``)."""

    # ---- rewards and advantages -----------------------------------------------------------------
    reward_weights: list[float] | None = None
    """Weight of each reward function in the summed reward (default: all 1)."""
    scale_rewards: bool = True
    """Divide group advantages by the group's reward std."""
    no_signal_patience_steps: Annotated[int, Field(ge=0)] = 20
    """A group whose rollouts all scored the same teaches nothing and is dropped. Once this many steps' worth of
    groups in a row were dropped so, the run stops with ``NoLearningSignalError`` (the policy collapsed to one
    reward, or solves every prompt): the trainer would otherwise wait for a trainable group forever. The flow
    does not resume such a run. 0: wait forever (a warning every minute still says why)."""

    # ---- objective ------------------------------------------------------------------------------
    epsilon: Annotated[float, Field(gt=0, lt=1)] = 0.2
    """Lower clip of the importance ratio: for a negative advantage the ratio is not pushed below ``1 - epsilon``."""
    epsilon_high: Annotated[float, Field(ge=0)] = 0.28
    """Upper clip: for a positive advantage the ratio is not pushed above ``1 + epsilon_high`` (clip-higher: larger
    than ``epsilon`` so that rare tokens with good outcomes can still grow)."""
    score_centering: bool = True
    """Subtract the expected score over the sampler's top tokens at each trained position."""
    score_centering_weights: Literal["importance", "sampler"] = "importance"
    """Weights of the centering baseline over the top-N: ``importance`` (the sampler's probabilities times each
    candidate's clipped ratio, zero-mean for any ratio) or ``sampler`` (the sampler's probabilities alone, exact
    only when every candidate has the same ratio, e.g. pure top-k truncation)."""
    num_sampler_logprobs: Annotated[int, Field(ge=0)] = 8
    """Top-N sampler log-probs requested per generated token (for score centering); 0 turns centering off.
    The server's log-prob cap (``ServerOptions``/``VLLMServerSpec.max_logprobs``) must be at least N + 1."""
    vllm_importance_sampling_clip_min: Annotated[float, Field(ge=0, lt=1)] = 0.5
    """Tokens whose trainer/sampler ratio falls below this are dropped from the loss (0.5: a factor of two in
    probability, beyond the drift of a few optimizer steps or bf16-vs-fp32 kernels)."""
    vllm_importance_sampling_clip_max: Annotated[float, Field(gt=1)] = 2.0
    """Tokens whose trainer/sampler ratio rises above this are dropped from the loss (symmetric in log space)."""
    vllm_importance_sampling_correction: bool = True
    """Correct the objective for the gap between the sampler's and the trainer's probabilities, as
    ``vllm_importance_sampling_mode`` says. False: every token keeps its raw ratio trainer/sampler as its weight
    (the PPO clip still applies); only tokens without a finite ratio are left out. docs/mismatch.md compares them."""
    vllm_importance_sampling_mode: Literal["token_mask", "token_truncate", "sequence_mask", "sequence_truncate"] = (
        "token_mask")
    """How the ratio r = trainer/sampler of each trained token weighs it (TRL's names; docs/mismatch.md has the
    formulas). ``token_mask``: a token whose r leaves [``vllm_importance_sampling_clip_min``,
    ``vllm_importance_sampling_clip_max``] is dropped, the others weigh r. ``token_truncate``: every token weighs
    min(r, ``vllm_importance_sampling_cap``) (truncated importance sampling). ``sequence_mask`` and
    ``sequence_truncate``: the same on the sample's geometric-mean ratio (the exponential of its tokens' mean
    log-ratio), which then weighs each of its tokens. Unlike TRL, whose sequence modes take the product of the
    ratios and whose masks drop only ratios above the cap, the sequence ratio here does not grow with the length and
    the masks keep the two-sided bounds. The default keeps this trainer's earlier behaviour."""
    vllm_importance_sampling_cap: Annotated[float, Field(gt=1)] = 2.0
    """The ``*_truncate`` modes: the largest weight a token (or a sequence) takes; larger ratios are truncated to it
    (the same bound as ``vllm_importance_sampling_clip_max`` by default, so that switching between a mask and a
    truncation changes only what happens to the ratios beyond it)."""

    # ---- asynchrony -----------------------------------------------------------------------------
    max_staleness: Annotated[int, Field(ge=0)] = 4
    """Weight updates (pushes to the server) a sample may lag behind the trainer before it counts as stale
    (``stale_samples`` says what happens to it then)."""
    stale_samples: Literal["drop", "keep"] = "keep"
    """What the trainer does with a sample more than ``max_staleness`` updates behind it: ``keep`` it (trained in
    the step it arrives for, corrected like every sample by the importance ratio against the sampler's log-probs,
    ``vllm_importance_sampling_*``, and counted in ``sample/late_kept``), or ``drop`` it (TRL's behaviour: its
    generation is wasted, and since long completions arrive last, dropping them trains on shorter answers than the
    run generates). ``keep`` by default, from the measured table in docs/staleness.md; the ``waste/*`` metrics show
    what each costs in any run (docs/metrics.md)."""
    max_concurrent_rollouts: Annotated[int, Field(ge=1)] | None = None
    """Ceiling on rollouts in flight (None: the rollout queue's bound, ``grpo_core.staleness.samples_ahead``:
    (max_staleness + 1) x weight_sync_steps x batch x accumulation x processes)."""
    queue_maxsize: Annotated[int, Field(ge=1)] = 1024
    """Samples buffered between the rollout process and the trainer."""
    weight_sync_steps: Annotated[int, Field(ge=1)] = 1
    """Push weights to the server every N optimizer steps."""
    worker_heartbeat_timeout_s: Annotated[float, Field(gt=0)] = 60.0
    """The run fails if the rollout worker sends no heartbeat for this long."""

    # ---- packing --------------------------------------------------------------------------------
    token_budget: Annotated[int, Field(ge=16)] = 8192
    """Unique tokens per packed row (one row per rank per micro-batch); at least the longest prompt + completion."""
    packing: Literal["tree", "flat"] = "tree"
    """``tree`` (prefix-trie rows, shared tokens forwarded once) or ``flat`` (padding-free, no sharing)."""
    gdn_backend: Literal["auto", "reference", "fla"] = "auto"
    """Gated DeltaNet kernels in packed rows: ``fla`` (flash-linear-attention, CUDA, convolution included; FlashQLA's for
    heads of 128 where installed), ``reference`` (PyTorch), or ``auto``: fla's where they match PyTorch forward and
    backward on probe trees at the model's sizes (each kernel on its own), else PyTorch's. Unused without GDN layers."""
    routing_replay: bool = True
    """Mixture-of-experts policies: forward every sampled token through the experts the sampler routed it to
    (the router's top-k replaced by the sampler's; its weights still the trainer's softmax, so the router keeps
    learning). Needs a server that returns routes (``ServerOptions.return_routed_experts``); without them the run
    warns once and trains with the trainer's own routing. Unused for dense models."""
    moe_aux_loss_coef: Annotated[float, Field(ge=0)] = 0.0
    """Weight of the mixture-of-experts load-balancing loss (``grpo_core.models.moe.balance``): each forwarded
    position counts once, so a prompt shared by a group counts once. 0 (the default) leaves it out, as RL usually
    does: it moves the router for a reason other than the reward."""

    # ---- vLLM server and weight transfer -----------------------------------------------------------
    vllm_server_base_url: str | Annotated[list[str], Field(min_length=1)] = "http://localhost:8000"
    """Base URL of the vLLM server used for generation and weight sync, or a list of them: a fleet of servers of
    the same model and flags. The rollout worker sends each group to one server (where there is room, by each
    server's own KV-cache usage), every push reaches every server, and a server that is lost (refused, silent or
    stalled for ``server_drain_after_s``: docs/fleet.md) or fails a push is drained (its requests go to the others)
    until it answers again and has received the current weights (``grpo_core.fleet.servers``)."""
    vllm_server_fleet_file: str | None = None
    """A file (any fsspec URL) listing more servers of the fleet, a base URL per line (``#`` starts a comment): read
    at start-up and every few seconds while the run goes on. A server listed there joins the run as a restarted one
    does: once it answers and passes the start-up checks it gets the current weights, then groups. A server taken
    off the list is not drained by that (stop it: it is drained once it stops answering)."""
    server_drain_after_s: Annotated[float, Field(gt=0)] = 10.0
    """The window of the fleet's rule for taking a server out of service (``grpo_core.vllm_server.health``,
    docs/fleet.md): a server is out when a connection to it is refused, when nothing asked of it (``/metrics``,
    its weight version) has been answered for this long, or when it has had requests but its ``/metrics`` token
    counters have stood still for this long outside a weight push. A server that is only slow keeps its requests.
    An out server is drained while another serves (its groups move there); the last serving one, and a single
    server, is waited for instead, up to ``server_unavailable_timeout_s`` from when its trouble began. Set it above
    the longest pause a healthy server of yours makes (a long prefill, a busy host)."""
    vllm_server_timeout: Annotated[float, Field(gt=0)] = 240.0
    """Seconds ``train()`` waits for the server to answer (it may still be starting) before it fails."""
    request_timeout: Annotated[float, Field(gt=0)] = 600.0
    """Timeout of one HTTP request to the server."""
    server_unavailable_timeout_s: Annotated[float, Field(gt=0)] = 900.0
    """How long the rollout worker resends requests to, and the trainer waits for, a server that stopped
    answering (an external server being restarted) before the run fails. A server that comes back under a
    weight version the trainer did not push (restarted on its disk weights) gets the trainer's weights
    again; what it generated before that is never trained."""
    weight_transfer_backend: Literal["gloo", "nccl", "ipc"] | None = None
    """``nccl`` (a GPU server on GPUs of its own), ``ipc`` (a GPU server on the trainer's own GPU: vLLM's CUDA IPC
    engine, since NCCL refuses two processes on one device) or ``gloo`` (CPU servers, this package's vLLM plugin; it
    also reaches a GPU server); must match the server's weight-transfer configuration (checked at start-up). None:
    ``gloo`` without CUDA; on CUDA ``ipc`` when the flow starts the server on the trainer's GPU (one GPU on the
    machine), else ``nccl``."""
    weight_transfer_address: str | None = None
    """Address the server connects back to for the weight-transfer rendezvous. None: this host's address on the
    interface that routes to the server's host (loopback for a local server)."""
    weight_transfer_port_range: Annotated[str, Field(pattern=r"^\d{1,5}-\d{1,5}$")] | None = None
    """Ports the rendezvous may listen on, as ``LOW-HIGH`` (for firewalled clusters); None: any free port."""
    weight_sync_bucket_mb: Annotated[int, Field(ge=1)] = 256
    """Weights travel in buckets of about this many MiB (one gather and one send each; a bucket closes after the
    tensor that passes it); the sender holds at most two buckets of extra device memory."""
    weight_sync_transport: Literal["group", "storage"] = "group"
    """``group``: pushes travel over the transfer group the server joins (``weight_transfer_backend``).
    ``storage``: each pushed version is written once as a weight patch under ``weight_patch_url`` and the
    server is told to apply it (for a server that cannot join the group: another cluster, one catching up);
    the server needs this package's vLLM plugin (its ``gloo`` engine applies patches), not a group."""
    weight_sync_encoding: Literal["dense", "delta"] = "dense"
    """``dense``: every push sends every weight. ``delta``: after the first push, each tensor travels as the
    elements that changed since the last push (indices and values) where that is smaller, else whole (gloo and
    storage; the server keeps a copy of what it loaded to apply them to). Storage patches are always deltas."""
    weight_patch_url: str | None = None
    """``weight_sync_transport="storage"``: where the patches go, any fsspec URL; None: ``<output_dir>/weight_patches``."""
    weight_patch_keyframe_every: Annotated[int, Field(ge=1)] = 20
    """``weight_sync_transport="storage"``: a whole-model patch (keyframe) every this many pushes, so a server
    that holds nothing (just restarted) applies at most this many patches to catch up."""
    weight_sync_deadline_floor_s: Annotated[float, Field(gt=0)] = 60.0
    """Least time any phase of a push may take (pause, init, start, transfer, update, finish, resume); a phase
    that moves the weights gets ``max(this, weight_sync_deadline_slack x bytes / measured bandwidth)``. A phase
    past its deadline ends the push with an error naming the phase and the server (``grpo_core.sync.timing.deadline``)."""
    weight_sync_deadline_slack: Annotated[float, Field(gt=0)] = 4.0
    """Multiple of the time a push's bytes take at the slowest bandwidth measured on the last pushes."""
    weight_sync_assumed_mb_s: Annotated[float, Field(gt=0)] = 50.0
    """Bandwidth (MB/s) the deadlines assume before the first push has been measured."""
    weight_sync_attempts: Annotated[int, Field(ge=1)] = 2
    """Pushes of one version tried before the run fails: after a failed or unconfirmed push the trainer waits
    for the server (``server_unavailable_timeout_s``), opens a new transfer session and pushes again."""
    weight_sync_verify_every: Annotated[int, Field(ge=0)] = 1
    """After every N-th push, compare the server's log-probs of a fixed probe sequence with the trainer's
    (0: never). The served version is read back after every push regardless."""
    weight_sync_verify_atol: Annotated[float, Field(gt=0)] | None = None
    """Largest |server - trainer| probe log-prob accepted. None: 1e-4 on the largest when the server computes in fp32
    (what the dense push meets on a CPU server); for a 16-bit server, a bound on the probe's mean gap: 5e-2, or eight
    times the trainer's own mean bf16 rounding of the probe where it computes in fp32 and that is more (measured at
    each checked version; ``grpo_core/fleet/verify.py``)."""
    lora_sync_mode: Literal["auto", "merged", "adapter"] = "auto"
    """With ``peft_config`` only. ``merged``: every sync merges the adapter into the base weights and pushes
    them all over ``weight_transfer_backend``. ``adapter``: only the adapter is written under
    ``<output_dir>/.vllm_lora/`` and loaded by name (needs a server started with
    ``ServerOptions.enable_lora``, which turns on runtime LoRA loading; one server only). ``auto``: ``adapter`` when the
    server offers both at start-up, else ``merged`` (always ``merged`` for a fleet); picked once, never switched during
    the run."""

    # ---- checkpoints ----------------------------------------------------------------------------
    save_strategy: Literal["steps", "no"] = "steps"
    """``steps`` (every ``save_steps``, and after the last step) or ``no``."""
    save_steps: Annotated[int, Field(ge=1)] = 50
    """Write a checkpoint every N optimizer steps."""
    storage_retry_timeout_s: Annotated[float, Field(ge=0)] = 600.0
    """How long a read or write of ``output_dir`` that fails transiently (throttling, HTTP 5xx, a timeout, an
    endpoint that is restarting) is retried with backoff; then, or at once for other failures (no permission, a full
    disk), the error names the operation and the path. A checkpoint that cannot be written is skipped (training goes on
    and the last good checkpoint stays the resume point), except the one after the last step."""
    save_total_limit: Annotated[int, Field(ge=1)] | None = 3
    """Keep the newest N checkpoints of this run (None keeps all)."""
    resume_from_checkpoint: bool | str | None = None
    """True: the newest good checkpoint under ``output_dir``; a path: that one; None/False: start fresh.
    ``trainer.train(resume_from_checkpoint=...)`` takes the same values. Under ``grpo train``, None continues an
    unfinished run of the same job that the folder holds and refuses a folder holding another job's, while False
    always starts a new run (docs/faults_and_resume.md, "A whole job stopped")."""
    ignore_data_skip: Literal[True] = True
    """TRL compatibility; always True here: a resume jumps to the saved prompt position (``rollout_state.json``)
    instead of replaying the data."""

    def __post_init__(self) -> None:
        check_fields(self)
        self._check_relations()

    def _check_relations(self) -> None:
        """Checks that involve several fields; subclasses may extend them (call ``super()``)."""
        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            fail_field(self, "max_steps", "set max_steps > 0, or max_steps <= 0 with num_train_epochs > 0")
        if self.bf16 and self.fp16:
            fail_field(self, "fp16", "bf16 and fp16 exclude each other; set one of them")
        if self.attention_kernel is not None:
            try:
                parse_kernel_ref(self.attention_kernel)
            except ValueError as exc:
                fail_field(self, "attention_kernel", str(exc).split(": ", 1)[1])
        if self.weight_sync_encoding == "delta" and self.weight_transfer_backend in ("nccl", "ipc") \
                and self.weight_sync_transport == "group":
            fail_field(self, "weight_sync_encoding", "delta pushes need the gloo backend or weight_sync_transport='storage'")
        urls = self.server_urls()
        if len(set(urls)) != len(urls) or not all(u.strip() for u in urls):
            fail_field(self, "vllm_server_base_url", "give each server's base URL once, none empty")
        if len(urls) > 1 and self.lora_sync_mode == "adapter":
            fail_field(self, "lora_sync_mode", "a fleet of servers takes merged LoRA pushes (adapters are registered by name "
                  "on one server); use 'merged' or 'auto'")
        if self.environment is not None:
            ecosystem, _, name = self.environment.partition(":")
            if ecosystem not in ("verifiers", "reasoning_gym") or not name.strip():
                fail_field(self, "environment", "write 'verifiers:<taskset id>' (an installed verifiers taskset) or 'reasoning_gym:<generator name>'")
        if self.eval_beside_training and self.eval_strategy != "steps":
            fail_field(self, "eval_beside_training", "it places the evaluations of eval_strategy='steps' beside "
                       "training, and there are none: set eval_strategy='steps' too, or leave it False")
        if self.environment_args is not None and self.environment is None:
            fail_field(self, "environment_args", "it has no environment to go to: set environment too, or drop environment_args")
        if self.server_drain_after_s > self.server_unavailable_timeout_s:
            fail_field(self, "server_drain_after_s", f"a server is waited for at most server_unavailable_timeout_s="
                  f"{self.server_unavailable_timeout_s:g} s, so the drain window must not be longer: set "
                  f"server_drain_after_s <= {self.server_unavailable_timeout_s:g} (default 10)")
        if self.fsdp_keep_weights_between_micro_batches is True and self.fsdp_cpu_offload:
            fail_field(self, "fsdp_keep_weights_between_micro_batches", "kept weights would stay on the GPU, which "
                       "fsdp_cpu_offload keeps free of them: leave it 'auto' (off with offload) or set it False")
        if self.weight_transfer_port_range is not None:
            low, high = (int(p) for p in self.weight_transfer_port_range.split("-"))
            if not 1 <= low <= high <= 65535:
                fail_field(self, "weight_transfer_port_range", "use LOW-HIGH with 1 <= LOW <= HIGH <= 65535, e.g. 40000-40100")

    # ---- each part's typed settings, the fields it reads (grpo_core.config_sections) -------------
    rollout, training, sync, fleet = Section(), Section(), Section(), Section()
    checkpoint, tracking, evaluation = Section(), Section(), Section()

    # ---- values derived from the settings -------------------------------------------------------
    def resolved_max_concurrent_rollouts(self, num_processes: int) -> int:
        """The ceiling on rollouts in flight: by default what the trainer can consume before samples go stale (the
        rollout queue's bound; each rollout in flight holds a place in it until its samples are queued)."""
        if self.max_concurrent_rollouts is not None:
            return self.max_concurrent_rollouts
        per_step = self.per_device_train_batch_size * self.gradient_accumulation_steps * num_processes
        return samples_ahead(self.max_staleness, self.weight_sync_steps, per_step)

    def server_urls(self) -> list[str]:
        """The servers' base URLs (one for the single-URL form), without trailing slashes."""
        urls = [self.vllm_server_base_url] if isinstance(self.vllm_server_base_url, str) else self.vllm_server_base_url
        return [u.rstrip("/") for u in urls]

    def resolved_weight_transfer_backend(self, cuda: bool, shared_gpu: bool = False) -> Literal["gloo", "nccl", "ipc"]:
        """The backend the run uses: the configured one, else ``gloo`` without CUDA, ``ipc`` for a server on the
        trainer's own GPU (``shared_gpu``: no copy through the host; benchmarks/device/e2e_gpu.py times it against gloo;
        ``gloo`` where the installed vLLM cannot load its IPC engine, ``vllm_lines.ipc_unavailable``) and ``nccl``
        for a server on GPUs of its own."""
        if self.weight_transfer_backend is not None:
            if shared_gpu and self.weight_transfer_backend == "nccl":
                fail_field(self, "weight_transfer_backend", "the server shares the trainer's GPU, where NCCL refuses "
                           "two processes on one device; use 'ipc' (or 'gloo'), or leave it unset")
            if cuda and self.weight_transfer_backend == "ipc" and (reason := ipc_unavailable()) is not None:
                fail_field(self, "weight_transfer_backend", f"{reason}; install Ray (pip install ray) or use 'gloo'")
            return self.weight_transfer_backend
        if not cuda:
            return "gloo"
        if shared_gpu:
            # Through the host where the installed server cannot load its IPC engine (the 0.25 line without Ray).
            return "ipc" if ipc_unavailable() is None else "gloo"
        return "nccl"

    def resolved_bf16(self, bf16_supported: bool) -> bool:
        """Whether the trainer computes in bf16 on a device that does (or does not) support it well."""
        if self.bf16 is not None:
            return self.bf16
        return bf16_supported and not self.fp16

    def resolved_logprob_chunk_size(self, num_trained: int, vocab_size: int) -> int | None:
        """Trained tokens per chunk of the log-prob head for a row, or None for one pass through the model's head."""
        chunk = self.logprob_chunk_size
        if chunk == "auto":
            if num_trained * vocab_size <= AUTO_DENSE_MAX_LOGITS:
                return None
            chunk = max(1, AUTO_CHUNK_LOGITS // vocab_size)
        if chunk is None or num_trained <= chunk:
            return None  # one chunk would be the dense head plus a recompute
        return chunk

    def needs_candidate_sets(self) -> bool:
        """Truncated sampling: the trainer must renormalise over each token's candidate set."""
        return self.top_p < 1.0 or self.top_k > 0

    def num_eval_generations(self) -> int:
        return self.num_generations_eval or self.num_generations

    def runs_evaluation(self) -> bool:
        """Whether held-out prompts are evaluated at all: ``do_eval``, or during training (``eval_strategy``), as
        transformers reads the pair."""
        return self.do_eval or self.eval_strategy != "no"

    # ---- (de)serialisation ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> AsyncGRPOConfig:
        """Build from a mapping (e.g. YAML), rejecting unknown keys with a suggestion."""
        check_known_keys(cls.__name__, values, [f.name for f in dataclasses.fields(cls)])
        return cls(**values)

    def replace(self, **changes: Any) -> AsyncGRPOConfig:
        """A copy with ``changes`` applied and checked (the original is never modified)."""
        check_known_keys(type(self).__name__, changes, [f.name for f in dataclasses.fields(self)])
        return dataclasses.replace(self, **changes)


RolloutSettings = settings_type(AsyncGRPOConfig, "rollout", "RolloutSettings", __name__)
TrainingSettings = settings_type(AsyncGRPOConfig, "training", "TrainingSettings", __name__)
SyncSettings = settings_type(AsyncGRPOConfig, "sync", "SyncSettings", __name__)
FleetSettings = settings_type(AsyncGRPOConfig, "fleet", "FleetSettings", __name__)
CheckpointSettings = settings_type(AsyncGRPOConfig, "checkpoint", "CheckpointSettings", __name__)
TrackingSettings = settings_type(AsyncGRPOConfig, "tracking", "TrackingSettings", __name__)
EvaluationSettings = settings_type(AsyncGRPOConfig, "evaluation", "EvaluationSettings", __name__)
AsyncGRPOConfig.settings_types = {
    "rollout": RolloutSettings, "training": TrainingSettings, "sync": SyncSettings, "fleet": FleetSettings,
    "checkpoint": CheckpointSettings, "tracking": TrackingSettings, "evaluation": EvaluationSettings,
}


def field_names(cls: type = AsyncGRPOConfig) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def describe(name: str, cls: type = AsyncGRPOConfig) -> str:
    """The docstring of field ``name`` (for messages and generated docs), whitespace collapsed."""
    schema = TypeAdapter(cls).json_schema()
    return re.sub(r"\s+", " ", schema["properties"][name].get("description", "")).strip()


__all__ = ["AsyncGRPOConfig", "AttentionBackendName", "CheckpointSettings", "EvaluationSettings", "FleetSettings",
           "RolloutSettings", "SyncSettings", "TrackingSettings", "TrainingSettings", "ConfigError", "LoraRank", "TRL_COMPATIBILITY_ONLY", "describe", "field_names"]
