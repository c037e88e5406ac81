"""The plug-in app's ServerApp: Flower's own ``strategy.start()``, a fedlr strategy."""

from __future__ import annotations

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Result

from fedlr import get_method

from .task import build_model, load_data, save_result, score

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> Result:
    config = context.run_config
    method = str(config["method"])
    model = build_model(method)
    options = {}
    if method == "fedspec":
        options = {
            "fedspec_threshold": float(config["fedspec-threshold"]),
            "fedspec_max_rank": int(config["fedspec-max-rank"]),
        }
    nodes = int(config["min-nodes"])
    strategy = get_method(method).strategy.for_model(
        model, min_available_nodes=nodes, min_train_nodes=nodes, **options
    )

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        strategy.load_into(model, arrays)
        accuracy, loss = score(model, *load_data(None, split="test"))
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    result = strategy.start(
        grid=grid,
        initial_arrays=strategy.initial_arrays(model),
        num_rounds=int(config["num-server-rounds"]),
        train_config=ConfigRecord({"lr": float(config["lr"])}),
        evaluate_fn=evaluate_fn,
    )
    save_result(result, str(config.get("result-file", "")))
    return result
