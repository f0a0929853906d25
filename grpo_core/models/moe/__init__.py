"""Mixture-of-experts policies: how their experts run, and the sampler's routes replayed in their routers.

``experts`` (grouped-GEMM experts, active parameters), ``routing`` (routers that take forced routes, the
mismatch count), ``balance`` (the load-balancing loss over a packed row) and ``policy`` (what the trainer
does per micro-batch of an MoE policy). The design, and expert parallelism: ``docs/mixture_of_experts.md``.
"""
