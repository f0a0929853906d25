"""Example jobs for ``grpo train examples/<name>.yaml``; their Python parts live in this package."""
