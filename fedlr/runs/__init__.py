"""What a run leaves: results.csv (results.py), trackers, checkpoints, the
exported adapter, plots and multi-run comparisons (python -m
fedlr.runs.plots / fedlr.launch.compare).
"""
