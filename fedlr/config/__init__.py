"""The run configuration: every run-config key, typed and validated (run.py),
the option declarations (options.py), discovery of registering modules.
"""
