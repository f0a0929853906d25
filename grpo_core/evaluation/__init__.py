"""Held-out evaluation: ``heldout`` rolls an evaluation set out on a serving server and scores it, both by the
run's own rollout loop (the path every trained sample takes); ``intervals`` turns per-problem scores into 95% intervals and paired gains (problems, not phrasings,
are the independent draws). The trainer evaluates every ``eval_steps``; ``flows/heldout.py`` reports a run's.
"""
