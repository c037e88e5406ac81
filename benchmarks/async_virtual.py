"""Asynchronous runs on the virtual clock (docs/results/async).

Both parts run in process, polarity with IID partitions, each node's speed
from a trace generated with a 10x spread
(:func:`fedlr.flower.virtual_clock.generated_trace`):

``scale``
    100 simulated nodes, all busy, FedBuff-LoRA (K = 10) on the tiny BERT
    with one local step: prints the real seconds the run took and the
    virtual seconds it simulated (the acceptance bar: under 2 minutes of
    real time on 2 CPU cores).
``compare``
    Async vs sync on one heterogeneous-speed trace of ``--compare-nodes``
    nodes, MiniLM (the default task's model; the tiny BERT is random and does
    not learn polarity), the same number of client trainings each:
    FedAvg-LoRA (every node every round; a round lasts as long as its slowest
    node's job on the same trace), FedBuff-LoRA (K = half the nodes) and
    FedAsync-LoRA (every node busy, paper defaults). Writes
    ``docs/results/async/async-vs-sync.csv`` (per method: virtual seconds to
    the target accuracy, final accuracy, client trainings, staleness
    quantiles), ``staleness.csv`` (the histogram), ``curves.csv`` and
    ``async-vs-sync.png`` (accuracy against virtual time; the staleness
    histograms).

Run: ``python -m benchmarks.async_virtual [scale|compare|all]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from fedlr.flower.virtual_clock import generated_trace
from fedlr.launch.local import run_in_process

OUT = Path(__file__).resolve().parents[1] / "docs" / "results" / "async"
SPREAD = 10.0


def tiny(output_dir: str, **overrides: Any) -> dict[str, Any]:
    """The tiny BERT on polarity, IID partitions, cheap rounds."""
    config: dict[str, Any] = {
        "model": "tiny-bert",
        "dataset": "polarity",
        "partitioner": "iid",
        "local-steps": 1,
        "batch-size": 8,
        "max-length": 32,
        "lora-rank": 4,
        "lora-alpha": 8.0,
        "lr": 0.01,
        "max-eval-examples": 128,
        "device": "cpu",
        "speed-spread": SPREAD,
        "output-dir": output_dir,
    }
    config.update(overrides)
    return config


def scale(nodes: int, versions: int, seed: int) -> dict[str, float]:
    """The 100-node run: real and virtual seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        run_dir = run_in_process(
            tiny(
                tmp,
                method="fedbuff-lora",
                **{
                    "num-partitions": nodes,
                    "num-server-rounds": versions,
                    "buffer-size": 10,
                    "eval-every": versions,
                    "seed": seed,
                },
            )
        )
        real = time.perf_counter() - started
        frame = pd.read_csv(run_dir / "results.csv")
        updates = pd.read_csv(run_dir / "updates.csv")
    result = {
        "nodes": float(nodes),
        "versions": float(len(frame)),
        "applied-updates": float((updates["event"] == "applied").sum()),
        "real-seconds": real,
        "virtual-seconds": float(frame["virtual-time"].iloc[-1]),
        "final-accuracy": float(frame["accuracy"].iloc[-1]),
        "staleness-max": float(updates["staleness"].max()),
    }
    print(
        f"scale: {nodes} nodes (speed spread {SPREAD:g}x), {len(frame)} versions, "
        f"{int(result['applied-updates'])} updates applied: "
        f"{real:.1f} s real, {result['virtual-seconds']:.1f} s virtual"
    )
    return result


def sync_virtual_times(run_dir: Path, nodes: int, seed: int, steps: int) -> list[float]:
    """A synchronous run's virtual time after each round: every node trains
    every round, so a round lasts as long as the slowest node's job."""
    speeds = generated_trace(nodes, spread=SPREAD, seed=seed)
    frame = pd.read_csv(run_dir / "results.csv")
    times, now = [], 0.0
    for _, row in frame.iterrows():
        per_node = (row["bytes-down"] + row["bytes-up"]) / row["clients"]
        now += max(s.seconds(steps, int(per_node)) for s in speeds.values())
        times.append(now)
    return times


def compare(
    nodes: int,
    trainings: int,
    target: float,
    seed: int,
    steps: int,
    lr: float,
    model: str,
) -> pd.DataFrame:
    """Async vs sync on one trace, about ``trainings`` client trainings each."""
    buffer = max(1, nodes // 2)
    runs = {
        "fedavg-lora": {"num-server-rounds": trainings // nodes},
        "fedbuff-lora": {
            "num-server-rounds": trainings // buffer,
            "buffer-size": buffer,
            "max-staleness": 1000,
        },
        "fedasync-lora": {"num-server-rounds": trainings, "max-staleness": 1000},
    }
    rows: list[dict[str, Any]] = []
    curves: list[pd.DataFrame] = []
    staleness: list[dict[str, Any]] = []
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for method, extra in runs.items():
            rounds = int(extra["num-server-rounds"])
            config = tiny(
                tmp,
                method=method,
                **{
                    "num-partitions": nodes,
                    "local-steps": steps,
                    "lr": lr,
                    "model": model,
                    "max-length": 24,
                    "max-eval-examples": 200,
                    "eval-every": max(1, rounds // 8),
                    "seed": seed,
                    **extra,
                },
            )
            started = time.perf_counter()
            run_dir = run_in_process(config)
            real = time.perf_counter() - started
            frame = pd.read_csv(run_dir / "results.csv")
            if method == "fedavg-lora":
                frame["virtual-time"] = sync_virtual_times(run_dir, nodes, seed, steps)
                applied = pd.Series([0] * int(frame["clients"].sum()))
            else:
                updates = pd.read_csv(run_dir / "updates.csv")
                applied = updates.loc[updates["event"] == "applied", "staleness"]
            evaluated = frame.dropna(subset=["accuracy"])
            reached = evaluated[evaluated["accuracy"] >= target]
            rows.append(
                {
                    "method": method,
                    "nodes": nodes,
                    "speed-spread": SPREAD,
                    "server-versions": len(frame),
                    "client-trainings": len(applied),
                    "target-accuracy": target,
                    "virtual-seconds-to-target": float(reached["virtual-time"].iloc[0])
                    if len(reached)
                    else float("nan"),
                    "virtual-seconds": float(frame["virtual-time"].iloc[-1]),
                    "final-accuracy": float(evaluated["accuracy"].iloc[-1]),
                    "staleness-median": float(applied.median()),
                    "staleness-p90": float(applied.quantile(0.9)),
                    "staleness-max": float(applied.max()),
                    "real-seconds": real,
                }
            )
            curves.append(evaluated[["virtual-time", "accuracy"]].assign(method=method))
            counts = applied.value_counts().sort_index()
            staleness.extend(
                {"method": method, "staleness": int(s), "updates": int(c)}
                for s, c in counts.items()
            )
            print(rows[-1])
    table = pd.DataFrame(rows)
    table.to_csv(OUT / "async-vs-sync.csv", index=False, float_format="%.6g")
    pd.DataFrame(staleness).to_csv(OUT / "staleness.csv", index=False)
    pd.concat(curves).to_csv(OUT / "curves.csv", index=False, float_format="%.6g")
    plot(pd.concat(curves), pd.DataFrame(staleness), target)
    return table


def plot(curves: pd.DataFrame, staleness: pd.DataFrame, target: float) -> None:
    """``async-vs-sync.png``: accuracy against virtual time; staleness histograms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"fedavg-lora": "C0", "fedbuff-lora": "C1", "fedasync-lora": "C2"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for method, frame in curves.groupby("method", sort=False):
        left.plot(
            frame["virtual-time"],
            frame["accuracy"],
            marker="o",
            label=method,
            color=colours.get(str(method)),
        )
    left.axhline(target, color="grey", linestyle=":", label=f"target {target:g}")
    left.set_xlabel("virtual seconds")
    left.set_ylabel("held-out accuracy")
    left.set_title(f"accuracy on the virtual clock ({SPREAD:g}x speed spread)")
    left.legend()
    width = 0.4
    for i, (method, frame) in enumerate(
        staleness[staleness["method"] != "fedavg-lora"].groupby("method", sort=False)
    ):
        right.bar(
            frame["staleness"] + (i - 0.5) * width,
            frame["updates"],
            width=width,
            label=method,
            color=colours.get(str(method)),
        )
    right.set_xlabel("staleness (versions)")
    right.set_ylabel("applied updates")
    right.set_title("staleness of the applied updates")
    right.legend()
    fig.tight_layout()
    fig.savefig(OUT / "async-vs-sync.png", dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "part",
        nargs="?",
        default="all",
        choices=("scale", "compare", "all", "plot"),
        help="plot: redraw the figure from the CSVs in docs/results/async",
    )
    parser.add_argument("--nodes", type=int, default=100, help="scale: simulated nodes")
    parser.add_argument("--versions", type=int, default=50, help="scale: versions")
    parser.add_argument("--compare-nodes", type=int, default=8)
    parser.add_argument("--trainings", type=int, default=96)
    parser.add_argument("--target", type=float, default=0.65)
    parser.add_argument("--local-steps", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.002)
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.part == "plot":
        curves = pd.read_csv(OUT / "curves.csv")
        plot(curves, pd.read_csv(OUT / "staleness.csv"), args.target)
        return
    if args.part in ("scale", "all"):
        scale(args.nodes, args.versions, args.seed)
    if args.part in ("compare", "all"):
        print(
            compare(
                args.compare_nodes,
                args.trainings,
                args.target,
                args.seed,
                args.local_steps,
                args.lr,
                args.model,
            )
        )


if __name__ == "__main__":
    main()
