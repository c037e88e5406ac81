"""Bit-identity check of every registered method: record, then compare.

A refactor that claims "no behaviour change" should leave every method's
final global arrays the same, bit for bit. This tool runs each registered
method (:func:`fedlr.strategies.registry.available_methods`) and a few
feature variants as tiny, seeded, in-process federations
(:func:`fedlr.launch.local.run_in_process`: no SuperLink, no Ray) and
records, per entry, the SHA-256 of every final global array (the tensors of
the run's ``final_arrays.pt``, hashed as dtype, shape and raw bytes, not as
pickle bytes), one digest over all of them, a digest of every array the
server sent and the clients replied (per round and partition), a digest of
the strategy's state in the run's last checkpoint, and, for information, the
final ``results.csv`` row (loss, accuracy, gaps, bytes; timings left out).

Usage::

    python -m benchmarks.bit_identity record --out BASE.json [--methods a,b]
    python -m benchmarks.bit_identity compare --out NEW.json --against BASE.json

``compare`` re-runs the entries of ``BASE.json`` with the run configs stored
in it (same seeds, same thread count), writes ``NEW.json`` and prints one
line per entry: ``IDENTICAL`` when the final arrays match bit for bit, else
``DIFFERENT`` with the keys that differ; a note follows where the messages,
the strategy state or the metrics row differ. It exits 1 if any entry is
``DIFFERENT`` (with ``--strict``, also on any such note) or is missing.
``--no-run`` compares two existing files.

Configs: the tests' tiny BERT on polarity for the text methods (3 clients,
3 local steps, 2 rounds), the small CNN on digits for the vision ones and the
MLP on permuted MNIST for the continual ones (3 tasks of 1 round: FOT's bases
need a task boundary and a round after it); the per-method overrides follow
``tests/strategies/test_every_method.py``. The heterogeneous-rank methods run
with ``client-ranks``. All 41 entries take about 6 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import pandas as pd
import torch

FORMAT = 1
"""Version of the JSON layout."""

TEXT, VISION, CONTINUAL = "text", "vision", "continual"
FAMILIES: dict[str, dict[str, Any]] = {
    # tests/conftest.py tiny_run_config
    TEXT: {
        "model": "tiny-bert",
        "dataset": "polarity",
        "robust": "none",  # as the tests' runs; the default has its own entry
        "num-server-rounds": 2,
        "local-steps": 3,
        "batch-size": 8,
        "max-length": 32,
        "lora-rank": 4,
        "lora-alpha": 8.0,
        "lr": 0.01,
        "partitioner": "dirichlet",
        "dirichlet-alpha": 0.5,
        "num-partitions": 3,
        "max-eval-examples": 128,
        "seed": 7,
        "device": "cpu",
    },
    # tests/strategies/test_every_method.py run_config
    VISION: {
        "model": "cnn",
        "dataset": "digits",
        "num-server-rounds": 2,
        "local-steps": 3,
        "num-partitions": 3,
        "lr": 0.05,
        "seed": 3,
        "device": "cpu",
    },
    CONTINUAL: {
        "model": "mlp",
        "dataset": "permuted-mnist",
        "num-partitions": 3,
        "task-examples": 200,
        "local-steps": 3,
        "lr": 0.1,
        "seed": 3,
        "device": "cpu",
        "num-tasks": 3,
        "rounds-per-task": 1,
        "num-server-rounds": 3,
    },
}
ASSETS = {TEXT: ["polarity", "minilm"], VISION: [], CONTINUAL: ["mnist"]}
VERA_RANKS = {"vera-rank": 8, "sorf-rank": 4}
HETERO = {"client-ranks": "2,4,8"}


@dataclass(frozen=True)
class Entry:
    """One recorded run: a method on its family's config plus overrides."""

    name: str
    method: str
    family: str
    overrides: Mapping[str, Any] = field(default_factory=dict)

    def run_config(self) -> dict[str, Any]:
        """The flat run config (``output-dir`` is added at run time)."""
        return {"method": self.method, **FAMILIES[self.family], **self.overrides}


METHOD_ENTRIES: dict[str, Entry] = {
    e.name: e
    for e in [
        Entry("fedavg-lora", "fedavg-lora", TEXT),
        Entry("fedprox-lora", "fedprox-lora", TEXT),
        Entry("fedavgm-lora", "fedavgm-lora", TEXT),
        Entry("scaffold-lora", "scaffold-lora", TEXT),
        Entry("fedex-lora", "fedex-lora", TEXT),
        Entry("fedspec", "fedspec", TEXT),
        Entry("fedsvd", "fedsvd", TEXT),
        Entry("ffa-lora", "ffa-lora", TEXT),
        Entry("fedsa-lora", "fedsa-lora", TEXT),
        Entry("local-svd", "local-svd", TEXT),
        Entry("global-svd", "global-svd", TEXT),
        Entry("flexlora", "flexlora", TEXT, HETERO),
        Entry("hetlora", "hetlora", TEXT, HETERO),
        Entry("flora", "flora", TEXT, HETERO),
        Entry("fedrot-lora", "fedrot-lora", TEXT),
        Entry("fedadam-lora", "fedadam-lora", TEXT),
        Entry("fedyogi-lora", "fedyogi-lora", TEXT),
        Entry("fedadagrad-lora", "fedadagrad-lora", TEXT),
        Entry("feddyn-lora", "feddyn-lora", TEXT),
        Entry("ravan", "ravan", TEXT),
        Entry("rolora", "rolora", TEXT),
        # two warm-up rounds (stage 1, the switch), then a LoRA round
        Entry(
            "slora",
            "slora",
            TEXT,
            {"slora-warmup-rounds": 2, "slora-density": 0.05, "num-server-rounds": 3},
        ),
        Entry("feddpa", "feddpa", TEXT),
        # round 1 warms up and allocates the experts; rounds 2, 3 mix them
        Entry("fedlease", "fedlease", TEXT, {"num-server-rounds": 3}),
        # one round per stage: root, cluster, leaf
        Entry(
            "hilora",
            "hilora",
            TEXT,
            {
                "hilora-root-rounds": 1,
                "hilora-cluster-rounds": 1,
                "num-server-rounds": 3,
            },
        ),
        Entry("fedbuff-lora", "fedbuff-lora", TEXT),
        Entry("fedasync-lora", "fedasync-lora", TEXT),
        Entry("ilora", "ilora", TEXT),
        Entry("fedavg-vera", "fedavg-vera", TEXT, VERA_RANKS),
        Entry("vera-fedex", "vera-fedex", TEXT, VERA_RANKS),
        Entry("sorf-vera", "sorf-vera", TEXT, VERA_RANKS),
        Entry("fedavg", "fedavg", VISION),
        Entry("qrmix", "qrmix", VISION, {"warmup-rounds": 1, "qrmix-k": 4}),
        Entry("fedavg-continual", "fedavg-continual", CONTINUAL),
        Entry("fot", "fot", CONTINUAL, {"fot-sketch-dim": 16}),
    ]
}
"""One entry per registered method (a method without one fails ``record``)."""

VARIANTS: list[Entry] = [
    Entry("fedprox-lora@mu0.5", "fedprox-lora", TEXT, {"proximal-mu": 0.5}),
    Entry(
        "hetlora@prune",
        "hetlora",
        TEXT,
        {
            **HETERO,
            "hetlora-prune-gamma": 0.5,
            "hetlora-prune-lambda": 1.0,
            "num-server-rounds": 3,  # B starts at 0: nothing to prune in round 1
        },
    ),
    # ranks 1, 2, 1: the rank-1 nodes fold the global tail into W0
    # (fold-tail); round 2's base change, of rank <= (3 + 2) 2 = 10 < 32,
    # goes down factored
    Entry("fedex-lora@client-ranks", "fedex-lora", TEXT, {"client-ranks": "1,2"}),
    Entry("fedex-lora@dense", "fedex-lora", TEXT, {"fedex-downlink": "dense"}),
    # half the nodes per round: personal state of nodes that sat out a round
    Entry(
        "fedsa-lora@partial",
        "fedsa-lora",
        TEXT,
        {"num-partitions": 4, "fraction-train": 0.5, "num-server-rounds": 3},
    ),
    Entry(
        "global-svd@partial",
        "global-svd",
        TEXT,
        {"num-partitions": 4, "fraction-train": 0.5, "num-server-rounds": 3},
    ),
    Entry(
        "local-svd@partial",
        "local-svd",
        TEXT,
        {"num-partitions": 4, "fraction-train": 0.5, "num-server-rounds": 3},
    ),
]
"""Feature variants, recorded as entries of their own."""

VARIANTS += [
    # the round's steps besides the method: robust rules, client-level DP
    Entry("fedavg-lora@norm-clip", "fedavg-lora", TEXT, {"robust": "norm-clip"}),
    Entry("fedex-lora@auto", "fedex-lora", TEXT, {"robust": "auto"}),
    Entry(
        "fedex-lora@trimmed-mean",
        "fedex-lora",
        TEXT,
        {"robust": "trimmed-mean", "trim-fraction": 0.34},
    ),
    Entry("fedavg@median", "fedavg", VISION, {"robust": "median"}),
    Entry(
        "fedavg-lora@client-dp",
        "fedavg-lora",
        TEXT,
        {
            "client-dp-clip": 0.5,
            "client-dp-noise-multiplier": 0.5,
            "reproducible-noise": True,
        },
    ),
    Entry(
        "fedavg-lora@dp-sgd",
        "fedavg-lora",
        TEXT,
        {
            "dp-max-grad-norm": 1.0,
            "dp-noise-multiplier": 1.0,
            "reproducible-noise": True,
        },
    ),
]


# ------------------------------------------------------------------ hashing
def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and raw bytes (CPU, contiguous)."""
    t = tensor.detach().cpu().contiguous().reshape(-1)
    digest = hashlib.sha256(f"{t.dtype}|{tuple(tensor.shape)}|".encode())
    digest.update(t.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def ndarray_digest(array: np.ndarray) -> str:
    """SHA-256 of a NumPy array's dtype, shape and raw bytes."""
    a = np.ascontiguousarray(array)
    digest = hashlib.sha256(f"{a.dtype.str}|{a.shape}|".encode())
    digest.update(a.tobytes())
    return digest.hexdigest()


def combined(digests: Mapping[str, str]) -> str:
    """One SHA-256 over ``key=digest`` lines, keys sorted."""
    lines = "".join(f"{k}={digests[k]}\n" for k in sorted(digests))
    return hashlib.sha256(lines.encode()).hexdigest()


def nested_digest(value: Any) -> str:
    """SHA-256 of nested state: tensors and arrays by content, the rest by repr."""
    digest = hashlib.sha256()

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            digest.update(f"T{tensor_digest(v)};".encode())
        elif isinstance(v, np.ndarray):
            digest.update(f"N{ndarray_digest(v)};".encode())
        elif isinstance(v, Mapping):
            digest.update(f"M{len(v)}{{".encode())
            for k in sorted(v, key=repr):
                digest.update(f"{k!r}:".encode())
                walk(v[k])
            digest.update(b"}")
        elif isinstance(v, (list, tuple)):
            digest.update(f"L{len(v)}[".encode())
            for item in v:
                walk(item)
            digest.update(b"]")
        elif isinstance(v, float) and math.isnan(v):
            digest.update(b"nan;")
        else:
            digest.update(f"{type(v).__name__}:{v!r};".encode())

    walk(value)
    return digest.hexdigest()


class MessageLog:
    """Reply hook: digests of every array record sent and replied.

    Keyed ``r<round>/p<partition>/{sent,reply}/<record>``; the hook returns
    the reply unchanged.
    """

    def __init__(self) -> None:
        self.digests: dict[str, str] = {}

    def __call__(self, partition: int, instruction: Any, reply: Any) -> Any:
        config = instruction.content.config_records.get("config")
        server_round = int(config.get("server-round", 0)) if config else 0
        kind = instruction.metadata.message_type
        prefix = f"r{server_round}/p{partition}/{kind}"
        self._add(f"{prefix}/sent", instruction)
        if reply is None or reply.has_error():
            self.digests[f"{prefix}/reply"] = "error"
        else:
            self._add(f"{prefix}/reply", reply)
        return reply

    def _add(self, prefix: str, message: Any) -> None:
        for name, record in message.content.array_records.items():
            arrays = {k: ndarray_digest(a.numpy()) for k, a in record.items()}
            self.digests[f"{prefix}/{name}"] = combined(arrays)


# ------------------------------------------------------------------- record
def _final_row(run_dir: Path) -> dict[str, Any]:
    """The last ``results.csv`` row without the timings (plain JSON values)."""
    frame = pd.read_csv(run_dir / "results.csv")
    row = frame.iloc[-1].to_dict()
    out: dict[str, Any] = {}
    for key, value in row.items():
        if "seconds" in str(key):
            continue
        if isinstance(value, (np.integer, np.floating)):
            value = value.item()
        if isinstance(value, float) and math.isnan(value):
            value = None
        out[str(key)] = value
    return out


def _checkpoint(run_dir: Path) -> dict[str, str | None]:
    """Digests of the strategy state and the arrays in the newest checkpoint."""
    checkpoints = sorted(run_dir.glob("checkpoint-*.pt"))
    if not checkpoints:
        return {"strategy-state-digest": None, "checkpoint-arrays-digest": None}
    saved = torch.load(checkpoints[-1], weights_only=True)
    arrays = {k: tensor_digest(v) for k, v in saved.get("arrays", {}).items()}
    return {
        "strategy-state-digest": nested_digest(saved.get("strategy", {})),
        "checkpoint-arrays-digest": combined(arrays),
    }


def run_entry(name: str, config: Mapping[str, Any], output_dir: Path) -> dict[str, Any]:
    """Run one entry; return its record (digests, metrics row, seconds)."""
    from fedlr.launch.local import run_in_process

    run_config = {**config, "output-dir": str(output_dir.resolve())}
    log = MessageLog()
    # each entry's nodes start with empty privacy ledgers (a shared one would
    # make the epsilon of a DP entry depend on the runs before it)
    previous = os.environ.get("FEDLR_NODE_STATE_DIR")
    os.environ["FEDLR_NODE_STATE_DIR"] = str((output_dir / "node-state").resolve())
    started = time.perf_counter()
    try:
        # the benchmark's own nodes consent to the seeded noise of its DP
        # entries (nothing sets the consent for them)
        consent = {"dp-allow-reproducible-noise": True}
        run_dir = run_in_process(run_config, reply_hook=log, node_config=consent)
    finally:
        if previous is None:
            os.environ.pop("FEDLR_NODE_STATE_DIR", None)
        else:
            os.environ["FEDLR_NODE_STATE_DIR"] = previous
    seconds = time.perf_counter() - started
    final = torch.load(run_dir / "final_arrays.pt", weights_only=True)
    arrays = {k: tensor_digest(v) for k, v in final.items()}
    return {
        "config": dict(config),
        "arrays": arrays,
        "arrays-digest": combined(arrays),
        "shapes": {k: [str(v.dtype), list(v.shape)] for k, v in final.items()},
        "messages": log.digests,
        "messages-digest": combined(log.digests),
        **_checkpoint(run_dir),
        "metrics": _final_row(run_dir),
        "seconds": round(seconds, 2),
    }


def default_entries() -> list[Entry]:
    """An entry per registered method (in registry order), then the variants."""
    from fedlr.strategies.registry import available_methods

    methods = available_methods()
    missing = [m for m in methods if m not in METHOD_ENTRIES]
    if missing:
        raise SystemExit(
            f"registered methods without an entry in {__file__}: {missing}"
        )
    return [METHOD_ENTRIES[m] for m in methods] + VARIANTS


def select(
    names: list[str], wanted: str | None, method_of: Callable[[str], str]
) -> list[str]:
    """The names whose entry name or method is in the comma list ``wanted``."""
    if not wanted:
        return names
    chosen = {w.strip() for w in wanted.split(",") if w.strip()}
    picked = [n for n in names if n in chosen or method_of(n) in chosen]
    unknown = chosen - set(picked) - {method_of(n) for n in picked}
    if unknown:
        raise SystemExit(f"unknown methods or entries: {sorted(unknown)}")
    return picked


def record(
    configs: Mapping[str, Mapping[str, Any]],
    out: Path,
    *,
    threads: int,
    keep: bool,
    verbose: bool = False,
) -> dict[str, Any]:
    """Run ``configs`` (name -> run config) one after another; write ``out``."""
    import fedlr
    from fedlr.data.assets import ensure_assets
    from fedlr.launch.local import run_in_process  # noqa: F401

    # (imported before the log levels are set: importing Flower sets its own)

    torch.set_num_threads(threads)
    if not verbose:  # the rounds' INFO lines and Flower's setup warnings
        for name in ("flwr", "fedlr"):
            logging.getLogger(name).setLevel(logging.ERROR)
    families = {
        f
        for c in configs.values()
        for f, base in FAMILIES.items()
        if c.get("model") == base["model"]
    }
    ensure_assets(sorted({a for f in families for a in ASSETS[f]}), quiet=True)
    print(f"fedlr from {Path(fedlr.__file__).parent}", flush=True)
    print(f"torch {torch.__version__}, {threads} thread(s)", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="fedlr-bit-identity-")).resolve()
    print(f"run directories under {tmp}", flush=True)
    result: dict[str, Any] = {
        "format": FORMAT,
        "fedlr": str(Path(fedlr.__file__).parent),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "threads": threads,
        "entries": {},
    }
    total = time.perf_counter()
    try:
        for i, (name, config) in enumerate(configs.items(), 1):
            entry = run_entry(name, config, tmp / f"{i:02d}")
            result["entries"][name] = entry
            m = entry["metrics"]
            print(
                f"[{i:2d}/{len(configs)}] {name:26s} {entry['seconds']:6.1f} s  "
                f"arrays {entry['arrays-digest'][:12]}  "
                f"loss {_num(m.get('loss'))} accuracy {_num(m.get('accuracy'))}",
                flush=True,
            )
    finally:
        if not keep:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    result["seconds"] = round(time.perf_counter() - total, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{len(configs)} entries in {result['seconds']} s; wrote {out}", flush=True)
    return result


def _num(value: Any) -> str:
    return "nan" if value is None else f"{value:.4f}"


# ------------------------------------------------------------------ compare
def _same_metrics(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """Metric names whose values differ (exactly; None is NaN)."""
    return sorted(
        k for k in set(a) | set(b) if a.get(k, "absent") != b.get(k, "absent")
    )


def _some(keys: list[str], shown: int = 4) -> str:
    """``n: k1, k2, ...`` with at most ``shown`` keys."""
    more = ", ..." if len(keys) > shown else ""
    return f"{len(keys)}: {', '.join(keys[:shown])}{more}"


def compare(new: Mapping[str, Any], old: Mapping[str, Any], *, strict: bool) -> int:
    """Print one verdict per entry of ``old``; 1 if any differs, else 0."""
    failed = 0
    for key in ("torch", "numpy", "threads", "machine"):
        if new.get(key) != old.get(key):
            print(f"note: {key} differs: {old.get(key)} (old) vs {new.get(key)} (new)")
    entries_new, entries_old = new["entries"], old["entries"]
    width = max(map(len, entries_old), default=10)
    for name, was in entries_old.items():
        now = entries_new.get(name)
        if now is None:
            print(f"{name:{width}s}  MISSING (not in the new record)")
            failed += 1
            continue
        notes = []
        if now["config"] != was["config"]:
            notes.append("run config differs")
        if now["messages-digest"] != was["messages-digest"]:
            keys = sorted(
                k
                for k in set(now["messages"]) | set(was["messages"])
                if now["messages"].get(k) != was["messages"].get(k)
            )
            notes.append(f"messages differ: {_some(keys)}")
        if now["strategy-state-digest"] != was["strategy-state-digest"]:
            notes.append("strategy state differs")
        if now["checkpoint-arrays-digest"] != now["arrays-digest"]:
            notes.append("the last checkpoint's arrays are not the final arrays")
        metrics = _same_metrics(now["metrics"], was["metrics"])
        if metrics:
            notes.append(f"metrics differ: {', '.join(metrics)}")
        if now["arrays-digest"] == was["arrays-digest"]:
            verdict = "IDENTICAL"
            failed += bool(strict and notes)
        else:
            verdict = "DIFFERENT"
            failed += 1
            keys = sorted(
                k
                for k in set(now["arrays"]) | set(was["arrays"])
                if now["arrays"].get(k) != was["arrays"].get(k)
            )
            notes.insert(0, f"arrays differ: {_some(keys)}")
        print(f"{name:{width}s}  {verdict}" + "".join(f"\n    {n}" for n in notes))
    extra = sorted(set(entries_new) - set(entries_old))
    if extra:
        print(f"note: entries only in the new record: {', '.join(extra)}")
    print(
        f"{len(entries_old) - failed} of {len(entries_old)} entries identical"
        + ("" if not failed else f"; {failed} failed")
    )
    return 1 if failed else 0


# --------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    """Command line: ``record`` or ``compare``."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bit_identity",
        description=__doc__.splitlines()[0],
    )
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run every entry and write the digests")
    cmp_ = sub.add_parser("compare", help="re-run a record's entries and compare")
    for p in (rec, cmp_):
        p.add_argument("--out", type=Path, required=True, help="JSON to write")
        p.add_argument(
            "--methods",
            help="comma-separated methods or entry names (default: all entries)",
        )
        p.add_argument(
            "--keep", action="store_true", help="keep the temporary run directories"
        )
        p.add_argument(
            "--verbose", action="store_true", help="show Flower's and fedlr's logs"
        )
    rec.add_argument("--threads", type=int, default=2, help="torch threads")
    cmp_.add_argument("--against", type=Path, required=True, help="baseline JSON")
    cmp_.add_argument(
        "--strict",
        action="store_true",
        help="also fail on differing messages, strategy state or metrics",
    )
    cmp_.add_argument(
        "--no-run", action="store_true", help="compare --out as it is (no runs)"
    )
    args = parser.parse_args(argv)

    if args.command == "record":
        entries = {e.name: e for e in default_entries()}
        names = select(list(entries), args.methods, lambda n: entries[n].method)
        configs = {n: entries[n].run_config() for n in names}
        record(
            configs,
            args.out,
            threads=args.threads,
            keep=args.keep,
            verbose=args.verbose,
        )
        return 0

    old = json.loads(args.against.read_text())
    if old.get("format") != FORMAT:
        raise SystemExit(f"{args.against}: format {old.get('format')}, want {FORMAT}")
    stored = old["entries"]
    names = select(list(stored), args.methods, lambda n: stored[n]["config"]["method"])
    old = {**old, "entries": {n: stored[n] for n in names}}
    if args.no_run:
        new = json.loads(args.out.read_text())
    else:
        configs = {n: stored[n]["config"] for n in names}
        new = record(
            configs,
            args.out,
            threads=int(old["threads"]),
            keep=args.keep,
            verbose=args.verbose,
        )
    return compare(new, old, strict=args.strict)


if __name__ == "__main__":
    sys.exit(main())
