"""Can a rule tell the attacker by its update's direction? The default task's geometry.

``python -m benchmarks.update_geometry [--seeds 1,4] [--rounds 6] [--out DIR]``

A clean federation of the default task (five clients, as in
``benchmarks/robustness.py``); in every round, in the method's update space
(:class:`~fedlr.robust.spaces.ProductSpace`), from the replies' Gram matrix:

* each honest client's *median cosine* with the other replies of the round,
  with the attack of ``benchmarks.robustness`` in the last partition's place
  (the negated weighted mean of the four honest updates): what a rule that
  screens directions (FoolsGold, cosine outlier screens, the medians) sees;
* the attacker's median cosine with the four honest updates;
* every update's cosine with a *server reference update*: the round's
  instruction trained by the server itself for the same local steps, lr and
  batch size on the held-out check's validation examples (FLTrust's trust
  reference, Cao et al., NDSS 2021), and the weighted mean's.

Writes ``DIR/geometry.jsonl`` (a row per seed and round) and prints a summary
per seed: the rounds in which some honest client looks more opposed to the
others than the attacker does, and the range of the reference cosines.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from flwr.app import Message, MetricRecord

from benchmarks.robustness import (
    NUM_CLIENTS,
    _delta,
    _pairs,
    _state,
    _update,
    train_replies,
)
from fedlr.adapters import Role
from fedlr.client.train import TrainSettings, train_steps
from fedlr.flower.records import config_float, config_int
from fedlr.launch.local import run_in_process
from fedlr.robust.spaces import ProductSpace
from fedlr.strategies.registry import resolve
from fedlr.tasks.text import text_task
from fedlr.wire import protocol

ROLES = (Role.LORA_A, Role.LORA_B, Role.HEAD)


def cosines(gram: torch.Tensor) -> torch.Tensor:
    """The cosine matrix of a Gram matrix (float64)."""
    norm = torch.diagonal(gram).clamp_min(0.0).sqrt()
    return gram / (norm[:, None] * norm[None, :]).clamp_min(1e-300)


def median_cosines(cos: torch.Tensor, members: Sequence[int]) -> list[float]:
    """Each member's median cosine with the other members."""
    return [
        statistics.median(float(cos[i, j]) for j in members if j != i) for i in members
    ]


def round_geometry(
    gram: torch.Tensor, honest: Sequence[int], attack: int, reference: int, mean: int
) -> dict[str, Any]:
    """The round's statistics from the Gram matrix of its vectors.

    Parameters
    ----------
    gram : torch.Tensor
        Gram matrix of every vector: the honest updates (``honest``), the
        attack (``attack``), the server's reference (``reference``) and the
        honest weighted mean (``mean``), by index.
    """
    cos = cosines(gram)
    attacked = [*honest, attack]
    med = median_cosines(cos, attacked)
    return {
        "honest-median-cos": [round(c, 4) for c in med[:-1]],
        "attacker-median-cos": round(med[-1], 4),
        "lowest-honest-below-attacker": min(med[:-1]) < med[-1],
        "reference-cos": [round(float(cos[i, reference]), 4) for i in honest],
        "mean-reference-cos": round(float(cos[mean, reference]), 4),
        "clean-median-cos": [round(c, 4) for c in median_cosines(cos, list(honest))],
    }


def _count(metrics: MetricRecord) -> float:
    value = metrics[protocol.NUM_EXAMPLES]
    if not isinstance(value, int | float):
        raise TypeError(f"num-examples is {value!r}")
    return float(value)


class Geometry:
    """The round hook: records :func:`round_geometry`, changes no reply."""

    def __init__(self, config: dict[str, Any]) -> None:
        method = resolve({**config, "heldout-check": True})
        task = text_task(method.run)
        self.examples = task.check_examples()
        self.model = task.build_lora_model()
        self.rows: list[dict[str, Any]] = []

    def reference(
        self, instruction: Message, keys: list[str]
    ) -> dict[str, torch.Tensor]:
        """The instruction trained by the server on its validation examples."""
        config = instruction.content.config_records[protocol.CONFIG]
        self.model.load(_state(instruction))
        self.model.train_only(ROLES)
        settings = TrainSettings(
            local_steps=config_int(config, protocol.LOCAL_STEPS),
            lr=config_float(config, protocol.LR),
            batch_size=config_int(config, protocol.BATCH_SIZE),
        )
        train_steps(
            self.model.model,
            self.examples,
            settings,
            seed=config_int(config, protocol.SERVER_ROUND),
            device=torch.device("cpu"),
        )
        state = self.model.state(ROLES)
        return {k: state[k] for k in keys}

    def __call__(
        self, round_: list[tuple[int, Message, Message]]
    ) -> list[Message | None]:
        train = train_replies(round_)
        if len(train) == NUM_CLIENTS:
            sent = _state(train[0][1])
            honest = [(p, rep) for p, _, rep in train if p != NUM_CLIENTS - 1]
            deltas = [_delta(_state(rep), sent) for _, rep in honest]
            counts = [
                _count(rep.content.metric_records[protocol.METRICS])
                for _, rep in honest
            ]
            keys = list(deltas[0])
            mean = {
                k: torch.stack([n * d[k] for n, d in zip(counts, deltas, strict=True)])
                .sum(0)
                .div(sum(counts))
                for k in keys
            }
            reference = _delta(self.reference(train[0][1], keys), sent)
            vectors: list[dict[str, torch.Tensor]] = [
                *deltas,
                {k: -v for k, v in mean.items()},
                reference,
                mean,
            ]
            space = ProductSpace(sent, _pairs(sent))
            gram = space.gram([_update(sent, d) for d in vectors])
            h = len(deltas)
            config = train[0][1].content.config_records[protocol.CONFIG]
            self.rows.append(
                {
                    "round": config_int(config, protocol.SERVER_ROUND),
                    "partitions": [p for p, _ in honest],
                    "examples": counts,
                    **round_geometry(gram, list(range(h)), h, h + 1, h + 2),
                }
            )
        return [rep for _, _, rep in round_]


def summary(rows: list[dict[str, Any]]) -> str:
    """One line per seed."""
    lines = []
    for seed in sorted({r["seed"] for r in rows}):
        mine = [r for r in rows if r["seed"] == seed]
        lowest = [min(r["honest-median-cos"]) for r in mine]
        attacker = [r["attacker-median-cos"] for r in mine]
        ref = [c for r in mine for c in r["reference-cos"]]
        mean_ref = [r["mean-reference-cos"] for r in mine]
        below = sum(r["lowest-honest-below-attacker"] for r in mine)
        lines.append(
            f"seed {seed}: {below} of {len(mine)} rounds with an honest client "
            f"more opposed than the attacker (lowest honest median cosine "
            f"{min(lowest):.2f} to {max(lowest):.2f}, attacker's "
            f"{min(attacker):.2f} to {max(attacker):.2f}); cosine with the "
            f"server's reference: honest updates {min(ref):.2f} to "
            f"{max(ref):.2f} ({sum(c < 0 for c in ref)} of {len(ref)} "
            f"negative), their mean {min(mean_ref):.2f} to {max(mean_ref):.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,4")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path("outputs/update-geometry"))
    parser.add_argument("--max-eval-examples", type=int, default=672)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        config = {
            "num-partitions": NUM_CLIENTS,
            "num-server-rounds": args.rounds,
            "eval-every": args.rounds,
            "output-dir": str(args.out / "runs"),
            "seed": seed,
            "max-eval-examples": args.max_eval_examples,
        }
        hook = Geometry(config)
        run_in_process(config, round_hook=hook)
        rows += [{"seed": seed, **row} for row in hook.rows]
    with (args.out / "geometry.jsonl").open("w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    print(summary(rows))


if __name__ == "__main__":
    main()
