"""What the ServerApp does, as a function of a Grid and a Context.

1. Read the run config: the common keys (:class:`~fedlr.config.run.RunConfig`),
   the method's registry entry and its options
   (:func:`~fedlr.strategies.registry.resolve`).
2. Build the method's :class:`~fedlr.server_apps.plans.ServerPlan` (strategy, initial
   arrays, evaluation) with the plan registered for its payload kind
   (:func:`~fedlr.server_apps.plans.build_plan`).
3. Run the rounds (:func:`fedlr.round.pipeline.run_round`: train, then
   federated evaluation if the method asks for it); after each, evaluate,
   append a CSV row, log a progress line and save ``checkpoint.pt``
   (:mod:`fedlr.runs.checkpoint`), from which ``resume-from`` continues a crashed run.
4. Save the final arrays, the adapter directory (:mod:`fedlr.runs.export`), a
   ``summary.json`` (with the settings and the code version) and the plots
   (:mod:`fedlr.runs.plots`).

Tests call :func:`run_server` with an :class:`~fedlr.flower.InProcessGrid`;
``flwr run`` calls it through :mod:`fedlr.server_apps.app`.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid
from flwr.supercore import log

from fedlr.config.run import RunConfig
from fedlr.errors import ConfigError
from fedlr.flower.grid import InProcessGrid
from fedlr.flower.records import record_to_state, state_to_record
from fedlr.privacy.client_dp import CLIENT_DP_EPSILON, DP_EPSILON
from fedlr.privacy.secagg import CHECK_HISTORY
from fedlr.privacy.settings import PrivacyConfig, default_delta
from fedlr.robust.rules import rule_named
from fedlr.round.instructions import expected_arrays
from fedlr.round.pipeline import run_round
from fedlr.runs.checkpoint import (
    check_checkpoint_arrays,
    check_checkpoint_state,
    check_resumable,
    checkpoint_name,
    get_rng_state,
    load_checkpoint,
    save_arrays,
    save_checkpoint,
    set_rng_state,
)
from fedlr.runs.export import export_adapter
from fedlr.runs.plots import write_run_plots
from fedlr.runs.results import ResultsWriter, ensure_output_dir, privacy_summary
from fedlr.runs.tracking import code_version, open_tracker
from fedlr.server_apps.asynchronous import run_async
from fedlr.server_apps.builtin_plans import build_plan
from fedlr.server_apps.plans import ServerPlan
from fedlr.server_apps.progress import RoundClock, gap_text, round_progress
from fedlr.server_apps.secagg import (
    SECAGG_COLUMNS,
    SecAggPlusExchange,
    secure_exchange,
)
from fedlr.strategies.async_lora import AsyncLoraStrategy
from fedlr.strategies.base import FedLRStrategy
from fedlr.strategies.registry import MethodConfig, resolve
from fedlr.wire.protocol import EXACT_MATCH

__all__ = ["REPRODUCIBLE", "ServerRun", "guarantee_lines", "run_server"]

REPRODUCIBLE = "REPRODUCIBLE NOISE (epsilon is not a guarantee)"
"""What a start-up line and every round line say when the noise is seeded."""


def _run_dir(config: RunConfig, run_id: int) -> Path:
    """A new results directory, created here and never one another run wrote.

    Two runs started in the same second with the same run id (in-process
    runs) get ``-2``, ``-3``... suffixes: the directory is created with
    ``exist_ok=False``, so no run writes into another's.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"{config.method}-{config.dataset}-seed{config.seed}-{stamp}-run{run_id}"
    ensure_output_dir(config.output_path)
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
    for enough of them (not on an in-process grid, whose nodes all exist) before
    it refuses.
    """
    deadline = time.monotonic() + min(10.0, config.round_timeout)
    while True:
        nodes = len(list(grid.get_node_ids()))
        sampled = max(int(nodes * config.fraction_train), 1)
        if (
            config.min_replies <= sampled
            or time.monotonic() >= deadline
            or isinstance(grid, InProcessGrid)
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


def _set_weight_scale(plan: ServerPlan, config: RunConfig, nodes: int) -> None:
    """The strategy's ``max_num_examples``: the run config's, else the
    largest partition the plan's data set gives the connected nodes."""
    if config.max_num_examples:
        plan.strategy.max_num_examples = config.max_num_examples
    elif plan.largest_partition is not None:
        # Fewer partitions are larger: the smaller count never drops an
        # honest client whose node config cut the data into fewer parts.
        parts = min(nodes, config.num_partitions) if nodes else config.num_partitions
        plan.strategy.max_num_examples = plan.largest_partition(parts)


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f} MB"


def _g(value: float) -> str:
    return f"{value:g}"


def guarantee_lines(
    config: RunConfig, nodes: int, exchange: SecAggPlusExchange | None = None
) -> list[str]:
    """One start-up line per guarantee in force (``docs/privacy.md``,
    ``docs/reliability.md``): DP-SGD, client-level DP (central, or distributed
    under SecAgg+), SecAgg+, the robust rule, the update-size screen, and
    ``REPRODUCIBLE NOISE`` when ``reproducible-noise`` is set. ``nodes``: the
    connected nodes (client-level DP's default delta, SecAgg+'s shares)."""
    lines = [
        _dp_sgd_line(config),
        _client_dp_line(config, nodes, exchange),
        _secagg_line(config, nodes, exchange),
        _robust_line(config),
        _screen_line(config, exchange),
    ]
    if config.reproducible_noise:
        lines.append(
            f"{REPRODUCIBLE}: the privacy noise comes from the run seed; anyone "
            "who knows it can subtract the noise"
        )
    return [line for line in lines if line]


def _dp_sgd_line(config: RunConfig) -> str:
    dp = config.privacy.dp_sgd
    if dp is None:
        return ""
    if dp.noise_multiplier > 0:
        noise = f"sigma {_g(dp.noise_multiplier)}"
        if dp.epsilon > 0:
            noise += f", run budget epsilon {_g(dp.epsilon)}"
    else:
        noise = (
            f"sigma derived on each node from the run budget epsilon "
            f"{_g(dp.epsilon)} over {dp.rounds} rounds x {config.local_steps} "
            "local steps"
        )
    delta = _g(dp.delta) if dp.delta else "min(1e-5, 1/(10 n)), n a node's examples"
    return (
        f"DP-SGD on every client: per-example clip {_g(dp.max_grad_norm)}, "
        f"{noise}, delta {delta}, accountant {dp.accountant}; a node's own "
        "limits (dp-required, dp-epsilon-budget, its delta and clip ceilings) "
        "may refuse a round"
    )


def _client_dp_line(
    config: RunConfig, nodes: int, exchange: SecAggPlusExchange | None
) -> str:
    client = config.privacy.client_dp
    if client is None:
        return ""
    delta = (
        _g(client.delta)
        if client.delta
        else f"{_g(default_delta(nodes))} (min(1e-5, 1/(10 N)), N = {nodes} nodes)"
    )
    if exchange is not None:
        where = (
            "distributed under SecAgg+ (each node clips its update and adds "
            "its share of Skellam noise; the server unmasks only the noised "
            "sum), accountant Skellam RDP without subsampling"
        )
    else:
        where = (
            f"central (the server clips each update and noises the mean), "
            f"accountant {client.accountant}"
        )
    return (
        f"client-level DP: update clip {_g(client.clip)}, z "
        f"{_g(client.noise_multiplier)}, delta {delta}, {where}"
    )


def _secagg_line(
    config: RunConfig, nodes: int, exchange: SecAggPlusExchange | None
) -> str:
    if exchange is None:
        return ""
    settings = exchange.settings
    sampled = max(int(nodes * config.fraction_train), 1)
    shares, threshold = settings.shares_and_threshold(sampled)
    return (
        f"SecAgg+ on every train round (the server sees only the sum): "
        f"{shares} shares of {sampled} clients, threshold {threshold}, "
        f"clipping range [-{_g(settings.clipping_range)}, "
        f"{_g(settings.clipping_range)}], {settings.quantization_range} "
        "quantisation levels"
    )


def _robust_line(config: RunConfig) -> str:
    robust = config.robust_config
    if not robust.active:
        return ""
    line = f"robust aggregation: {rule_named(robust.rule).startup(robust)}"
    if robust.max_client_weight < 1.0:
        line += f", max client weight {_g(robust.max_client_weight)}"
    if robust.max_weight_ratio > 0:
        line += (
            f", weights capped at {_g(robust.max_weight_ratio)} x the round's "
            "median weight"
        )
    return line


def _screen_line(config: RunConfig, exchange: SecAggPlusExchange | None) -> str:
    if config.screen_ratio <= 0 or exchange is not None:
        return ""
    against = (
        "the published global state's norm"
        if config.privacy.client_dp is not None
        else "the round's median update norm (and above the model's norm)"
    )
    return (
        f"update-size screen: a reply whose update norm is above "
        f"{_g(config.screen_ratio)}x {against} is dropped"
    )


def _metrics_summary(
    method: str, frame: pd.DataFrame, initial: Mapping[str, float]
) -> dict[str, Any]:
    """``summary.json``'s measured part: the metrics before training and after
    the last round, the bytes, the time, the privacy spent (if any)."""
    summary: dict[str, Any] = {
        "status": "finished",
        "method": method,
        "rounds": len(frame),
        "initial-accuracy": initial.get("accuracy", float("nan")),
        "initial-loss": initial.get("loss", float("nan")),
        "final-accuracy": float(frame["accuracy"].iloc[-1]),
        "final-loss": float(frame["loss"].iloc[-1]),
        "total-bytes-up": float(frame["bytes-up"].sum()),
        "total-bytes-down": float(frame["bytes-down"].sum()),
        "seconds": float(frame["seconds"].sum()),
    }
    for key, value in initial.items():  # e.g. perplexity, exact-match
        if key not in ("accuracy", "loss") and key in frame:
            summary[f"initial-{key}"] = float(value)
            summary[f"final-{key}"] = float(frame[key].iloc[-1])
    for key in (DP_EPSILON, CLIENT_DP_EPSILON):  # the privacy spent, if any
        if key in frame and bool(frame[key].notna().any()):
            summary[key] = float(frame[key].max())
    return summary


def run_server(
    grid: Grid,
    context: Context,
    *,
    observe: Callable[[FedLRStrategy], None] | None = None,
) -> Path:
    """Run a whole federated training; return the run's results directory.

    With ``resume-from`` set, continue the run saved in that directory from
    its last checkpoint (same directory, same CSVs), up to
    ``num-server-rounds``. ``observe(strategy)``, when given, is called once
    the strategy is built, before round 1 (in-process studies: an
    omniscient attacker reads the server's state through it).
    """
    run = ServerRun.prepare(grid, context)
    if observe is not None:
        observe(run.strategy)
    if isinstance(run.strategy, AsyncLoraStrategy):  # FedAsync-, FedBuff-LoRA
        return run_async(run, grid)
    arrays, first = run.start()
    config, strategy = run.config, run.strategy
    train_config = ConfigRecord(run.plan.train_config)
    for server_round in range(first, config.num_server_rounds + 1):
        log(INFO, "")
        log(INFO, "[ROUND %d/%d]", server_round, config.num_server_rounds)
        arrays = run_round(
            strategy,
            round_progress(grid, server_round, config.num_server_rounds),
            server_round,
            arrays,
            train_config,
            timeout=config.round_timeout,
            exchange=run.exchange,
        )
        run.evaluate_round(server_round, arrays)
        run.checkpoint(server_round, arrays)
    return run.finish(arrays)


def epsilon_text(privacy: PrivacyConfig, row: Mapping[str, Any]) -> str:
    """`` dp-epsilon 1.88 (largest node ledger, every run) client-dp-epsilon
    12.3 (this run)`` for the DP mechanisms on (``n/a`` for a round that
    reported none, e.g. every node refused): DP-SGD's is the largest ε a node
    reported over its whole ledger, earlier runs included (each reply also
    carries the run's own, ``dp-epsilon-run``)."""
    parts = []
    for key, on, counts in (
        (DP_EPSILON, privacy.dp_sgd is not None, "largest node ledger, every run"),
        (CLIENT_DP_EPSILON, privacy.client_dp is not None, "this run"),
    ):
        if on:
            value = row.get(key)
            finite = isinstance(value, (int, float)) and math.isfinite(value)
            shown = f"{value:.3g} ({counts})" if finite else "n/a"
            parts.append(f"{key} {shown}")
    return "".join(f" {p}" for p in parts)


@dataclass
class ServerRun:
    """One run's server side: the plan, its results writer, its checkpoints.

    :func:`run_server` drives it: :meth:`prepare`, :meth:`start` (round 0 or
    the resumed checkpoint), then per round
    :func:`fedlr.round.pipeline.run_round`,
    :meth:`evaluate_round` and :meth:`checkpoint`, and :meth:`finish`.
    """

    method: MethodConfig
    plan: ServerPlan
    run_dir: Path
    writer: ResultsWriter
    resume: dict[str, Any] | None
    initial_metrics: dict[str, float] = field(default_factory=dict)
    clock: RoundClock = field(default_factory=RoundClock)
    started: float = field(default_factory=time.perf_counter)
    first_round: int = 1
    exchange: SecAggPlusExchange | None = None
    """``secure-aggregation``: the train rounds' SecAgg+ exchange."""

    @property
    def config(self) -> RunConfig:
        return self.method.run

    @property
    def strategy(self) -> FedLRStrategy:
        return self.plan.strategy

    @classmethod
    def prepare(cls, grid: Grid, context: Context) -> ServerRun:
        """Parse the run config, seed, build the plan and the results writer."""
        method = resolve(context.run_config)
        config, spec = method.run, method.spec
        resume = load_checkpoint(config.resume_from) if config.resume_from else None
        if resume is not None:
            check_resumable(resume["config"], method.to_mapping(), method.defaults())
        else:
            ensure_output_dir(config.output_path)  # before the model is built
        random.seed(config.seed)  # Flower samples nodes with `random`
        torch.manual_seed(config.seed)

        plan = build_plan(method)
        strategy = plan.strategy
        nodes = _check_federation(grid, config)
        _set_weight_scale(plan, config, nodes)
        exchange = secure_exchange(method, strategy, nodes)
        if resume is not None:
            run_dir = Path(config.resume_from)
        else:
            run_dir = _run_dir(config, int(context.run_id))
        tracker = open_tracker(
            config.tracker,
            run_dir,
            resume_step=None if resume is None else int(resume["round"]) + 1,
        )
        writer = ResultsWriter(
            run_dir,
            method=config.method,
            config=method.to_mapping() if resume is None else None,
            extra_columns=plan.columns + (SECAGG_COLUMNS if exchange else ()),
            tracker=tracker,
            privacy=config.privacy,
        )
        log(
            INFO,
            "fedlr: method %s (%s), results in %s",
            spec.name,
            spec.summary,
            run_dir,
        )
        for line in (
            plan.description,
            method.auto,
            *guarantee_lines(config, nodes, exchange),
        ):
            if line:
                log(INFO, "fedlr: %s", line)
        strategy.summary()
        return cls(method, plan, run_dir, writer, resume, exchange=exchange)

    def start(self) -> tuple[ArrayRecord, int]:
        """The arrays the first round starts from, and that round's number.

        A new run evaluates and checkpoints the initial model (round 0); a
        resumed one restores the checkpoint's arrays, strategy and plan state,
        CSV rows and RNG states.
        """
        resume, config, strategy = self.resume, self.config, self.strategy
        if resume is None:
            arrays = state_to_record(self.plan.initial_arrays)
            self.evaluate_round(0, arrays)
            self.checkpoint(0, arrays)
            return arrays, 1
        check_checkpoint_state(
            resume["strategy"],
            strategy.state_dict(),
            method=self.method.spec.name,
            source=Path(config.resume_from) / checkpoint_name(int(resume["round"])),
        )
        strategy.load_state_dict(resume["strategy"])
        check_checkpoint_arrays(
            resume["arrays"], self.expected_arrays(), source=config.resume_from
        )
        arrays = ArrayRecord(resume["arrays"])
        if self.plan.load_state is not None:
            self.plan.load_state(resume.get("plan", {}))
        self.writer.restore(
            int(resume["round"]), resume.get("results"), resume.get("layers")
        )
        self.initial_metrics.update(resume.get("extra", {}).get("initial", {}))
        check = None if self.exchange is None else self.exchange.check
        if check is not None:  # the median a resumed secure round is held to
            check.history = [float(v) for v in resume["extra"].get(CHECK_HISTORY, [])]
        set_rng_state(resume["rng"])
        self.first_round = int(resume["round"]) + 1
        log(
            INFO,
            "fedlr: resuming after round %d of %d",
            self.first_round - 1,
            config.num_server_rounds,
        )
        self.started = time.perf_counter()
        return arrays, self.first_round

    def expected_arrays(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Keys, shapes and dtypes of the global arrays this run sends.

        The strategy's expected arrays
        (:func:`fedlr.round.instructions.expected_arrays`, after its state is
        restored: a grown FedSpec rank) where it declares them, else the plan's initial
        arrays; the dtypes are the initial arrays'.
        """
        initial = self.plan.initial_arrays
        declared = expected_arrays(self.strategy)
        shapes = (
            {key: tuple(t.shape) for key, t in initial.items()}
            if declared is None
            else declared
        )
        fallback = next(iter(initial.values())).dtype
        return {
            key: (tuple(shape), initial[key].dtype if key in initial else fallback)
            for key, shape in shapes.items()
        }

    @property
    def headline(self) -> str:
        """The metric a round's line leads with: ``exact-match`` for a causal LM
        (whose ``accuracy`` column is the same number), else ``accuracy``."""
        return EXACT_MATCH if EXACT_MATCH in self.plan.columns else "accuracy"

    def should_evaluate(self, server_round: int) -> bool:
        """Whether the server evaluates the global model after this round."""
        needs = self.plan.needs_evaluation
        return (
            server_round % self.config.eval_every == 0
            or server_round == self.config.num_server_rounds
            or (needs is not None and needs(server_round))
        )

    def evaluate_round(self, server_round: int, arrays: ArrayRecord) -> None:
        """Evaluate (when due), append the round's CSV row, log the progress line."""
        started = time.perf_counter()
        if server_round == 0 or self.should_evaluate(server_round):
            result = self.plan.evaluate(server_round, record_to_state(arrays))
        else:
            result = {"accuracy": math.nan, "loss": math.nan}
        eval_seconds = time.perf_counter() - started
        accuracy, loss = float(result["accuracy"]), float(result["loss"])
        if server_round == 0:
            log(
                INFO, "fedlr: initial %s %.4f, loss %.4f", self.headline, accuracy, loss
            )
            self.initial_metrics.update(result)
            self.started = time.perf_counter()
            return
        seconds = time.perf_counter() - self.started
        self.started = time.perf_counter()
        strategy = self.strategy
        report = strategy.last_report
        m = report.metrics
        copied = tuple(c for c in self.writer.columns if c not in {"round", "method"})
        row: dict[str, Any] = {k: m[k] for k in copied if k in m}
        row.update({k: v for k, v in result.items() if k in copied})
        row.update({"round": server_round, "seconds": seconds})
        timing = strategy.last_timing
        row.update(
            {
                "train-seconds": timing.get("train-seconds", math.nan),
                "aggregate-seconds": timing.get("aggregate-seconds", math.nan),
                "eval-seconds": eval_seconds
                + timing.get("federated-eval-seconds", 0.0),
            }
        )
        layers = report.layers
        if self.exchange is not None:  # what travelled; no per-client gaps
            row.update(self.exchange.row())
            layers = {}
        self.writer.append(row, layers=layers)
        self.log_round(server_round, (accuracy, loss), m, row, seconds)

    def log_round(
        self,
        server_round: int,
        scores: tuple[float, float],
        metrics: Mapping[str, Any],
        row: Mapping[str, Any],
        seconds: float,
    ) -> None:
        """The round's one line: headline metric and loss (``scores``; ``not
        evaluated`` for a round the server did not evaluate), gap,
        bytes, the strategy's client counts (``metrics``), time and ETA, then
        the plan's extra columns of the results ``row``, the privacy spent
        (:func:`epsilon_text`, with DP on); ``REPRODUCIBLE NOISE`` when the
        privacy noise comes from the run seed."""
        accuracy, loss = scores
        score = (
            "not evaluated"  # eval-every, an asynchronous run's versions
            if math.isnan(accuracy) and math.isnan(loss)
            else f"{self.headline} {accuracy:.4f} loss {loss:.4f}"
        )
        headline = self.headline
        extras = " ".join(
            f"{c} {row[c]:.4g}"
            for c in self.plan.columns
            if c != headline
            and isinstance(row.get(c), (int, float))
            and not math.isnan(row[c])
        )
        log(
            INFO,
            "fedlr [round %d/%d] %s %s"
            "up %s down %s clients %d dropped %d %.1fs %s%s%s%s",
            server_round,
            self.config.num_server_rounds,
            score,
            gap_text({**metrics, **row}),  # the row's values (secure aggregation's)
            _mb(row.get("bytes-up", 0.0)),
            _mb(row.get("bytes-down", 0.0)),
            int(metrics.get("clients", 0)),
            int(metrics.get("dropped", 0)),
            seconds,
            self.clock.lap(seconds, self.config.num_server_rounds - server_round),
            f" {extras}" if extras else "",
            epsilon_text(self.config.privacy, row),
            f" {REPRODUCIBLE}" if self.config.privacy.reproducible else "",
        )

    def checkpoint(self, server_round: int, arrays: ArrayRecord) -> None:
        """Save the round's checkpoint, unless the round was rejected."""
        strategy = self.strategy
        if server_round > 0 and strategy.last_rejection is not None:
            log(
                WARNING,
                "fedlr: round %d was rejected; the checkpoint of the last accepted "
                "round stays the newest",
                server_round,
            )
            return
        plan = self.plan
        save_checkpoint(
            self.run_dir,
            {
                "round": server_round,
                "arrays": record_to_state(arrays),
                "strategy": strategy.state_dict(),
                "plan": plan.save_state() if plan.save_state else {},
                "rng": get_rng_state(),
                "extra": {"initial": dict(self.initial_metrics), **self._check_state()},
                "config": self.method.to_mapping(),
            },
            keep=self.config.keep_checkpoints,
        )
        self.started = time.perf_counter()  # a round's seconds exclude this

    def _check_state(self) -> dict[str, list[float]]:
        """The secure aggregate check's accepted norms, for the checkpoint
        (a resumed run's first round is held to the same median)."""
        check = None if self.exchange is None else self.exchange.check
        return {} if check is None else {CHECK_HISTORY: list(check.history)}

    def finish(self, arrays: ArrayRecord) -> Path:
        """Write the final arrays, the adapter
        (:func:`fedlr.runs.export.export_adapter`), ``summary.json`` and the
        plots; close the tracker."""
        config, run_dir = self.config, self.run_dir
        final = record_to_state(arrays)
        save_arrays(run_dir / "final_arrays.pt", final)
        frame = self.writer.frame
        summary = _metrics_summary(config.method, frame, self.initial_metrics)
        strategy = self.strategy  # "privacy-noise", "outside-epsilon" (DP on):
        own_eval = not (strategy.personalised or strategy.federated_evaluation)
        privacy = privacy_summary(
            config.privacy, self.writer.columns, server_evaluated=own_eval
        )
        summary.update(privacy)
        if self.resume is not None:
            summary["resumed-after-round"] = self.first_round - 1
        if self.plan.finish is not None:
            summary.update(self.plan.finish(run_dir))
        last = int(frame["round"].iloc[-1]) if len(frame) else 0
        summary.update(export_adapter(self.method, final, run_dir, rounds=last))
        headline = self.headline
        summary["headline-metric"] = headline
        summary["evaluation"] = "personalised" if strategy.personalised else "global"
        summary["folds-base"] = bool(self.method.spec.traits.folds_base)
        if headline in frame and len(frame):
            summary[f"final-{headline}"] = float(frame[headline].iloc[-1])
        summary["code-version"] = code_version()
        summary["settings"] = self.method.to_mapping()
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.writer.close()
        plots = write_run_plots(run_dir)
        log(INFO, "fedlr: plots %s", ", ".join(p.name for p in plots))
        log(
            INFO,
            "fedlr: finished, final %s %.4f; results in %s",
            headline,
            summary.get(f"final-{headline}", summary["final-accuracy"]),
            run_dir,
        )
        return run_dir
