"""A node's side of a round: apply_round (round.py), client features
(features.py), the methods' feature table, HetLoRA's rank pruning, the local
training loops (train.py).
"""
