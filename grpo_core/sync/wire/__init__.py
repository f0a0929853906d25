"""What the trainer's senders and the receivers inside vLLM agree on, imported by both sides.

``buckets`` (how a model is cut into broadcasts), ``delta`` (a bucket's changes against the last push),
``digest`` (a tensor's fingerprint), ``patch_store`` (weight patches on storage), ``address`` and
``gated_store`` (the rendezvous), ``gloo_messages`` (the backend's name and the init/update messages).
Nothing here imports the rest of ``grpo_core.sync``: the package vLLM loads (``grpo_core.vllm_plugin``)
imports these modules and nothing trainer-side.
"""
