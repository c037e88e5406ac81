"""Central against distributed client-level DP at the same epsilon, table.

``python -m benchmarks.distributed_dp --out DIR [--seeds 0] [--rounds 6]
[--clip C] [--epsilon 8] [--delta 1e-5] [--runs RUNS]``

The private-regime task (``benchmarks/conf/privacy.toml`` without its
``dp-*`` keys: MiniLM, polarity, 4 clients Dirichlet 0.5, 5 local steps,
lr 0.003 decaying by 0.85, rank 8) with ``method = fedavg-lora``, run in
process (:func:`fedlr.launch.local.run_in_process`, the same round path
as ``flwr run``). Per seed, with one node dropping every round in every run
(partition ``(round - 1) mod 4``; under SecAgg+ after its keys, at the
masked-vector stage, so the sum has ``k = 3`` survivors, SecAgg+'s threshold
``t`` for 4 nodes):

1. a run without DP; its first round's update norms ``||x_i - x||`` (the sent
   arrays minus the global ones) give the clip ``C`` (their median, to two
   significant figures) unless ``--clip`` sets it, and its replies the number
   ``d`` of entries a node sends;
2. ``z_central``: the noise multiplier whose PRV epsilon (Opacus, over
   ``(z, m / N = 4 / 4, 1)`` per round, :func:`fedlr.privacy.accounting.epsilon`)
   reaches the target after the run's rounds, and ``z_distributed``: the one
   whose Skellam RDP bound (:mod:`fedlr.privacy.distributed_dp`, ``q = 1``,
   ``d`` entries, step ``s = 2c / T``, ``k = t = 3``) does; both by bisection
   on the accountants, to 0.1 %;
3. central client-level DP at ``z_central`` and distributed DP under SecAgg+
   at ``z_distributed`` (``secagg-clipping-range c`` = twice the
   ``C + 12`` node-noise stds the configuration requires, rounded up).

Per run: the final ``client-dp-epsilon`` of ``results.csv``, the final
accuracy, bytes up and seconds per round (means over rounds), and the noise
std on the published mean that the mechanism reported for the round
(``client-dp-noise-std``: the strategy's and the SecAgg+ exchange's round
metric; ``results.csv`` has no column for it, so it is read off the return
values of :func:`fedlr.privacy.client_dp.privatize` and
:func:`fedlr.privacy.distributed_dp.publish` while the runs go).

Writes ``DIR/table.md`` (with ``C``, the norms, ``d``, both ``z`` and ``c``
under the table) and ``DIR/table.csv``, and prints them. The run
directories (checkpoints, arrays) go under ``--runs`` (default: a
temporary directory, removed at the end).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd

CONF = Path(__file__).parent / "conf" / "privacy.toml"
METHOD = "fedavg-lora"
NODES = 4
THRESHOLD = 3
"""SecAgg+'s reconstruction threshold for 4 nodes (above half: 3)."""
SURVIVORS = 3
"""Nodes in each round's sum: one of 4 drops."""
QUANTIZATION = 2**22
"""``secagg-quantization-range`` (fedlr's default ``T``)."""
RANGE_MARGIN = 2.0
"""``secagg-clipping-range`` = this times the smallest one allowed."""
MODES = ("no DP", "central", "distributed")


def task_config(rounds: int, seed: int) -> dict[str, Any]:
    """``benchmarks/conf/privacy.toml`` without ``dp-*``, as fedavg-lora."""
    with CONF.open("rb") as handle:
        conf = tomllib.load(handle)
    config = {k: v for k, v in conf.items() if not k.startswith("dp-")}
    config.update({"method": METHOD, "num-server-rounds": rounds, "seed": seed})
    return config


# ------------------------------------------------------------ the dropping
class DropOne:
    """Reply hook: loses partition ``(round - 1) mod 4``'s train reply every
    round (under SecAgg+ its masked vector, after its keys), and records the
    first round's update norms and the entries a reply carries."""

    def __init__(self, secure: bool) -> None:
        self.secure = secure
        self.norms: dict[int, list[float]] = {}
        self.entries = 0
        self.dropped: list[tuple[int, int]] = []

    def __call__(self, partition: int, instruction: Any, reply: Any) -> Any:
        from flwr.common.secure_aggregation.secaggplus_constants import (
            RECORD_KEY_CONFIGS,
            Key,
        )

        from fedlr.wire import protocol

        if not reply.has_content() or not str(
            instruction.metadata.message_type
        ).startswith("train"):
            return reply
        configs = instruction.content.config_records
        if protocol.CONFIG not in configs:
            return reply
        server_round = int(configs[protocol.CONFIG][protocol.SERVER_ROUND])
        records = reply.content.config_records
        if self.secure:
            last_stage = RECORD_KEY_CONFIGS in records and (
                Key.MASKED_PARAMETERS in records[RECORD_KEY_CONFIGS]
            )
        else:
            last_stage = protocol.ARRAYS in reply.content.array_records
            if last_stage:
                self._measure(server_round, instruction, reply)
        if last_stage and partition == (server_round - 1) % NODES:
            self.dropped.append((server_round, partition))
            return None
        return reply

    def _measure(self, server_round: int, instruction: Any, reply: Any) -> None:
        from fedlr.flower.records import record_to_state
        from fedlr.wire import protocol

        sent = record_to_state(reply.content.array_records[protocol.ARRAYS])
        base_record = instruction.content.array_records.get(protocol.ARRAYS)
        base = record_to_state(base_record) if base_record is not None else {}
        squares = 0.0
        for key, value in sent.items():
            update = value.double()
            if key in base and base[key].shape == value.shape:
                update = update - base[key].double()
            squares += float(update.square().sum())
        self.entries = max(self.entries, sum(int(v.numel()) for v in sent.values()))
        self.norms.setdefault(server_round, []).append(math.sqrt(squares))


@contextlib.contextmanager
def noise_reports() -> Iterator[list[float]]:
    """Collect the ``client-dp-noise-std`` each round's mechanism returns."""
    from fedlr.privacy import client_dp, distributed_dp

    seen: list[float] = []
    originals: dict[tuple[Any, str], Callable[..., Any]] = {
        (client_dp, "privatize"): client_dp.privatize,
        (distributed_dp, "publish"): distributed_dp.publish,
    }

    def watch(function: Callable[..., Any]) -> Callable[..., Any]:
        def watched(*args: Any, **kwargs: Any) -> Any:
            out, metrics = function(*args, **kwargs)
            seen.append(float(metrics["client-dp-noise-std"]))
            return out, metrics

        return watched

    for (module, name), function in originals.items():
        setattr(module, name, watch(function))
    try:
        yield seen
    finally:
        for (module, name), function in originals.items():
            setattr(module, name, function)


# ------------------------------------------------------------ calibration
def bisect(eps_of: Callable[[float], float], target: float) -> float:
    """The smallest ``z`` (to 0.1 %) with ``eps_of(z) <= target``."""
    low, high = 0.05, 1.0
    while eps_of(high) > target:
        low, high = high, 2.0 * high
    while eps_of(low) <= target and low > 1e-3:
        low /= 2.0
    while high - low > 1e-3 * high:
        middle = 0.5 * (low + high)
        if eps_of(middle) <= target:
            high = middle
        else:
            low = middle
    return high


def central_epsilon(z: float, rounds: int, delta: float) -> float:
    """PRV epsilon of ``rounds`` releases ``(z, 4 / 4, 1)``, as the ledger."""
    from fedlr.privacy.accounting import epsilon

    return epsilon([(z, 1.0, 1)] * rounds, delta, "prv")


def distributed_epsilon(
    z: float, rounds: int, delta: float, clip: float, step: float, dim: int
) -> float:
    """The Skellam bound of ``rounds`` rounds of ``k = t = 3`` survivors."""
    from fedlr.privacy import distributed_dp as ddp

    mu = ddp.client_mu(z, clip, step, THRESHOLD)
    l2, l1 = ddp.sensitivities(clip, step, dim)
    return ddp.skellam_epsilon([(2.0 * SURVIVORS * mu, l2, l1)] * rounds, delta)


def clipping_range(clip: float, z: float) -> float:
    """Twice the smallest range :func:`~fedlr.privacy.distributed_dp.check_range`
    accepts, rounded up to two significant figures."""
    from fedlr.privacy.distributed_dp import RANGE_SIGMAS

    need = RANGE_MARGIN * (clip + RANGE_SIGMAS * z * clip / math.sqrt(THRESHOLD))
    scale = 10.0 ** (math.floor(math.log10(need)) - 1)
    return math.ceil(need / scale) * scale


def calibrate(
    clip: float, rounds: int, target: float, delta: float, dim: int
) -> dict[str, float]:
    """``z_central``, ``z_distributed`` and the range ``c`` (the range sets
    the step, the step the bound: iterated until ``c`` stops moving)."""
    z_central = bisect(lambda z: central_epsilon(z, rounds, delta), target)
    c = clipping_range(clip, z_central)
    for _ in range(10):
        step = 2.0 * c / QUANTIZATION

        def eps_of(z: float, s: float = step) -> float:
            return distributed_epsilon(z, rounds, delta, clip, s, dim)

        z_dist = bisect(eps_of, target)
        new = clipping_range(clip, z_dist)
        if new == c:
            break
        c = new
    step = 2.0 * c / QUANTIZATION
    return {
        "z-central": z_central,
        "z-distributed": z_dist,
        "secagg-clipping-range": c,
        "step": step,
        "epsilon-central": central_epsilon(z_central, rounds, delta),
        "epsilon-distributed": distributed_epsilon(
            z_dist, rounds, delta, clip, step, dim
        ),
    }


# ------------------------------------------------------------ the runs
def run_one(
    mode: str, base: dict[str, Any], privacy: dict[str, Any], runs: Path
) -> dict[str, Any]:
    """One run of ``mode``; its row of the table."""
    from fedlr.launch.local import run_in_process

    config = {**base, "output-dir": str(runs / mode.replace(" ", "-"))}
    if mode == "central":
        config.update(privacy["central"])
    elif mode == "distributed":
        config.update(privacy["distributed"])
    hook = DropOne(secure=mode == "distributed")
    started = time.perf_counter()
    with noise_reports() as noise:
        run_dir = run_in_process(config, reply_hook=hook)
    wall = time.perf_counter() - started
    results = pd.read_csv(run_dir / "results.csv")
    eps = pd.to_numeric(results.get("client-dp-epsilon"), errors="coerce")
    return {
        "mode": mode,
        "seed": int(base["seed"]),
        "z": config.get("client-dp-noise-multiplier", math.nan),
        "epsilon": float(eps.iloc[-1]) if eps is not None else math.nan,
        "final-accuracy": float(results["accuracy"].iloc[-1]),
        "bytes-up-per-round": float(results["bytes-up"].mean()),
        "seconds-per-round": float(results["seconds"].mean()),
        "noise-std": noise[-1] if noise else math.nan,
        "dropped-per-round": float(results["dropped"].mean())
        if "dropped" in results
        else math.nan,
        "rounds": len(results),
        "wall-seconds": wall,
        "_hook": hook,
    }


def to_markdown(rows: pd.DataFrame, choice: dict[str, Any]) -> str:
    head = [
        "mechanism",
        "seed",
        "z",
        "ε reported (δ = {:g})".format(choice["delta"]),
        "final accuracy",
        "bytes up / round",
        "s / round",
        "noise std on the mean",
    ]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for _, r in rows.iterrows():
        cells = [
            str(r["mode"]),
            str(r["seed"]),
            "—" if math.isnan(r["z"]) else f"{r['z']:.4f}",
            "—" if math.isnan(r["epsilon"]) else f"{r['epsilon']:.3f}",
            f"{r['final-accuracy']:.4f}",
            f"{r['bytes-up-per-round']:,.0f}",
            f"{r['seconds-per-round']:.1f}",
            "—" if math.isnan(r["noise-std"]) else f"{r['noise-std']:.4g}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    norms = ", ".join(f"{n:.4g}" for n in choice["round1-norms"])
    lines += [
        "",
        f"C = {choice['clip']:g} ({choice['clip-source']}; round-1 update norms "
        f"without DP: {norms}); target ε = {choice['target-epsilon']:g} after "
        f"{choice['rounds']} rounds at δ = {choice['delta']:g}; d = "
        f"{choice['entries']:,} entries sent per node; secagg-clipping-range "
        f"c = {choice['secagg-clipping-range']:g}, step 2c/T = "
        f"{choice['step']:.3g} (T = 2^22); SecAgg+ threshold t = {THRESHOLD}, "
        f"k = {SURVIVORS} survivors of {NODES} every round. Accountant ε at the "
        f"chosen z: central (PRV, q = 1) {choice['epsilon-central']:.3f}, "
        f"distributed (Skellam RDP, q = 1) {choice['epsilon-distributed']:.3f}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", default="0", help="comma-separated")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--runs", type=Path, default=None)
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        runs = args.runs or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="ddp-"))
        )
        rows: list[dict[str, Any]] = []
        choice: dict[str, Any] = {}
        for seed in seeds:
            base = task_config(args.rounds, seed)
            here = runs / f"seed{seed}"
            baseline = run_one("no DP", base, {}, here)
            hook = baseline.pop("_hook")
            norms = sorted(hook.norms.get(1, []))
            if not choice:  # C, d and z from the first seed's baseline
                if args.clip is not None:
                    clip, source = args.clip, "--clip"
                else:
                    median = statistics.median(norms)
                    digits = 1 - math.floor(math.log10(median))
                    clip, source = round(median, digits), "median round-1 norm"
                choice = {
                    "clip": clip,
                    "clip-source": source,
                    "round1-norms": norms,
                    "entries": hook.entries,
                    "target-epsilon": args.epsilon,
                    "delta": args.delta,
                    "rounds": args.rounds,
                    **calibrate(
                        clip, args.rounds, args.epsilon, args.delta, hook.entries
                    ),
                }
                print(json.dumps(choice, indent=2), flush=True)
            clip = choice["clip"]
            common = {
                "client-dp-clip": clip,
                "client-dp-delta": args.delta,
            }
            privacy = {
                "central": {
                    **common,
                    "client-dp-noise-multiplier": choice["z-central"],
                },
                "distributed": {
                    **common,
                    "client-dp-noise-multiplier": choice["z-distributed"],
                    "secure-aggregation": True,
                    "secagg-clipping-range": choice["secagg-clipping-range"],
                },
            }
            rows.append(baseline)
            for mode in MODES[1:]:
                row = run_one(mode, base, privacy, here)
                row.pop("_hook")
                rows.append(row)
                print(
                    f"{mode} seed {seed}: acc {row['final-accuracy']:.4f} "
                    f"eps {row['epsilon']:.3f}",
                    flush=True,
                )
    frame = pd.DataFrame(rows)
    frame.to_csv(args.out / "table.csv", index=False)
    text = to_markdown(frame, choice)
    (args.out / "table.md").write_text(text)
    print(frame.to_csv(index=False))
    print(text)


if __name__ == "__main__":
    main()
