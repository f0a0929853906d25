"""What the user hands in: the prompts and the checks made on them before anything is spawned.

``prompts`` walks a dataset as prompt positions (epochs, shuffling, a streaming dataset repositioned by
reading); ``inputs`` checks the model reference, the datasets, the reward functions and everything that
crosses into the rollout process, and names the culprit and the fix. Depends on nothing else here.
"""
