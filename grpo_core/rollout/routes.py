"""The sampler's expert routes of a mixture-of-experts policy, laid on a training sequence.

A vLLM server that returns routes (``ServerOptions.return_routed_experts``) answers ``/inference/v1/generate``
with ``routed_experts`` per choice, ``[prompt + output - 1, layers, k]`` (decoded by
``grpo_core.vllm_server.replies.decode_routed_experts`` and kept as sent: at one byte per layer and
expert slot, a 4k-token sample of a 48-layer top-8 model carries 1.5 MiB of routes).

A training sequence of a multi-turn rollout is always its last turn's prompt plus that turn's output
(``grpo_core.rollout.reconcile``), so the last turn's routes cover every position of it. The position
that predicts a token sampled in an earlier turn takes that turn's route instead (``sequence_routes``):
each trained token is replayed through the experts that computed its sampler log-prob.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from grpo_core.rollout.reconcile import RolloutSequence
from grpo_core.rollout.types import TurnRecord


def sequence_routes(seq: RolloutSequence, turns: Sequence[TurnRecord]) -> np.ndarray | None:
    """Routes ``[len(seq) - 1, layers, k]`` of a training sequence, or None when its last turn has none.

    The last turn's routes, with the position that predicts each trained token taken from the turn
    that sampled that token, where that turn has routes (module docstring).
    """
    last = turns[seq.last_turn]
    if last.routed_experts is None:
        return None
    n = len(seq.token_ids)
    if len(last.prompt_ids) + len(last.output_ids) != n or len(last.routed_experts) != n - 1:
        raise ValueError(f"sequence of {n} tokens does not end with its last turn ({len(last.prompt_ids)} prompt + "
                         f"{len(last.output_ids)} output tokens, {len(last.routed_experts)} routes)")
    routes = last.routed_experts.copy()
    trained = np.flatnonzero(seq.completion_mask)
    for t in np.unique(seq.output_turn):
        turn = turns[int(t)]
        if t == seq.last_turn or turn.routed_experts is None:
            continue
        mine = seq.output_turn == t
        at = trained[mine] - 1  # the positions that predict this turn's tokens, in the sequence
        routes[at] = turn.routed_experts[len(turn.prompt_ids) + seq.output_pos[mine] - 1]
    return routes
