"""Privacy for fedlr runs (``docs/privacy.md``).

* :mod:`fedlr.privacy.settings`: the ``dp-*`` and ``client-dp-*`` settings;
* :mod:`fedlr.privacy.dp_sgd`: sample-level DP-SGD, a common client feature
  (Opacus per-example clipping, noise and accountant);
* :mod:`fedlr.privacy.client_dp`: client-level DP on the server for sum-only
  methods;
* :mod:`fedlr.privacy.accounting`: epsilon from Opacus's accountants;
* :mod:`fedlr.privacy.secagg`: secure aggregation (Flower's SecAgg+).

The package imports none of its modules, so that the run config can read the
settings without loading Opacus.
"""
