"""Run one in-process federation in its own process (for kill-and-resume tests).

``python -m tests.integration.inprocess_run CONFIG.json [--hang-at-round N]``
runs the ServerApp on an :class:`~fedlr.flower.InProcessGrid` with the run
config in ``CONFIG.json`` and prints the run directory. With ``--hang-at-round
N`` every client reply of round ``N`` blocks forever, so the process sits in
round ``N`` after checkpointing round ``N - 1`` until it is killed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from flwr.app import Context, Message, RecordDict

from client_apps.app import app as client_app
from fedlr.flower import InProcessGrid
from server_apps.runner import run_server


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config", type=Path)
    parser.add_argument("--hang-at-round", type=int, default=0)
    args = parser.parse_args()
    config = json.loads(args.config.read_text())

    def hook(partition: int, message: Message, reply: Message) -> Message:
        server_round = int(message.content["config"].get("server-round", 0))
        if args.hang_at_round and server_round == args.hang_at_round:
            while True:  # the test kills the process here
                time.sleep(1)
        return reply

    grid = InProcessGrid(
        client_app,
        num_nodes=int(config["num-partitions"]),
        run_config=config,
        reply_hook=hook,
    )
    context = Context(
        run_id=5, node_id=1, node_config={}, state=RecordDict(), run_config=config
    )
    print(run_server(grid, context), flush=True)


if __name__ == "__main__":
    main()
