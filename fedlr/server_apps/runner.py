"""What the ServerApp does, as a function of a Grid and a Context.

1. Read the run config: the common keys (:class:`~fedlr.config.RunConfig`),
   the method's registry entry and its options
   (:func:`~fedlr.strategies.registry.resolve`).
2. Build the method's :class:`~fedlr.server_apps.plans.ServerPlan` (strategy, initial
   arrays, evaluation) with the plan registered for its payload kind
   (:func:`~fedlr.server_apps.plans.build_plan`).
3. Run the rounds (``strategy.run_round``: train, then federated evaluation
   if the method asks for it); after each, evaluate, append a CSV row, log a
   progress line and save ``checkpoint.pt`` (:mod:`fedlr.checkpoint`), from
   which ``resume-from`` continues a crashed run.
4. Save the final arrays, a ``summary.json`` and the plots
   (:mod:`fedlr.plots`).

Tests call :func:`run_server` with an :class:`~fedlr.flower.InProcessGrid`;
``flwr run`` calls it through :mod:`fedlr.server_apps.app`.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid
from flwr.supercore import log

from fedlr.checkpoint import (
    check_resumable,
    get_rng_state,
    load_checkpoint,
    save_checkpoint,
    set_rng_state,
)
from fedlr.config import RunConfig
from fedlr.errors import CheckpointError, ConfigError, InitialArraysError
from fedlr.flower.records import record_to_state, state_to_record
from fedlr.plots import write_run_plots
from fedlr.results import ResultsWriter
from fedlr.server_apps.plans import build_plan
from fedlr.strategies.registry import resolve

__all__ = ["run_server"]


def _run_dir(config: RunConfig, run_id: int) -> Path:
    """A new results directory, created here and never one another run wrote.

    Two runs started in the same second with the same run id (in-process
    runs) get ``-2``, ``-3``... suffixes: the directory is created with
    ``exist_ok=False``, so no run writes into another's.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"{config.method}-{config.dataset}-seed{config.seed}-{stamp}-run{run_id}"
    config.output_path.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, 1000):
        path = config.output_path / (name if attempt == 1 else f"{name}-{attempt}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise ConfigError("output-dir", f"cannot create a new run directory for {name}")


def _check_federation(grid: Grid, config: RunConfig) -> int:
    """The number of connected nodes; a ConfigError if a round cannot succeed.

    ``min-replies`` larger than the nodes a round samples (at least one, and
    ``fraction-train`` of those connected) could never be met: refused before
    round 1 rather than after a round of training.
    In deployment, nodes may still be connecting: the check waits up to 10 s
    for enough of them (not on a grid whose ``nodes_fixed`` is true) before it refuses.
    """
    deadline = time.monotonic() + min(10.0, config.round_timeout)
    while True:
        nodes = len(list(grid.get_node_ids()))
        sampled = max(int(nodes * config.fraction_train), 1)
        if (
            config.min_replies <= sampled
            or time.monotonic() >= deadline
            or getattr(grid, "nodes_fixed", False)
        ):
            break
        time.sleep(1.0)  # deployment: nodes may still be connecting
    if config.min_replies > sampled:
        raise ConfigError(
            "min-replies",
            f"{config.min_replies} valid replies are needed per round but a round "
            f"samples {sampled} of the {nodes} connected nodes (fraction-train "
            f"{config.fraction_train}); lower min-replies or add nodes",
        )
    return nodes


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f} MB"


def run_server(grid: Grid, context: Context) -> Path:
    """Run a whole federated training; return the run's results directory.

    With ``resume-from`` set, continue the run saved in that directory from
    its last checkpoint (same directory, same CSVs), up to
    ``num-server-rounds``.
    """
    method = resolve(context.run_config)
    config, spec = method.run, method.spec
    resume = load_checkpoint(config.resume_from) if config.resume_from else None
    if resume is not None:
        check_resumable(resume["config"], method.to_mapping())
    random.seed(config.seed)  # Flower samples nodes with `random`
    torch.manual_seed(config.seed)

    plan = build_plan(method)
    strategy = plan.strategy
    nodes = _check_federation(grid, config)
    if config.max_num_examples:
        strategy.max_num_examples = config.max_num_examples
    elif plan.largest_partition is not None:
        # Fewer partitions are larger: the smaller count never drops an honest
        # client whose node config cut the data into fewer parts.
        parts = min(nodes, config.num_partitions) if nodes else config.num_partitions
        strategy.max_num_examples = plan.largest_partition(parts)
    if resume is not None:
        run_dir = Path(config.resume_from)
    else:
        run_dir = _run_dir(config, int(context.run_id))
    writer = ResultsWriter(
        run_dir,
        method=config.method,
        config=method.to_mapping() if resume is None else None,
        extra_columns=plan.columns,
    )
    log(INFO, "fedlr: method %s (%s), results in %s", spec.name, spec.summary, run_dir)
    if plan.description:
        log(INFO, "fedlr: %s", plan.description)
    strategy.summary()

    clock = {"t": time.perf_counter()}
    initial_metrics: dict[str, float] = {}
    copied = tuple(c for c in writer.columns if c not in {"round", "method"})

    def should_evaluate(server_round: int) -> bool:
        return (
            server_round % config.eval_every == 0
            or server_round == config.num_server_rounds
            or (
                plan.needs_evaluation is not None
                and plan.needs_evaluation(server_round)
            )
        )

    def evaluate_round(server_round: int, arrays: ArrayRecord) -> None:
        started = time.perf_counter()
        if server_round == 0 or should_evaluate(server_round):
            result = plan.evaluate(server_round, record_to_state(arrays))
        else:
            result = {"accuracy": math.nan, "loss": math.nan}
        eval_seconds = time.perf_counter() - started
        accuracy, loss = float(result["accuracy"]), float(result["loss"])
        if server_round == 0:
            log(INFO, "fedlr: initial accuracy %.4f, loss %.4f", accuracy, loss)
            initial_metrics.update(result)
            clock["t"] = time.perf_counter()
            return
        seconds = time.perf_counter() - clock["t"]
        clock["t"] = time.perf_counter()
        report = strategy.last_report
        m = report.metrics
        row: dict[str, Any] = {k: m[k] for k in copied if k in m}
        row.update({k: v for k, v in result.items() if k in copied})
        row.update({"round": server_round, "seconds": seconds})
        row.update(
            {
                "train-seconds": strategy.last_timing.get("train-seconds", math.nan),
                "aggregate-seconds": strategy.last_timing.get(
                    "aggregate-seconds", math.nan
                ),
                "eval-seconds": eval_seconds
                + strategy.last_timing.get("federated-eval-seconds", 0.0),
            }
        )
        writer.append(row, layers=report.layers)
        extras = " ".join(
            f"{c} {row[c]:.4g}"
            for c in plan.columns
            if isinstance(row.get(c), (int, float)) and not math.isnan(row[c])
        )
        log(
            INFO,
            "fedlr [round %d/%d] accuracy %.4f loss %.4f gap %.3e (rel %.3e) "
            "up %s down %s clients %d dropped %d %.1fs%s",
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
            f" {extras}" if extras else "",
        )

    def checkpoint(server_round: int, arrays: ArrayRecord) -> None:
        if server_round > 0 and strategy.last_rejection is not None:
            log(
                WARNING,
                "fedlr: round %d was rejected; the checkpoint of the last accepted "
                "round stays the newest",
                server_round,
            )
            return
        rows, layer_rows = writer.rows()
        save_checkpoint(
            run_dir,
            {
                "round": server_round,
                "arrays": record_to_state(arrays),
                "strategy": strategy.state_dict(),
                "plan": plan.save_state() if plan.save_state else {},
                "rng": get_rng_state(),
                "results": rows,
                "layers": layer_rows,
                "extra": {"initial": dict(initial_metrics)},
                "config": method.to_mapping(),
            },
            keep=config.keep_checkpoints,
        )

    if resume is None:
        arrays = state_to_record(plan.initial_arrays)
        evaluate_round(0, arrays)
        first = 1
        checkpoint(0, arrays)
    else:
        arrays = ArrayRecord(resume["arrays"])
        strategy.load_state_dict(resume["strategy"])
        try:
            strategy.check_arrays(arrays)
        except InitialArraysError as exc:
            raise CheckpointError(
                f"{config.resume_from}: the checkpoint's arrays do not fit this "
                f"run's layout: {exc}"
            ) from None
        if plan.load_state is not None:
            plan.load_state(resume.get("plan", {}))
        writer.restore(resume["results"], resume.get("layers", []))
        initial_metrics.update(resume.get("extra", {}).get("initial", {}))
        set_rng_state(resume["rng"])
        first = int(resume["round"]) + 1
        log(
            INFO,
            "fedlr: resuming after round %d of %d",
            first - 1,
            config.num_server_rounds,
        )
        clock["t"] = time.perf_counter()

    train_config = ConfigRecord(plan.train_config)
    for server_round in range(first, config.num_server_rounds + 1):
        log(INFO, "")
        log(INFO, "[ROUND %d/%d]", server_round, config.num_server_rounds)
        arrays = strategy.run_round(
            grid,
            server_round,
            arrays,
            train_config,
            timeout=config.round_timeout,
        )
        evaluate_round(server_round, arrays)
        checkpoint(server_round, arrays)

    final = record_to_state(arrays)
    tmp = run_dir / "final_arrays.pt.tmp"
    torch.save(final, tmp)
    os.replace(tmp, run_dir / "final_arrays.pt")
    frame = writer.frame
    summary: dict[str, Any] = {
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
    for key, value in initial_metrics.items():  # e.g. perplexity, exact-match
        if key not in ("accuracy", "loss") and key in frame:
            summary[f"initial-{key}"] = float(value)
            summary[f"final-{key}"] = float(frame[key].iloc[-1])
    if resume is not None:
        summary["resumed-after-round"] = first - 1
    if plan.finish is not None:
        summary.update(plan.finish(run_dir))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    plots = write_run_plots(run_dir)
    log(INFO, "fedlr: plots %s", ", ".join(p.name for p in plots))
    log(
        INFO,
        "fedlr: finished, final accuracy %.4f; results in %s",
        summary["final-accuracy"],
        run_dir,
    )
    return run_dir
