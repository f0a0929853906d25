"""Weight sync behind one interface: the trainer's weights to the vLLM server after an optimizer step.

The trainer's side, read top to bottom as a push runs:

* ``factory`` picks the sync for a run; ``base.WeightSync`` is what every sync is: ``protocol`` (vLLM's
  weight-transfer protocol: pause, start, update, finish, resume), ``storage_sync`` (patches on storage) or
  ``lora`` (adapters through storage); ``source`` names the trainer's weights as the server's checkpoint does;
* ``send/``: what moves the bytes: one sender per transport (gloo, NCCL, CUDA IPC) over the bucket pipeline;
* ``timing/``: what bounds each phase of a push in time;
* ``errors``: what a failed push raises, naming its server, version and phase.

What both sides agree on (bucket plans, delta encoding, digests, patch files, the rendezvous, the gloo messages)
is in ``wire``, the only part the vLLM plugin imports. The checks of what a server serves after a push are the
fleet's (``grpo_core.fleet.verify``), where every caller of them is.
"""
