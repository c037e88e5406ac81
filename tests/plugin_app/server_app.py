"""The plug-in app's ServerApp: its own loop around fedlr's FedExLoRA."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Result

from fedlr import FedExLoRA, adapter_state, load_adapter_state, lora_layout
from tests.plugin_app.task import accuracy, build_model, load_data

app = ServerApp()


def evaluate_all(model: torch.nn.Module, num_partitions: int) -> float:
    return sum(accuracy(model, *load_data(p)) for p in range(num_partitions)) / (
        num_partitions
    )


@app.main()
def main(grid: Grid, context: Context) -> Result:
    model = build_model()
    layout = lora_layout(model)
    strategy = FedExLoRA(layout=layout)
    num_partitions = len(list(grid.get_node_ids()))

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        load_adapter_state(model, layout, arrays.to_torch_state_dict())
        return MetricRecord({"accuracy": evaluate_all(model, num_partitions)})

    return strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(adapter_state(model, layout, strategy.send_roles)),
        num_rounds=int(context.run_config.get("num-server-rounds", 3)),
        train_config=ConfigRecord({"lr": 0.1}),
        evaluate_fn=evaluate_fn,
    )
