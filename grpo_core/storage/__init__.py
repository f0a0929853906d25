"""Storage at any fsspec URL (a local folder, S3, ...), with retries of what passes.

``store`` (``open_url``: a filesystem made from the environment as it is now; ``Storage``: one folder
with joins, whole-object JSON, listing and deletes) and ``retry`` (which failures pass, and for how
long). Used by checkpoints, tracking, LoRA adapters and the flows.
"""
