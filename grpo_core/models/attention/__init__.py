"""Token mixing over a packed prefix trie: each token sees its ancestors and its own causal past.

``metadata`` (the row's segments and paths, read by every layer), ``tree`` (tree attention as a
transformers attention backend, and switching a model over), its plans ``gather`` and ``split``,
``backends`` (the fused varlen kernels by device), and ``hybrid`` / ``gated_delta`` (Gated DeltaNet
layers of hybrid models, run along the trie).
"""
