"""The policy model: loading, FSDP2, LoRA, vision towers, and the kernels of a packed forward.

``loading`` (the policy and tokenizer), ``fsdp`` (sharding, activation checkpointing, compile), ``lora``,
``vision`` (vision-language models trained on text), ``param_names`` (checkpoint names of wrapped
parameters); ``attention/`` (token mixing over a packed prefix trie: tree attention, its plans and
kernels, Gated DeltaNet), ``head/`` (the sampled tokens' log-probs from the LM head) and ``moe/``
(mixture-of-experts: grouped-GEMM experts, routing replay, the balancing loss).
"""
