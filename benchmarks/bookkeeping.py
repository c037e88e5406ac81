"""Bookkeeping cost per round late in a run: one results row and checkpoint.

Fills a run directory with ``--rounds`` rounds of ``results.csv`` and
``layers.csv`` rows (``--layers`` layers, as many as a 6-layer BERT with
every linear layer adapted has), then times what the ServerApp does after
each round: append the round's rows, save the round's checkpoint. Prints
the seconds of each and the checkpoint's size. Works on any fedlr version
(checkpoints that carry the row history, as older ones did, are built the
same way the runner builds them).

    python -m benchmarks.bookkeeping --rounds 1000 --layers 168
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from fedlr.runs.checkpoint import get_rng_state, save_checkpoint
from fedlr.runs.results import ResultsWriter


def _row(server_round: int) -> dict[str, float]:
    return {
        "round": server_round,
        "accuracy": 0.5,
        "loss": 0.7,
        "frobenius-gap": 1e-3,
        "relative-gap": 1e-2,
        "bytes-up": 1e6,
        "bytes-down": 2e6,
        "seconds": 1.0,
        "clients": 4,
        "dropped": 0,
        "train-loss": 0.6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=168)
    args = parser.parse_args()
    layers = {f"layer.{i}": (1e-3, 1e-2) for i in range(args.layers)}
    arrays = {"a": torch.zeros(8, 384), "b": torch.zeros(384, 8)}
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        writer = ResultsWriter(run_dir, method="fedex-lora", config={"seed": 0})
        started = time.perf_counter()
        for r in range(1, args.rounds):
            writer.append(_row(r), layers=layers)
        fill = time.perf_counter() - started
        t0 = time.perf_counter()
        writer.append(_row(args.rounds), layers=layers)
        t1 = time.perf_counter()
        payload = {
            "round": args.rounds,
            "arrays": arrays,
            "strategy": {},
            "plan": {},
            "rng": get_rng_state(),
            "extra": {},
            "config": {"method": "fedex-lora"},
        }
        rows = getattr(writer, "rows", None)  # older fedlr: the history too
        if rows is not None:
            payload["results"], payload["layers"] = rows()
        save_checkpoint(run_dir, payload, keep=2)
        t2 = time.perf_counter()
        size = max(p.stat().st_size for p in run_dir.glob("checkpoint-*.pt"))
    print(
        f"round {args.rounds} with {args.layers} layers: append {t1 - t0:.3f} s, "
        f"checkpoint {t2 - t1:.3f} s, total {t2 - t0:.3f} s, checkpoint "
        f"{size / 1e6:.2f} MB (filling {args.rounds - 1} rounds took {fill:.1f} s)"
    )


if __name__ == "__main__":
    main()
