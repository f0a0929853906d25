"""What vLLM loads inside its own processes: the plugin entry point and the weight receiver.

``entry_point.register`` is the ``vllm.general_plugins`` entry point (pyproject.toml); it registers
``gloo_engine.GlooWeightTransferEngine``, which receives pushes over gloo or applies weight patches from
storage (``receiver``) and repacks CPU experts after a reload (``expert_repack``). This package imports
only ``grpo_core.sync.wire``, ``grpo_core.storage`` and ``grpo_core.retry`` of this project, never the
trainer side (tests/test_vllm_plugin_imports.py checks it), so a vLLM server starts without torch-heavy
trainer code and someone changing the server side sees everything it loads here.
"""
