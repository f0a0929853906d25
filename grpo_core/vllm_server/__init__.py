"""Everything that starts the vLLM server or speaks to it, apart from generating.

``process`` (the server's options and launch: every flag spelled here), ``model_needs`` (what a model's
config asks of its server), ``cpu_placement`` (which cores the server, the trainer and the rollout
process get), ``control`` (the synchronous control client and its errors), ``replies`` (generation
replies as arrays), ``checks`` (the start-up checks) and ``watch`` (noticing a restarted server).
Named ``vllm_server`` rather than ``vllm`` so that no reader, tool or path entry can take it for vLLM.
"""
