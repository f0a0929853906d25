"""How a push's bytes leave the trainer: one sender per transport, and the bucket pipeline they share.

The senders are vLLM trainer engines that ``protocol.ProtocolWeightSync`` drives: ``gloo_trainer`` (CPU, dense or
delta), ``nccl_trainer`` (vLLM's packed NCCL format, its body in ``packed_send``, free of vLLM imports) and
``ipc_trainer`` (a server on the trainer's own GPU). Each walks the bucket plan with ``bucket_stream.send_buckets``,
which fills each bucket's wire buffer with one collective (``flat_gather``) while the last one is on the wire;
``storage_sync`` walks the same loop to write patches.
"""
