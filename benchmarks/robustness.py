"""Robust aggregation on the default run, with and without one attacker.

``python -m benchmarks.robustness [--out DIR] [--rounds N] [--runs a,b,...]
[--set 'key=value,...']``

The default run (fedex-lora, MiniLM on polarity, 15 rounds) with five clients,
in process (:func:`fedlr.server_apps.local.run_in_process`). The attacker is
partition 0: every round it trains honestly, then sends ``x_ref + 50 (x -
x_ref)`` (its update boosted 50x) and claims ``num-examples = 10**15``.

Runs (each a row of the table written to ``DIR/robustness.md`` and
``DIR/robustness.csv``):

* ``clean-<rule>``: no attacker, ``robust = <rule>`` (the accuracy a rule
  costs without an attack);
* ``attack-capped``: the attacker against the default server, whose
  ``max-num-examples`` (the largest partition) drops its replies;
* ``attack-<rule>``: the attacker with ``max-num-examples`` lifted (its
  claimed 1e15 examples accepted), under each rule.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import pandas as pd
from flwr.app import Message, MetricRecord, RecordDict

from fedlr import protocol
from fedlr.flower.records import record_to_state, state_to_record
from fedlr.server_apps.local import run_in_process

RULES = ("none", "norm-clip", "trimmed-mean", "median")
BOOST = 50.0
CLAIM = 10**15


def boosted_reply(partition: int, instruction: Message, reply: Message) -> Message:
    """Partition 0 boosts its update 50x and claims 1e15 examples."""
    if partition != 0 or reply.has_error():
        return reply
    sent = record_to_state(instruction.content.array_records[protocol.ARRAYS])
    mine = record_to_state(reply.content.array_records[protocol.ARRAYS])
    forged = {}
    for key, x in mine.items():
        ref = sent.get(key)
        base = ref.to(x.dtype) if ref is not None and ref.shape == x.shape else 0
        forged[key] = base + BOOST * (x - base)
    records = dict(reply.content)
    records[protocol.ARRAYS] = state_to_record(forged)
    metrics = dict(reply.content.metric_records[protocol.METRICS])
    metrics[protocol.NUM_EXAMPLES] = CLAIM
    records[protocol.METRICS] = MetricRecord(metrics)
    return Message(RecordDict(records), reply_to=instruction)


def plan(rules: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    runs: dict[str, dict[str, Any]] = {}
    for rule in rules:
        runs[f"clean-{rule}"] = {"robust": rule, "attack": False}
    runs["attack-capped"] = {"robust": "none", "attack": True}
    for rule in rules:
        runs[f"attack-{rule}"] = {
            "robust": rule,
            "attack": True,
            "max-num-examples": 10**18,
        }
    return runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/robustness"))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--runs", default="", help="comma-separated run names")
    parser.add_argument(
        "--set",
        default="",
        help="extra run-config values, 'key=value,key=value' (TOML scalars)",
    )
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs = plan(RULES)
    chosen = [r for r in args.runs.split(",") if r] or list(runs)
    rows = []
    done = out / "runs.jsonl"
    finished = {}
    if done.exists():
        for line in done.read_text().splitlines():
            row = json.loads(line)
            finished[row["run"]] = row
    for name in chosen:
        if name in finished:
            rows.append(finished[name])
            continue
        spec = dict(runs[name])
        attacked = spec.pop("attack")
        config = {
            "num-partitions": 5,
            "num-server-rounds": args.rounds,
            "output-dir": str(out / "runs"),
            **_overrides(args.set),
            **spec,
        }
        start = time.perf_counter()
        run_dir = run_in_process(config, reply_hook=boosted_reply if attacked else None)
        frame = pd.read_csv(run_dir / "results.csv")
        row = {
            "run": name,
            "robust": spec["robust"],
            "attacker": attacked,
            "final-accuracy": float(frame["accuracy"].iloc[-1]),
            "final-loss": float(frame["loss"].iloc[-1]),
            "dropped": int(frame["dropped"].sum()),
            "rejected-rounds": int(frame["rejected-rounds"].iloc[-1]),
            "clipped": int(frame["robust-clipped"].fillna(0).sum()),
            "trimmed": int(frame["robust-trimmed"].fillna(0).sum()),
            "seconds": round(time.perf_counter() - start, 1),
        }
        rows.append(row)
        with done.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    table = pd.DataFrame(rows)
    table.to_csv(out / "robustness.csv", index=False)
    markdown = _markdown(table)
    (out / "robustness.md").write_text(markdown)
    print(markdown)


def _overrides(text: str) -> dict[str, Any]:
    import tomllib

    return tomllib.loads("\n".join(text.split(","))) if text else {}


def _markdown(table: pd.DataFrame) -> str:
    """A GitHub table (pandas' to_markdown needs tabulate, not a dependency)."""
    header = "| " + " | ".join(table.columns) + " |"
    rule = "|" + "---|" * len(table.columns)
    lines = [header, rule]
    for row in table.itertuples(index=False):
        cells = [f"{v:.4f}" if isinstance(v, float) else str(v) for v in row]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
