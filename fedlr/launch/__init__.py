"""What a process starts: the top floor of fedlr.

- :mod:`fedlr.launch.client_app`: the dispatching ClientApp of ``flwr run``
  (it looks the method up in the registry, so it sits above every method);
- :mod:`fedlr.launch.local`: :func:`~fedlr.launch.local.run_in_process`,
  the same apps on an in-process grid;
- :mod:`fedlr.launch.run_config` and :mod:`fedlr.launch.flwr_run`: the run
  config ``flwr run`` would start, checked before it starts, and the
  ``flwr run`` wrapper (``python -m fedlr.launch``);
- :mod:`fedlr.launch.compare`: sweeps of methods x seeds
  (``python -m fedlr.launch.compare``).
"""
