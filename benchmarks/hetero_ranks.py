"""Heterogeneous client ranks on the default text task (docs/results/hetero-ranks).

Four clients train LoRA ranks 2, 4, 8 and 16 (``client-ranks="2,4,8,16"``) on
the default run (MiniLM on polarity, Dirichlet 0.5), in process, for
``flexlora``, ``hetlora``, ``flora``, ``fedspec`` and ``fedex-lora``. Prints
and writes
``docs/results/hetero-ranks/hetero-ranks.csv``: per method and rank, the
final accuracy (one global model per method), the mean over rounds of the
Frobenius gap of what a client of that rank receives against the mean of the
updates, and the mean bytes down and up per client of that rank per round.

Run: ``python -m benchmarks.hetero_ranks [--rounds N]`` (about 20 s per round
on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import pandas as pd
import torch

from fedlr.launch.local import run_in_process

METHODS = ("flexlora", "hetlora", "flora", "fedspec", "fedex-lora")
RANKS = (2, 4, 8, 16)
OUT = Path(__file__).resolve().parents[1] / "docs" / "results" / "hetero-ranks"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        help="comma-separated; the other methods' rows of the CSV are kept",
    )
    args = parser.parse_args()
    chosen = [m for m in args.methods.split(",") if m]
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in chosen:
            run_dir = run_in_process(
                {
                    "method": method,
                    "client-ranks": ",".join(map(str, RANKS)),
                    "num-server-rounds": args.rounds,
                    "seed": args.seed,
                    "output-dir": tmp,
                }
            )
            frame = pd.read_csv(run_dir / "results.csv")
            for rank in RANKS:
                rows.append(
                    {
                        "method": method,
                        "rank": rank,
                        "final-accuracy": float(frame["accuracy"].iloc[-1]),
                        "mean-gap": float(frame[f"gap-rank-{rank}"].mean()),
                        "bytes-down-per-round": float(
                            frame[f"bytes-down-rank-{rank}"].iloc[1:].mean()
                        ),
                        "bytes-up-per-round": float(
                            frame[f"bytes-up-rank-{rank}"].mean()
                        ),
                    }
                )
    table = pd.DataFrame(rows)
    old = OUT / "hetero-ranks.csv"
    if old.is_file():  # keep the rows of methods not run this time
        kept = pd.read_csv(old)
        table = pd.concat([kept[~kept["method"].isin(chosen)], table])
        order = {m: i for i, m in enumerate(METHODS)}
        table = table.sort_values("method", key=lambda c: c.map(order), kind="stable")
    OUT.mkdir(parents=True, exist_ok=True)
    table.to_csv(OUT / "hetero-ranks.csv", index=False)
    print(table.to_string(index=False))


if __name__ == "__main__":
    main()
