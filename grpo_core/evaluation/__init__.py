"""Held-out evaluation: ``heldout`` samples an evaluation set from a serving server and scores it with the reward
functions; ``intervals`` turns per-problem scores into 95% intervals and paired gains (problems, not phrasings,
are the independent draws). The trainer evaluates every ``eval_steps``; ``flows/heldout.py`` reports a run's.
"""
