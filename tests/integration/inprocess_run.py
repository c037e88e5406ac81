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

from flwr.app import Message

from fedlr.launch.local import run_in_process


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

    print(run_in_process(config, run_id=5, reply_hook=hook), flush=True)


if __name__ == "__main__":
    main()
