"""The trainer process: ``AsyncGRPOTrainer`` and what its loop calls, step by step.

``trainer`` (set-up, the loop top to bottom, teardown), ``collector`` (the queue's samples into a step,
stale ones kept or dropped), ``waste`` (what was generated and not trained), ``forward`` (a packed row to its log-probs), ``micro_batch`` (one row: forward,
loss, backward), ``loss`` (the GRPO objective), ``weight_push`` (weights to the server, again after a
restart), ``step_metrics`` (rewards, rollouts and the queue per step), ``perf`` (throughput and MFU),
``distributed`` (ranks, the step's plan broadcast, results gathered), ``host_memory`` and ``evaluation``
(held-out rewards sampled from the server).
"""
