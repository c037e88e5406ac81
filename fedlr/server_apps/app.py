"""The ServerApp of ``flwr run`` (named by the repository's ``server_apps.app:app``)."""

from __future__ import annotations

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedlr.server_apps.runner import run_server

__all__ = ["app"]

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Build the method from the run config and run every round."""
    run_server(grid, context)
