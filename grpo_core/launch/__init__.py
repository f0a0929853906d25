"""A training job: its file (``job.JobConfig``) and the training process it starts.

``python -m grpo_core.launch JOB.json --server-url URL`` (``__main__``) runs one training process;
the flows and the Kubernetes manifests start it.
"""
