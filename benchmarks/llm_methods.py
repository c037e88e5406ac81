"""Every LoRA- and VeRA-family method on the offline causal-LM task (docs/results/llm).

Runs each method of the ``lora``, ``vera`` and ``sorf-vera`` payload kinds
for 3 rounds of ``benchmarks/conf/llm-offline.toml`` through the real
``flwr run`` (``python -m fedlr.launch.compare run --engine flwr``), then writes
``docs/results/llm/methods.csv`` and ``methods.md``: per method, the exact
match and the response perplexity of the base model before round 1 and of
the global model after round 3 (for the personalised methods, the clients'
means on their own held-out parts), and the wall time.

``python -m benchmarks.llm_methods [--rounds 3] [--seed 0] [--engine flwr]``
(about 1 min per method on 2 CPU cores, SuperLink and Ray start-up included).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path

import pandas as pd

from fedlr.strategies.registry import get_method, registered_methods

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "benchmarks" / "conf" / "llm-offline.toml"
OUT = ROOT / "docs" / "results" / "llm"
RUNS = ROOT / "outputs" / "results" / "llm-methods"
KINDS = ("lora", "vera", "sorf-vera")


def methods() -> list[str]:
    """The LoRA- and VeRA-family methods, in registry order."""
    return [s.name for s in registered_methods() if s.payload.name in KINDS]


def table(runs: Path) -> pd.DataFrame:
    """One row per finished run under ``runs/<method>-seed<k>/<run>/``."""
    rows = []
    for summary_path in sorted(runs.glob("runs/*/*/summary.json")):
        summary = json.loads(summary_path.read_text())
        if summary.get("status") != "finished":
            continue
        rows.append(
            {
                "method": summary["method"],
                "rounds": summary["rounds"],
                "exact-match-before": summary["initial-exact-match"],
                "exact-match-after": summary["final-exact-match"],
                "perplexity-before": summary["initial-perplexity"],
                "perplexity-after": summary["final-perplexity"],
                "seconds": summary["seconds"],
            }
        )
    return pd.DataFrame(rows)


def to_markdown(frame: pd.DataFrame) -> str:
    """The table as markdown, a personalised method's row marked so."""
    lines = [
        "| method | rounds | exact match before → after "
        "| response perplexity before → after | round time (sum) |",
        "|---|---|---|---|---|",
    ]
    for row in frame.to_dict("records"):
        method = str(row["method"])
        if get_method(method).traits.personalised:
            method += " (personalised)"
        lines.append(
            f"| {method} | {row['rounds']} "
            f"| {row['exact-match-before']:.4f} → {row['exact-match-after']:.4f} "
            f"| {row['perplexity-before']:.2f} → {row['perplexity-after']:.3f} "
            f"| {row['seconds']:.0f} s |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", default="flwr", choices=("flwr", "inprocess"))
    parser.add_argument("--runs", type=Path, default=RUNS)
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not args.table_only:
        command = [
            sys.executable,
            "-m",
            "run",
            "--conf",
            str(CONF),
            "--methods",
            ",".join(methods()),
            "--seeds",
            str(args.seed),
            "--out",
            str(args.runs),
            "--engine",
            args.engine,
            "--set",
            f"num-server-rounds={args.rounds}",
        ]
        subprocess.run(command, check=False, cwd=ROOT)
    frame = table(args.runs)
    OUT.mkdir(parents=True, exist_ok=True)
    frame.to_csv(OUT / "methods.csv", index=False)
    (OUT / "methods.md").write_text(to_markdown(frame))
    print(to_markdown(frame))


if __name__ == "__main__":
    main()
