"""What the ServerApp does, as a function of a Grid and a Context.

1. Read the run config into :class:`~fedlr.config.RunConfig`.
2. Build the model and the strategy from the registry entry of ``method``.
3. Run the rounds with ``strategy.start``; after each, evaluate the global
   model on the held-out split, append a CSV row and log a progress line.
4. Save the final arrays and a ``summary.json``.

Tests call :func:`run_server` with an :class:`~fedlr.flower.InProcessGrid`;
``flwr run`` calls it through :mod:`server_apps.app`.
"""

from __future__ import annotations

import json
import os
import random
import time
from logging import INFO
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid
from flwr.supercore import log

import strategies  # noqa: F401  (registers every method)
from fedlr.adapters import adapter_state
from fedlr.config import RunConfig
from fedlr.flower.records import record_to_state
from fedlr.results import ResultsWriter
from fedlr.tasks import TextTask
from fedlr.train import evaluate, pick_device
from strategies.lora import LoraStrategy
from strategies.registry import get_method

__all__ = ["run_server"]


def _run_dir(config: RunConfig, run_id: int) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"{config.method}-{config.dataset}-seed{config.seed}-{stamp}-run{run_id}"
    return config.output_path / name


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f} MB"


def run_server(grid: Grid, context: Context) -> Path:
    """Run a whole federated training; return the run's results directory."""
    config = RunConfig.from_mapping(context.run_config)
    spec = get_method(config.method)
    random.seed(config.seed)  # Flower samples nodes with `random`
    torch.manual_seed(config.seed)

    task = TextTask(config)
    lm = task.build_lora_model()
    if not issubclass(spec.strategy_cls, LoraStrategy):
        raise TypeError(f"method '{spec.name}' is not a LoRA strategy")
    strategy = spec.strategy_cls.from_run_config(config, lm.layout)
    initial = adapter_state(lm.model, lm.layout, strategy.send_roles)
    heldout = task.heldout()
    device = pick_device(config.device)
    run_dir = _run_dir(config, int(context.run_id))
    writer = ResultsWriter(run_dir, method=config.method, config=config.to_mapping())
    log(INFO, "fedlr: method %s (%s), results in %s", spec.name, spec.summary, run_dir)
    log(INFO, "fedlr: %d held-out examples, device %s", len(heldout), device)

    clock = {"t": time.perf_counter()}
    initial_metrics: dict[str, float] = {}

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        lm.load(record_to_state(arrays))
        accuracy, loss = evaluate(
            lm.model, heldout, batch_size=config.eval_batch_size, device=device
        )
        lm.model.to("cpu")
        if server_round == 0:
            log(INFO, "fedlr: initial accuracy %.4f, loss %.4f", accuracy, loss)
            initial_metrics.update({"accuracy": accuracy, "loss": loss})
            clock["t"] = time.perf_counter()
            return MetricRecord({"accuracy": accuracy, "loss": loss})
        seconds = time.perf_counter() - clock["t"]
        clock["t"] = time.perf_counter()
        report = strategy.last_report
        m = report.metrics
        row = {
            "round": server_round,
            "accuracy": accuracy,
            "loss": loss,
            "seconds": seconds,
            **{
                k: m[k]
                for k in (
                    "frobenius-gap",
                    "relative-gap",
                    "rank",
                    "bytes-up",
                    "bytes-down",
                    "clients",
                    "dropped",
                    "train-loss",
                )
                if k in m
            },
        }
        writer.append(row, layers=report.layers)
        log(
            INFO,
            "fedlr [round %d/%d] accuracy %.4f loss %.4f gap %.3e (rel %.3e) "
            "up %s down %s clients %d dropped %d %.1fs",
            server_round,
            config.num_server_rounds,
            accuracy,
            loss,
            m.get("frobenius-gap", float("nan")),
            m.get("relative-gap", float("nan")),
            _mb(m.get("bytes-up", 0.0)),
            _mb(m.get("bytes-down", 0.0)),
            int(m.get("clients", 0)),
            int(m.get("dropped", 0)),
            seconds,
        )
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    train_config = ConfigRecord(
        {
            "lr": config.lr,
            "local-steps": config.local_steps,
            "batch-size": config.batch_size,
        }
    )
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(initial),
        num_rounds=config.num_server_rounds,
        train_config=train_config,
        evaluate_fn=evaluate_fn,
    )
    final = record_to_state(result.arrays)
    tmp = run_dir / "final_arrays.pt.tmp"
    torch.save(final, tmp)
    os.replace(tmp, run_dir / "final_arrays.pt")
    frame = writer.frame
    summary = {
        "status": "finished",
        "method": config.method,
        "rounds": len(frame),
        "initial-accuracy": initial_metrics.get("accuracy", float("nan")),
        "final-accuracy": float(frame["accuracy"].iloc[-1]),
        "final-loss": float(frame["loss"].iloc[-1]),
        "total-bytes-up": float(frame["bytes-up"].sum()),
        "total-bytes-down": float(frame["bytes-down"].sum()),
        "seconds": float(frame["seconds"].sum()),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    log(
        INFO,
        "fedlr: finished, final accuracy %.4f; results in %s",
        summary["final-accuracy"],
        run_dir,
    )
    return run_dir
