"""The server's round as composed steps (below the strategies).

A strategy (:class:`fedlr.strategies.base.FedLRStrategy`) keeps Flower's
hooks and its method; the rest of a round is here, one job per module:

- :mod:`fedlr.round.instructions`: check the global arrays, sample, build
  each node's instruction (the method's one per-node hook), count
  ``bytes-down``;
- :mod:`fedlr.round.replies`: decode and validate every reply (the method's
  reply step: its records, its update space), screen update sizes;
- :mod:`fedlr.round.protect`: the robust rule or client-level DP;
- :mod:`fedlr.round.publish`: check the new global state, the round's
  metrics and report;
- :mod:`fedlr.round.pipeline`: the steps in order (``aggregate_train``),
  the method's explicit state rolled back on a rejected round, federated
  evaluation's aggregation and the one-round driver :func:`run_round`;
- :mod:`fedlr.round.describe`: the summary and the app's constructor
  arguments.
"""
