"""Run our ServerApp and ClientApp on Flower's Ray simulation engine.

``run_simulation`` takes no run config, so both apps are wrapped to inject the
same one (a ClientApp's Context is read-only: the wrapper hands on a copy).
Method-family integration tests call :func:`simulate`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["run_dirs", "simulate"]


def run_dirs(output: Path) -> list[Path]:
    """Run directories (those with a results.csv) under ``output``."""
    return sorted(p.parent for p in Path(output).glob("*/results.csv"))


def simulate(config: dict[str, Any], num_supernodes: int) -> Path:
    """Run ``config`` on ``num_supernodes`` Ray clients; return the run dir."""
    from flwr.app import Context, Message
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        from fedlr.server_apps.runner import run_server

        context.run_config.update(config)
        run_server(grid, context)

    client = ClientApp()

    def _local(context: Context) -> Context:
        return Context(
            run_id=context.run_id,
            node_id=context.node_id,
            node_config=context.node_config,
            state=context.state,
            run_config=config,
        )

    @client.train()
    def train(message: Message, context: Context) -> Message:
        from fedlr.launch.client_app import train as dispatch

        return dispatch(message, _local(context))

    @client.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        from fedlr.launch.client_app import evaluate as dispatch

        return dispatch(message, _local(context))

    before = set(run_dirs(Path(config["output-dir"])))
    run_simulation(
        server_app=server,
        client_app=client,
        num_supernodes=num_supernodes,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    new = [d for d in run_dirs(Path(config["output-dir"])) if d not in before]
    if len(new) != 1:
        raise RuntimeError(f"expected one new run directory, found {new}")
    return new[0]
