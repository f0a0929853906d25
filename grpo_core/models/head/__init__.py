"""The sampled tokens' log-probs from the LM head: reference, fused, and computed in the head's place.

``reference`` (plain tensor code, the oracle), ``fused`` (the same with the backward written out and
compiled; ``grad_triton``, its Triton kernel for the logits' gradient), ``lm_head`` (finding the head,
and making it hand back log-probs so that no ``[T, V]`` logits exist).
"""
