"""The stale-sample policies compared (``AsyncGRPOConfig.stale_samples``): a long-tailed task's reward."""
