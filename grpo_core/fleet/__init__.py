"""The run's servers as the trainer side keeps them: every push to every serving server, confirmed there.

``servers`` (``RunServers``: waiting for and checking the servers, one pusher each, draining a lost one,
checking and catching up one that comes back), ``probe`` (``VersionProbe``: the trainer's probe log-probs once
per version, computed here from the policy's model), ``weight_push`` (``WeightPusher``: one server's pushes,
confirmed and recovered) and ``verify`` (the checks that a server serves the version just pushed, and the
trainer's weights under it). The rollout side's view of the same servers is ``grpo_core.rollout.routing_client``;
a server's liveness is ``vllm_server.watch``.
"""
