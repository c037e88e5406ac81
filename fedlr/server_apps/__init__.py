"""ServerApps: read the run config, build model and strategy, run, write results."""
