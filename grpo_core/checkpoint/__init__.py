"""Checkpoints on fsspec storage, the search for the newest good one, resume, and the run ledger.

``<output_dir>`` is any fsspec URL (a local folder, ``s3://bucket/run`` through s3fs, ...). Each
checkpoint is a folder ``checkpoint-<step>/``:

    model.safetensors, config.json, generation_config.json, tokenizer files
                               servable as it is: ``vllm serve <folder>`` (weights in the serving dtype)
    master_weights.safetensors fp32 master weights; only when the serving dtype is narrower (bf16)
    optimizer.pt               optimizer state: tensors and plain values, read with weights_only=True
    scheduler.json             LR scheduler state
    rng_state.pt               torch / CUDA / numpy / python RNG states of every rank (weights_only=True)
    trainer_state.json         global step, MLflow run id, attempt, training frontier
    rollout_state.json         first prompt position not yet trained, its epoch and index in the epoch
    manifest.json              written last: size and sha256 of every file above

A checkpoint counts only once its manifest exists and every listed file has the listed size and
hash; anything else is *torn* (killed mid-write, a short upload) and is skipped with a warning.
Resume never unpickles arbitrary objects: safetensors, JSON, or ``torch.load(weights_only=True)``.

Resume: ``resume_from_checkpoint=True`` takes the newest good checkpoint of this run (a *lineage*
id written by a fresh start and kept in every manifest, so checkpoints an earlier run left in the
folder are ignored, and ``save_total_limit`` never deletes them); a path takes that checkpoint or
fails naming why. Weights, optimizer, scheduler, RNG, step and the prompt position are restored and
the rollout worker starts at that position without replaying (``ignore_data_skip`` is always True).
A resumed attempt logs ``train/rerun_step`` at each step, 1 for those an earlier attempt already logged,
into the same MLflow run (its id is in ``trainer_state.json``), whose ``attempt`` tag counts the attempts.

The *ledger* (``<output_dir>/ledger/``) is an audit trail of which prompt positions each step
consumed, one small JSON object per step (object stores cannot append), written before the step
counts as done. ``ledger_summary`` turns it into the counts a job reports: attempts, prompts
trained twice (those past the last checkpoint before a crash).

A streaming ``IterableDataset`` (no ``len``, no indexing) is repositioned by reading: the resumed
worker reads and discards the rows before the saved position (``grpo_core.data.prompts``).

Modules: ``folders`` (file names, listing, manifests), ``state`` (tensors in and out), ``checkpointer``
(the trainer's hooks), ``ledger`` (prompt accounting). Storage itself (fsspec, retries) is
``grpo_core.storage``.
"""

from grpo_core.checkpoint.checkpointer import (CheckpointParts, Checkpointer, ResumeInfo, UnfinishedRun, saved_run_id,
                                               unfinished_run)
from grpo_core.checkpoint.folders import (
    MANIFEST,
    CheckpointError,
    build_manifest,
    list_checkpoints,
    read_manifest,
    verify_local,
)
from grpo_core.checkpoint.ledger import RunLedger, ledger_summary, read_ledger, surviving_steps
from grpo_core.checkpoint.state import save_policy
from grpo_core.storage.retry import StorageError
from grpo_core.storage.store import Storage

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "CheckpointParts",
    "Checkpointer",
    "ResumeInfo",
    "RunLedger",
    "Storage",
    "StorageError",
    "build_manifest",
    "ledger_summary",
    "list_checkpoints",
    "read_ledger",
    "read_manifest",
    "save_policy",
    "saved_run_id",
    "UnfinishedRun",
    "unfinished_run",
    "surviving_steps",
    "verify_local",
]
