"""ClientApps, one module per payload kind, and the dispatching app."""
