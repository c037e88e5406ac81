"""The client-drift regime study (docs/results/drift).

Does exact aggregation pay where clients drift apart? Eight clients on a
strongly non-IID split (Dirichlet 0.1) train a number of local steps per
round at LoRA rank 8; six methods (fedavg-lora = FedIT, fedex-lora, flora,
fedspec, ffa-lora, fedsvd) run each cell with the same five seeds, on
polarity and BBC News. The default grid (local steps 2, 5 and 10, 2 rounds:
180 runs, about 2.7 CPU-hours on one thread, 1.4 h on the 2 cores) fits the
study's budget of 4 CPU-hours beside the mechanism runs and the rest of a
working session; the planned one (local steps 5, 20 and 80, 6 rounds:
``--steps 5,20,80 --rounds 6``) is about 40 CPU-hours (``plan`` prints the
estimate of any subset from :data:`COST`). The settings every run shares
are ``benchmarks/conf/drift.toml``, a run config (``flwr run .
--run-config benchmarks/conf/drift.toml`` runs one cell). Every run goes
through :func:`fedlr.launch.local.run_in_process` (the same round path
as ``flwr run``, without the Ray start-up) and lands in
``<runs>/<dataset>-steps<S>-rank<R>/<method>-seed<K>/``; a run whose
``results.csv`` already has every round (and whose ``drift-rounds.csv`` is
written) is not run again, so the study can be stopped and resumed.

``python -m benchmarks.drift run [--datasets polarity,bbc-news] [--ranks 8]
[--steps 2,5,10] [--seeds 0,3,4,12,14] [--methods ...] [--rounds N]
[--runs DIR]``
    run the missing runs (one CPU thread; progress on stderr; several
    processes may run at once on different methods or seeds);
``python -m benchmarks.drift plan [same options]``
    the runs still missing and their estimated CPU time (:data:`COST`);
``python -m benchmarks.drift seeds [--datasets ...] [--count 5]``
    the Dirichlet seeds whose split gives every client data on every data set;
``--methods`` also takes the mechanism variants of :data:`VARIANTS`
(``fedex-half``: FedEx-LoRA folding half of each residual);
``python -m benchmarks.drift table [--runs DIR] [--out DIR]``
    tabulate what has finished: ``drift.csv`` (one row per run),
    ``summary.csv`` / ``summary.md`` (mean ± std over seeds, the accuracy
    difference to FedIT with the seeds paired and its 95% t-interval, next
    to the drift diagnostics), ``paired.md`` (the differences alone, one row
    per cell, in points), ``mechanism.md`` (the :data:`MECHANISM` contrasts)
    and ``drift.png`` (the difference to FedIT
    against the client drift, one panel per data set).

Drift diagnostics, per round, in each method's update space (the change of
each layer's product ``B_i A_i - B A`` against the global adapters sent,
computed from the factors, never a dense product per client; a factor a
method does not send, FFA-LoRA's frozen ``A``, is the initial one):
``client-drift = sqrt(sum_i w_i ||u_i - u_bar||_F^2)`` and ``update-norm =
||u_bar||_F`` with ``u_bar = sum_i w_i u_i`` and ``w_i`` the clients' shares
of the examples. They are written beside the run's ``results.csv`` as
``drift-rounds.csv`` by a reply hook of the in-process grid (the replies are
read, never changed). ``frobenius-gap`` / ``relative-gap`` come from the
run's own ``results.csv``: for FedEx-LoRA the gap is the norm of the
residual folded into ``W0`` (relative: against the norm of the mean client
product).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import sys
import time
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import pandas as pd
import torch
from flwr.app import Message
from matplotlib.figure import Figure
from scipy import stats

from fedlr.adapters.roles import Role
from fedlr.config.run import RunConfig
from fedlr.flower.records import record_to_state
from fedlr.launch.compare import quiet_in_process
from fedlr.launch.local import run_in_process
from fedlr.robust.spaces import ProductSpace
from fedlr.tasks.text import text_task
from fedlr.wire.protocol import ARRAYS, CONFIG, METRICS, NUM_EXAMPLES, SERVER_ROUND
from fedlr.wire.updates import ClientUpdate

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "outputs" / "drift-grid"
OUT = ROOT / "docs" / "results" / "drift" / "grid"
CONF = ROOT / "benchmarks" / "conf" / "drift.toml"
METHODS = ("fedavg-lora", "fedex-lora", "flora", "fedspec", "ffa-lora", "fedsvd")
VARIANTS: dict[str, dict[str, Any]] = {
    "fedex-half": {"method": "fedex-lora", "fedex-fold-scale": 0.5},
    "fedex-nofold": {"method": "fedex-lora", "fedex-fold-scale": 0.0},
}
"""The mechanism runs (``--methods fedex-half,...``): FedEx-LoRA with half of
each round's residual folded into ``W0``, and with none (FedIT's model with
FedEx's code path, a check that the fold is the only difference)."""
BASELINE = "fedavg-lora"
DATASETS = ("polarity", "bbc-news")
STEPS = (2, 5, 10)
"""The default local steps: three levels, each 2-2.5 times the last (the
planned 5, 20, 80 at 6 rounds is about 40 CPU-hours: ``plan`` prints it)."""
RANKS = (8,)
SEED_CANDIDATES = tuple(range(30))
SEEDS = (0, 3, 4, 12, 14)
"""The first five seeds for which Dirichlet(0.1) gives every one of the 8
partitions at least ``min-partition-size`` = 10 training rows on polarity
AND on BBC News (:func:`valid_seeds`; polarity refuses seeds 1, 2, 5-11 and
13: the run would stop with a ValueError before any training; BBC News takes
every seed up to 29). Chosen from the splits alone, before any run."""

CELL_KEYS = ("method", "dataset", "local-steps", "seed", "lora-rank", "lora-alpha")
"""The run-config keys a cell sets; the rest of :data:`CONF` is :data:`SETTINGS`."""


def _settings(path: Path = CONF) -> dict[str, Any]:
    with path.open("rb") as handle:
        conf = tomllib.load(handle)
    return {k: v for k, v in conf.items() if k not in CELL_KEYS}


SETTINGS: dict[str, Any] = _settings()
"""The settings every run shares (``benchmarks/conf/drift.toml`` without the
cell's keys; the rest are fedlr's defaults)."""

COST: dict[str, Any] = {
    "train-step": {"polarity": 0.398, "bbc-news": 0.547},
    "eval-example": {"polarity": 0.0080, "bbc-news": 0.0150},
    "run": 2.3,
}
"""Measured CPU seconds (one thread of the 2-core machine, MiniLM, max-length
64): one client optimiser step of batch 16, one held-out example evaluated,
and a run's fixed cost (model build, split, tokenisation, aggregation). See
docs/results/drift, "The cheaper run"."""

_LOG = logging.getLogger("fedlr.drift")


# ----------------------------------------------------------------- the grid
def cell_config(
    dataset: str, steps: int, rank: int, method: str, seed: int
) -> dict[str, Any]:
    """The run config of one run (LoRA alpha = 2 x rank: scaling 2 throughout)."""
    return {
        **SETTINGS,
        "dataset": dataset,
        "local-steps": steps,
        "lora-rank": rank,
        "lora-alpha": 2.0 * rank,
        "seed": seed,
        **VARIANTS.get(method, {"method": method}),
    }


def split_ok(dataset: str, seed: int, settings: Mapping[str, Any] = SETTINGS) -> bool:
    """Whether ``seed``'s split of ``dataset`` gives every client its minimum.

    The split is the one a run builds (:meth:`fedlr.tasks.text.TextTask.split`,
    cached per process); a split that cannot give every partition
    ``min-partition-size`` rows raises the run's ``ValueError`` before any
    training, and is ``False`` here.
    """
    config = RunConfig.from_mapping({**settings, "dataset": dataset, "seed": seed})
    try:
        text_task(config).split()
    except ValueError:
        return False
    return True


def valid_seeds(
    datasets: Iterable[str],
    candidates: Iterable[int] = SEED_CANDIDATES,
    settings: Mapping[str, Any] = SETTINGS,
) -> list[int]:
    """The ``candidates`` whose split is valid (:func:`split_ok`) on every data set."""
    names = list(datasets)
    return [s for s in candidates if all(split_ok(d, s, settings) for d in names)]


def estimate_seconds(dataset: str, steps: int, rounds: int | None = None) -> float:
    """Estimated CPU seconds of one run from :data:`COST` (any method).

    ``rounds x clients x steps`` optimiser steps, the two held-out
    evaluations (round 0 and the last: a run sets ``eval-every`` to its
    rounds) and the fixed cost.
    Aggregation is not counted (under 0.2 s a round for FedIT and FedEx).
    """
    rounds = int(SETTINGS["num-server-rounds"]) if rounds is None else rounds
    evals = 2  # round 0 and the last (eval-every = the rounds)
    clients = int(SETTINGS["num-partitions"])
    examples = int(SETTINGS["max-eval-examples"])
    return (
        rounds * clients * steps * COST["train-step"][dataset]
        + evals * examples * COST["eval-example"][dataset]
        + COST["run"]
    )


def _cell_dir(runs: Path, dataset: str, steps: int, rank: int) -> Path:
    return runs / f"{dataset}-steps{steps}-rank{rank}"


def _rounds_of(run_dir: Path) -> int:
    """The rounds the run was configured with (its ``config.json``), else the conf's."""
    config = run_dir / "config.json"
    if config.is_file():
        return int(json.loads(config.read_text())["num-server-rounds"])
    return int(SETTINGS["num-server-rounds"])


def _finished(run_dir: Path, rounds: int) -> bool:
    results = run_dir / "results.csv"
    if not results.is_file() or not (run_dir / "drift-rounds.csv").is_file():
        return False
    return len(pd.read_csv(results)) >= rounds


def _cells(args: argparse.Namespace) -> list[tuple[str, int, int, int, str]]:
    return [
        (dataset, rank, steps, seed, method)
        for dataset in args.datasets
        for rank in args.ranks
        for seed in args.seeds
        for steps in args.steps
        for method in args.methods
    ]


# ------------------------------------------------------- drift diagnostics
def _pairs(keys: Iterable[str]) -> list[tuple[str, str]]:
    """``(a_key, b_key)`` of every adapted layer named in ``keys``."""
    names = {
        k.replace(".lora_A.", ".lora_X.").replace(".lora_B.", ".lora_X.")
        for k in keys
        if ".lora_A." in k or ".lora_B." in k
    }
    return sorted(
        (n.replace(".lora_X.", ".lora_A."), n.replace(".lora_X.", ".lora_B."))
        for n in names
    )


def drift_of(
    updates: Sequence[ClientUpdate],
    reference: Mapping[str, torch.Tensor],
    pairs: Sequence[tuple[str, str]],
) -> tuple[float, float]:
    """``(client-drift, update-norm)`` of one round's updates, in product space.

    ``client-drift = sqrt(sum_i w_i ||u_i - u_bar||^2)`` and ``update-norm =
    ||u_bar||`` with ``u_i = B_i A_i - B A`` per layer (``reference`` holds
    ``A``, ``B``), ``u_bar = sum_i w_i u_i`` and ``w_i = weight_i / sum
    weight``. From the k x k Gram matrix of the updates
    (:class:`fedlr.robust.rules.ProductSpace`, r x r products per pair).
    """
    if not updates:
        raise ValueError("drift_of needs at least one update")
    gram = ProductSpace(reference, pairs).gram(updates)
    w = torch.tensor([u.weight for u in updates], dtype=torch.float64)
    if not float(w.sum()) > 0:
        raise ValueError(f"client weights must have a positive sum, got {w.tolist()}")
    w = w / w.sum()
    mean_sq = float(w @ gram @ w)
    spread = float(w @ gram.diagonal()) - mean_sq
    return math.sqrt(max(spread, 0.0)), math.sqrt(max(mean_sq, 0.0))


class DriftRecorder:
    """A reply hook of the in-process grid that keeps each round's train replies.

    It reads the instruction (the global adapters sent) and the reply (the
    client's adapters and example count) and returns the reply unchanged.
    :meth:`rounds` gives ``client-drift`` and ``update-norm`` per round.

    Parameters
    ----------
    config : mapping
        The run config (to build the initial adapters when a method never
        sends a factor: FFA-LoRA's ``A``).
    """

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.config = dict(config)
        self._reference: dict[int, dict[str, torch.Tensor]] = {}
        self._updates: dict[int, list[ClientUpdate]] = {}
        self._initial: dict[str, torch.Tensor] | None = None

    def __call__(self, partition: int, message: Message, reply: Message) -> Message:
        if (
            not message.metadata.message_type.startswith("train")
            or not reply.has_content()
            or ARRAYS not in reply.content
        ):
            return reply
        server_round = int(
            cast(int, message.content.config_records[CONFIG][SERVER_ROUND])
        )
        if server_round not in self._reference:
            sent = record_to_state(message.content.array_records[ARRAYS])
            self._reference[server_round] = {
                k: v.detach().clone() for k, v in sent.items() if ".lora_" in k
            }
        arrays = record_to_state(reply.content.array_records[ARRAYS])
        examples = reply.content.metric_records[METRICS][NUM_EXAMPLES]
        self._updates.setdefault(server_round, []).append(
            ClientUpdate(
                node_id=partition,
                arrays={
                    k: v.detach().clone() for k, v in arrays.items() if ".lora_" in k
                },
                num_examples=int(cast(int, examples)),
                metrics={},
                content=reply.content,
                nbytes=0,
            )
        )
        return reply

    def _initial_adapters(self) -> dict[str, torch.Tensor]:
        if self._initial is None:
            with torch.random.fork_rng():  # the run's RNG state is left alone
                model = text_task(
                    RunConfig.from_mapping(self.config)
                ).build_lora_model()
                self._initial = model.state([Role.LORA_A, Role.LORA_B])
        return self._initial

    def rounds(self) -> pd.DataFrame:
        """``round, clients, client-drift, update-norm, relative-drift`` per round."""
        rows = []
        for server_round in sorted(self._updates):
            updates = self._updates[server_round]
            reference = self._reference[server_round]
            keys = {k for u in updates for k in u.arrays} | set(reference)
            pairs = _pairs(keys)
            missing = {k for p in pairs for k in p} - keys
            if missing:  # a factor never sent: the initial one
                initial = self._initial_adapters()
                reference = {**{k: initial[k] for k in missing}, **reference}
            drift, norm = drift_of(updates, reference, pairs)
            rows.append(
                {
                    "round": server_round,
                    "clients": len(updates),
                    "client-drift": drift,
                    "update-norm": norm,
                    "relative-drift": drift / norm if norm > 0 else math.nan,
                }
            )
        return pd.DataFrame(rows)


# --------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> None:
    """Run every missing run of the chosen grid."""
    torch.set_num_threads(1)
    cells = _cells(args)
    for n, (dataset, rank, steps, seed, method) in enumerate(cells, 1):
        target = _cell_dir(args.runs, dataset, steps, rank) / f"{method}-seed{seed}"
        if _finished(target, args.rounds):
            continue
        started, cpu = time.perf_counter(), time.process_time()
        # A scratch directory per run: several processes may share a cell.
        scratch = target.parent / f"tmp-{target.name}"
        config = {
            **cell_config(dataset, steps, rank, method, seed),
            "num-server-rounds": args.rounds,
            "eval-every": args.rounds,  # only the final model is scored
            "output-dir": str(scratch),
        }
        recorder = DriftRecorder(config)
        out = run_in_process(config, reply_hook=recorder)
        recorder.rounds().to_csv(out / "drift-rounds.csv", index=False)
        if target.exists():
            shutil.rmtree(target)
        out.rename(target)
        shutil.rmtree(scratch, ignore_errors=True)
        print(
            f"[{n}/{len(cells)}] {target.relative_to(args.runs)}: "
            f"{time.perf_counter() - started:.0f} s wall, "
            f"{time.process_time() - cpu:.0f} s CPU",
            file=sys.stderr,
            flush=True,
        )


def plan(args: argparse.Namespace) -> None:
    """Print the runs still missing and their estimated CPU hours."""
    cells = _cells(args)
    todo = [
        c
        for c in cells
        if not _finished(
            _cell_dir(args.runs, c[0], c[2], c[1]) / f"{c[4]}-seed{c[3]}", args.rounds
        )
    ]
    seconds = sum(estimate_seconds(c[0], c[2], args.rounds) for c in todo)
    print(
        f"{len(todo)} of {len(cells)} runs to go, about {seconds / 3600:.1f} "
        f"CPU-hours ({args.rounds} rounds)"
    )


# ------------------------------------------------------------------- table
def collect(runs: Path) -> pd.DataFrame:
    """One row per finished run: the cell, method, seed, accuracy and diagnostics."""
    rows = []
    for results in sorted(runs.glob("*-steps*-rank*/*-seed*/results.csv")):
        frame = pd.read_csv(results)
        if len(frame) < _rounds_of(results.parent):
            continue
        cell = results.parent.parent.name
        dataset, rest = cell.rsplit("-steps", 1)
        steps, rank = rest.split("-rank")
        method, seed = results.parent.name.rsplit("-seed", 1)
        gap = pd.to_numeric(frame["frobenius-gap"], errors="coerce")
        rel = pd.to_numeric(frame["relative-gap"], errors="coerce")
        row = {
            "dataset": dataset,
            "local-steps": int(steps),
            "rank": int(rank),
            "method": method,
            "seed": int(seed),
            "final-accuracy": float(frame["accuracy"].dropna().iloc[-1]),
            "mean-gap": float(gap.mean()),
            "mean-relative-gap": float(rel.mean()),
            "client-drift": math.nan,
            "relative-drift": math.nan,
            "seconds": float(frame["seconds"].sum()),
        }
        drift = results.parent / "drift-rounds.csv"
        if drift.is_file():
            d = pd.read_csv(drift)
            row["client-drift"] = float(d["client-drift"].mean())
            row["relative-drift"] = float(d["relative-drift"].mean())
        rows.append(row)
    return pd.DataFrame(rows)


def t_interval(diff: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """Half-width of the ``level`` t-interval of the mean of ``diff``, and the mean.

    Returns ``(mean, half_width)``; the half-width is NaN with fewer than
    two values.
    """
    n = len(diff)
    if n == 0:
        return math.nan, math.nan
    mean = float(np.mean(diff))
    if n < 2:
        return mean, math.nan
    se = float(np.std(diff, ddof=1)) / math.sqrt(n)
    return mean, float(stats.t.ppf(0.5 + level / 2, n - 1)) * se


def paired(
    runs: pd.DataFrame, cell: Mapping[str, Any], a: str, b: str
) -> tuple[float, float, int]:
    """Mean of ``accuracy(a) - accuracy(b)`` over the seeds both finished in
    ``cell`` (a mapping of dataset, local-steps, rank), its 95% half-width
    and the number of seeds."""
    mask = np.ones(len(runs), dtype=bool)
    for key, value in cell.items():
        mask &= (runs[key] == value).to_numpy()
    here = runs[mask]
    acc = {
        m: here[here["method"] == m].set_index("seed")["final-accuracy"] for m in (a, b)
    }
    seeds = sorted(set(acc[a].index) & set(acc[b].index))
    mean, half = t_interval((acc[a][seeds] - acc[b][seeds]).to_numpy())
    return mean, half, len(seeds)


def summarise(runs: pd.DataFrame) -> pd.DataFrame:
    """Mean ± std over seeds per cell and method, and the paired difference to FedIT.

    ``diff-mean`` and ``diff-ci95`` (half-width of the 95% t-interval) are
    over the seeds both the method and FedIT finished:
    accuracy(method, seed) - accuracy(fedavg-lora, seed). The diagnostics
    are means over seeds of each run's mean over rounds.
    """
    keys = ["dataset", "local-steps", "rank"]
    methods = [*METHODS, *sorted(set(runs["method"]) - set(METHODS))]
    out = []
    for cell, group in runs.groupby(keys, sort=True):
        where = dict(zip(keys, cell, strict=True))
        for method in methods:
            mine = group[group["method"] == method].set_index("seed")
            if mine.empty:
                continue
            acc = mine["final-accuracy"]
            mean, half, n = paired(group, where, method, BASELINE)
            if method == BASELINE:
                mean = half = math.nan
            out.append(
                {
                    **where,
                    "method": method,
                    "seeds": len(acc),
                    "paired": n,
                    "accuracy-mean": float(acc.mean()),
                    "accuracy-std": float(acc.std(ddof=1)) if len(acc) > 1 else 0.0,
                    "diff-mean": mean,
                    "diff-ci95": half,
                    "client-drift": float(mine["client-drift"].mean()),
                    "relative-drift": float(mine["relative-drift"].mean()),
                    "mean-gap": float(mine["mean-gap"].mean()),
                    "mean-relative-gap": float(mine["mean-relative-gap"].mean()),
                }
            )
    return pd.DataFrame(out)


def to_markdown(summary: pd.DataFrame) -> str:
    """The summary as a markdown table."""
    lines = [
        "| data set | local steps | rank | method | seeds | final accuracy "
        "| vs FedIT (paired, 95% CI) | client drift | relative drift "
        "| Frobenius gap | relative gap |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary.to_dict("records"):
        if row["method"] == BASELINE or pd.isna(row["diff-mean"]):
            diff = "—"
        elif pd.isna(row["diff-ci95"]):
            diff = f"{row['diff-mean']:+.4f}"
        else:
            diff = f"{row['diff-mean']:+.4f} ± {row['diff-ci95']:.4f}"
        lines.append(
            f"| {row['dataset']} | {row['local-steps']} | {row['rank']} "
            f"| {row['method']} | {row['seeds']} "
            f"| {row['accuracy-mean']:.4f} ± {row['accuracy-std']:.4f} | {diff} "
            f"| {row['client-drift']:.3g} | {row['relative-drift']:.3g} "
            f"| {row['mean-gap']:.3g} | {row['mean-relative-gap']:.3g} |"
        )
    return "\n".join(lines) + "\n"


def paired_markdown(summary: pd.DataFrame) -> str:
    """One row per cell: FedIT's accuracy, then each method's paired
    difference to it with its 95% interval, in points (a wide view of
    :func:`to_markdown`). A difference whose interval excludes 0 is bold."""
    others = _compared(summary)
    lines = [
        "| data set | local steps | FedIT accuracy | "
        + " | ".join(f"{m} − FedIT" for m in others)
        + " |",
        "|---|---|---|" + "---|" * len(others),
    ]
    for (dataset, steps), cell in summary.groupby(["dataset", "local-steps"]):
        rows = cell.set_index("method")
        base = rows.loc[BASELINE] if BASELINE in rows.index else None
        if base is None:
            acc = "—"
        elif base["seeds"] == 1:
            acc = f"{base['accuracy-mean']:.4f}"
        else:
            acc = f"{base['accuracy-mean']:.4f} ± {base['accuracy-std']:.4f}"
        cells = []
        for method in others:
            if method not in rows.index or pd.isna(rows.loc[method, "diff-mean"]):
                cells.append("—")
                continue
            cells.append(
                _points(rows.loc[method, "diff-mean"], rows.loc[method, "diff-ci95"])
            )
        lines.append(f"| {dataset} | {steps} | {acc} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _compared(frame: pd.DataFrame) -> list[str]:
    """The methods of ``frame`` other than FedIT, in :data:`METHODS` then
    :data:`VARIANTS` order."""
    present = set(frame["method"]) - {BASELINE}
    return [m for m in (*METHODS, *VARIANTS) if m in present]


def _points(diff: float, half: float) -> str:
    """A difference in points with its 95% half-width; bold when 0 is outside."""
    mean = 100 * float(diff)
    if pd.isna(half):
        return f"{mean:+.1f}".replace("-", "−")
    text = f"{mean:+.1f} ± {100 * float(half):.1f}".replace("-", "−")
    return f"**{text}**" if abs(mean) > 100 * float(half) else text


MECHANISM = (
    ("fedex-half", BASELINE, "half fold − FedIT"),
    ("fedex-lora", BASELINE, "full fold − FedIT"),
    ("fedex-lora", "fedex-half", "full − half fold"),
    ("flora", "fedex-lora", "FLoRA − FedEx"),
)
"""The mechanism's paired contrasts ``(method, against, heading)``. FedIT,
``fedex-half`` and FedEx-LoRA start each round from the same adapters (the
mean factors) and fold 0, 1/2 and all of the residual into ``W0``; FLoRA
folds all of the mean product and restarts the adapters (``B = 0``, a fresh
``A``), so FLoRA − FedEx changes the adapters at the same exact model."""


def mechanism_markdown(runs: pd.DataFrame) -> str:
    """The mechanism table: per cell, the :data:`MECHANISM` contrasts in points
    (paired, 95% interval; bold where it excludes 0), FedEx's folded residual
    against the mean client product (its relative gap) and the client drift."""
    lines = [
        "| data set | local steps | "
        + " | ".join(h for *_, h in MECHANISM)
        + " | FedEx residual / mean product | client drift |",
        "|---|---|" + "---|" * (len(MECHANISM) + 2),
    ]
    for (dataset, steps, rank), cell in runs.groupby(
        ["dataset", "local-steps", "rank"]
    ):
        where = {"dataset": dataset, "local-steps": steps, "rank": rank}
        cells = []
        for a, b, _ in MECHANISM:
            mean, half, n = paired(runs, where, a, b)
            cells.append("—" if n == 0 else _points(mean, half))
        fedex = cell[cell["method"] == "fedex-lora"]
        rel = f"{fedex['mean-relative-gap'].mean():.3f}" if len(fedex) else "—"
        drift = f"{cell['client-drift'].mean():.3g}"
        lines.append(
            f"| {dataset} | {steps} | " + " | ".join(cells) + f" | {rel} | {drift} |"
        )
    return "\n".join(lines) + "\n"


def figure(summary: pd.DataFrame, path: Path) -> Figure:
    """Accuracy difference to FedIT against the client drift, a panel per data set.

    A method is a colour, a local-steps level a marker (both in the legends);
    each point is one cell's mean paired difference with its 95% t-interval.
    A panel whose cells have no method but FedIT says so. Returns the
    (closed) figure.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    datasets = sorted(summary["dataset"].unique())
    fig, axes = plt.subplots(
        1, len(datasets), figsize=(6 * len(datasets), 5.4), squeeze=False
    )
    others = summary[summary["method"] != BASELINE]
    methods = _compared(summary)
    colours = {m: f"C{i}" for i, m in enumerate(methods)}
    levels = sorted(int(s) for s in summary["local-steps"].unique())
    markers = dict(zip(levels, "os^Dvp", strict=False))
    for ax, dataset in zip(axes[0], datasets, strict=True):
        part = others[others["dataset"] == dataset]
        for method, rows in part.groupby("method"):
            rows = rows.sort_values("local-steps")
            colour = colours[str(method)]
            # a method's levels joined in the order of their local steps
            ax.plot(rows["client-drift"], rows["diff-mean"], color=colour, alpha=0.35)
            for steps, cell in rows.groupby("local-steps"):
                ax.errorbar(
                    cell["client-drift"],
                    cell["diff-mean"],
                    yerr=cell["diff-ci95"].fillna(0.0),
                    fmt=markers.get(int(steps), "x"),
                    color=colour,
                    capsize=3,
                )
        ax.axhline(0.0, color="0.5", lw=0.8)
        ax.set_title(dataset)
        ax.set_xlabel("client drift (mean over rounds, product space)")
        ax.set_ylabel("final accuracy - FedIT's (paired, 95% CI)")
        if part.empty:
            ax.text(
                0.5,
                0.5,
                "only FedIT has finished here",
                ha="center",
                transform=ax.transAxes,
            )
            continue
        drift = part["client-drift"]
        if (drift > 0).all() and drift.max() > 10 * drift.min():
            ax.set_xscale("log")
        present = set(part["method"])
        handles = [
            Line2D([], [], color=colours[m], marker="o", ls="", label=m)
            for m in methods
            if m in present
        ] + [
            Line2D([], [], color="0.3", marker=markers[s], ls="", label=f"{s} steps")
            for s in levels
            if s in set(part["local-steps"])
        ]
        ax.legend(
            handles=handles,
            fontsize=7,
            ncol=4,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.14),
            frameon=False,
        )
    ranks = ", ".join(str(r) for r in sorted(summary["rank"].unique()))
    fig.suptitle(
        f"Paired difference to FedIT: {SETTINGS['num-partitions']} clients, "
        f"Dirichlet {SETTINGS['dirichlet-alpha']}, rank {ranks}, seeds paired",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig


def table(args: argparse.Namespace) -> None:
    """Write drift.csv, summary.csv, summary.md and drift.png."""
    runs = collect(args.runs)
    if runs.empty:
        raise SystemExit(f"no finished runs under {args.runs}")
    args.out.mkdir(parents=True, exist_ok=True)
    runs.to_csv(args.out / "drift.csv", index=False)
    summary = summarise(runs)
    summary.to_csv(args.out / "summary.csv", index=False)
    (args.out / "summary.md").write_text(to_markdown(summary))
    (args.out / "paired.md").write_text(paired_markdown(summary))
    (args.out / "mechanism.md").write_text(mechanism_markdown(runs))
    figure(summary, args.out / "drift.png")
    print(to_markdown(summary))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _names(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (
        ("run", "run the missing runs"),
        ("plan", "the missing runs and their estimated CPU time"),
    ):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--datasets", type=_names, default=list(DATASETS))
        p.add_argument("--ranks", type=_ints, default=list(RANKS))
        p.add_argument("--steps", type=_ints, default=list(STEPS))
        p.add_argument("--seeds", type=_ints, default=list(SEEDS))
        p.add_argument("--methods", type=_names, default=list(METHODS))
        p.add_argument("--runs", type=Path, default=RUNS)
        p.add_argument("--rounds", type=int, default=int(SETTINGS["num-server-rounds"]))
    p_seeds = sub.add_parser("seeds", help="seeds valid on every data set")
    p_seeds.add_argument("--datasets", type=_names, default=list(DATASETS))
    p_seeds.add_argument("--count", type=int, default=len(SEEDS))
    p_table = sub.add_parser("table", help="tabulate and plot finished runs")
    p_table.add_argument("--runs", type=Path, default=RUNS)
    p_table.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.command == "run":
        with quiet_in_process():
            run(args)
    elif args.command == "plan":
        plan(args)
    elif args.command == "seeds":
        print(valid_seeds(args.datasets)[: args.count])
    else:
        table(args)


if __name__ == "__main__":
    main()
