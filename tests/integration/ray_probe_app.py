"""A test-only ClientApp: fedlr's own, plus a note of the Ray node it ran on.

``tests/integration/test_ray_cluster.py`` copies this module into a temporary
app as ``ray_probe.py`` (``clientapp = "ray_probe:app"``). Every train and
evaluate message first writes one JSON file to ``<output-dir>/ray-probe/``
with the Ray node id, the process id and the partition, then goes to fedlr's
dispatching ClientApp (:mod:`fedlr.launch.client_app`) unchanged.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedlr.launch.client_app import evaluate as fedlr_evaluate
from fedlr.launch.client_app import train as fedlr_train

app = ClientApp()


def _note(kind: str, message: Message, context: Context) -> None:
    import ray

    node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    config = message.content.config_records.get("config")
    folder = Path(str(context.run_config["output-dir"])) / "ray-probe"
    folder.mkdir(parents=True, exist_ok=True)
    note = {
        "kind": kind,
        "ray-node-id": node_id,
        "pid": os.getpid(),
        "partition-id": int(context.node_config["partition-id"]),
        "server-round": int(config.get("server-round", 0)) if config else 0,
    }
    (folder / f"{uuid.uuid4().hex}.json").write_text(json.dumps(note))


@app.train()
def train(message: Message, context: Context) -> Message:
    """Note the node, then train with fedlr's ClientApp."""
    _note("train", message, context)
    return fedlr_train(message, context)


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    """Note the node, then evaluate with fedlr's ClientApp."""
    _note("evaluate", message, context)
    return fedlr_evaluate(message, context)
