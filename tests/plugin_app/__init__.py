"""A separate Flower app that uses fedlr only as a plug-in.

Its own model (a small MLP with peft LoRA, peft VeRA or fedlr's SORF-VeRA,
by the run config's ``method``), its own data, its own ClientApp and
ServerApp on Flower's unmodified ``strategy.start()``. It uses only what
docs/plugin.md shows: ``fedlr.apply_round`` on the client, a strategy's
``for_model``, ``initial_arrays`` and ``load_into`` on the server.
tests/integration/test_plugin_flwr_run.py copies it out of the repository and
runs it with ``flwr run``.
"""
