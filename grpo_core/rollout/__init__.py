"""The rollout process: prompts in, scored and reconciled samples out, onto the trainer's queue.

``worker`` (the process and its queue) runs ``scheduler`` (the loop over prompts, group admission,
adaptive concurrency from ``concurrency``), which runs ``stages.AsyncRolloutLoop`` for each group:
its rollouts' turns through ``generation`` (the vLLM generation client), tools (``agent``,
``tool_calls``), scoring and ``advantages``; ``reconcile`` turns the turns into sequences, and
``types`` holds the records that move along the way. ``routing_client`` sends each group's requests
to the server ``router`` chose for it, and drains and resends when a server is lost. Speaks to the
server only through ``grpo_core.vllm_server``'s errors and reply parsers; knows nothing of the trainer.
"""
