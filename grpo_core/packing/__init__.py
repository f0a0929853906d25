"""Samples into rows: prefix tries, the step planner and the depth-first layout of one forward.

``trie`` (a ``TreeRow``: the samples of one row as a prefix trie), ``planner`` (rows per rank and
micro-batch for one optimizer step, and the step's ``batch/*`` metrics), ``collator`` (a row laid out
as the tensors of one packed forward, with the attention metadata of ``grpo_core.models.attention``).
"""
