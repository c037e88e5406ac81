"""1,000-client runs of the default text task on both engines.

``python -m benchmarks.scale_runs [--engines inprocess,ray] [--out DIR]
[--num-partitions 1000] [--fraction-train 0.1] [--rounds 2] [--local-steps 2]
[--client-cpus C] [--set 'key=value ...']``

The default run (``fedex-lora``, MiniLM with LoRA on polarity) cut into
``--num-partitions`` clients, of which ``--fraction-train`` train each round.
Polarity has 3,200 training sentences: 1,000 partitions hold 3 or 4 each, which
only the ``iid`` partitioner can give every client (a Dirichlet split leaves
some clients empty at any α ≤ 5), and below the default
``min-partition-size`` of 10; the runs set ``partitioner="iid"
min-partition-size=3``.

Engines:

* ``inprocess``: :func:`fedlr.launch.local.run_in_process` in a child
  process (clients one after another, each with every core);
* ``ray``: ``flwr run`` on Flower's simulation engine (local SuperLink, one Ray
  actor per ``--client-cpus`` cores, Flower's default 2), with a fresh
  ``FLWR_HOME`` under ``DIR``.

For each run: the per-round times of its ``results.csv`` (``seconds`` is the
round's wall time: training, aggregation, the server's evaluation and the
checkpoint; ``train-seconds``, ``aggregate-seconds`` and ``eval-seconds`` are
its parts) and the peak memory of every process of the run, sampled every
0.5 s: the sum of the resident sets (RSS; a page shared by two processes, such
as torch's libraries, counts twice), the sum of the proportional sets (PSS:
shared pages split between the processes that map them; psutil only) and the
largest single process. The in-process child also reports its own
``getrusage`` peak (``ru_maxrss``). Results go to ``DIR/scale_runs.json`` and
``DIR/scale_runs.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("inprocess", "ray")
ROUND_COLUMNS = (
    "seconds",
    "train-seconds",
    "aggregate-seconds",
    "eval-seconds",
    "clients",
    "dropped",
    "accuracy",
    "loss",
)


def scale_config(
    output_dir: Path,
    *,
    num_partitions: int = 1000,
    fraction_train: float = 0.1,
    rounds: int = 2,
    local_steps: int = 2,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The run config of a scale run: the default run with many clients."""
    config: dict[str, Any] = {
        "num-partitions": num_partitions,
        "fraction-train": fraction_train,
        "num-server-rounds": rounds,
        "local-steps": local_steps,
        "partitioner": "iid",
        "min-partition-size": 3,
        "output-dir": str(Path(output_dir).resolve()),
    }
    config.update(extra or {})
    return config


# ------------------------------------------------------------------ memory
def _children_proc(pid: int) -> list[int]:
    """Descendants of ``pid`` from /proc (when psutil is missing)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...; comm may hold spaces and parentheses
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == current]
        found += kids
        frontier += kids
    return found


def _rss_proc(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _name_proc(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


@dataclass
class MemoryPeak:
    """Peaks over the samples of a process group (bytes)."""

    rss_sum: int = 0
    pss_sum: int = 0
    largest: int = 0
    largest_name: str = ""
    processes: int = 0
    samples: int = 0
    at_peak: list[tuple[str, int]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        mib = 1024.0**2
        return {
            "peak-rss-sum-mib": round(self.rss_sum / mib, 1),
            "peak-pss-sum-mib": round(self.pss_sum / mib, 1) if self.pss_sum else None,
            "largest-process-mib": round(self.largest / mib, 1),
            "largest-process": self.largest_name,
            "peak-processes": self.processes,
            "samples": self.samples,
            "processes-at-peak": [
                (name, round(rss / mib, 1)) for name, rss in self.at_peak
            ],
        }


class MemorySampler(threading.Thread):
    """Sample the memory of the processes ``roots()`` names and their descendants.

    Parameters
    ----------
    roots : callable
        Returns the PIDs of the group's top processes at the moment of a sample
        (the group may change: a SuperLink appears, Ray workers come and go).
    interval : float
        Seconds between samples.
    """

    def __init__(self, roots: Callable[[], Iterable[int]], interval: float = 0.5):
        super().__init__(daemon=True)
        self.roots = roots
        self.interval = interval
        self.peak = MemoryPeak()
        self._stop_event = threading.Event()
        try:
            import psutil
        except ImportError:
            self._psutil: Any = None
        else:
            self._psutil = psutil

    def stop(self) -> MemoryPeak:
        self._stop_event.set()
        self.join(timeout=30)
        return self.peak

    def run(self) -> None:
        while not self._stop_event.is_set():
            with contextlib.suppress(Exception):  # a process vanished mid-sample
                self.sample()
            self._stop_event.wait(self.interval)

    def _group(self) -> set[int]:
        pids: set[int] = set()
        for root in self.roots():
            pids.add(root)
            if self._psutil is not None:
                try:
                    kids = self._psutil.Process(root).children(recursive=True)
                except self._psutil.Error:
                    continue
                pids.update(k.pid for k in kids)
            else:
                pids.update(_children_proc(root))
        return pids

    def sample(self) -> None:
        rss_sum = pss_sum = 0
        sizes: list[tuple[str, int]] = []
        for pid in self._group():
            if self._psutil is not None:
                try:
                    proc = self._psutil.Process(pid)
                    name = proc.name()
                    try:
                        full = proc.memory_full_info()
                        rss, pss = full.rss, getattr(full, "pss", 0)
                    except self._psutil.AccessDenied:
                        rss, pss = proc.memory_info().rss, 0
                except self._psutil.Error:
                    continue
            else:
                name, rss, pss = _name_proc(pid), _rss_proc(pid), 0
            rss_sum += rss
            pss_sum += pss
            sizes.append((name, rss))
        peak = self.peak
        peak.samples += 1
        if rss_sum > peak.rss_sum:
            peak.rss_sum = rss_sum
            peak.at_peak = sorted(sizes, key=lambda s: -s[1])
        peak.pss_sum = max(peak.pss_sum, pss_sum)
        peak.processes = max(peak.processes, len(sizes))
        for name, rss in sizes:
            if rss > peak.largest:
                peak.largest, peak.largest_name = rss, name


# ----------------------------------------------------------------- engines
def _env() -> dict[str, str]:
    env = os.environ.copy()
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    pythonpath = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + pythonpath if pythonpath else "")
    return env


def _new_run_dir(output: Path, before: set[Path]) -> Path:
    new = sorted(
        p.parent for p in output.glob("*/results.csv") if p.parent not in before
    )
    if len(new) != 1:
        raise RuntimeError(f"expected one new run directory in {output}, found {new}")
    return new[0]


def run_inprocess(config: dict[str, Any], timeout: float) -> dict[str, Any]:
    """The in-process engine in a child process, its memory sampled."""
    output = Path(config["output-dir"])
    output.mkdir(parents=True, exist_ok=True)
    before = {p.parent for p in output.glob("*/results.csv")}
    config_file = output / "inprocess-config.json"
    config_file.write_text(json.dumps(config))
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.scale_runs", "--child", str(config_file)],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    sampler = MemorySampler(lambda: [proc.pid])
    sampler.start()
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        peak = sampler.stop()
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"in-process run exited {proc.returncode}")
    child = json.loads(stdout.strip().splitlines()[-1])
    run_dir = _new_run_dir(output, before)
    return {
        "engine": "inprocess",
        "run-dir": str(run_dir),
        "wall-seconds": round(wall, 1),
        "ru-maxrss-mib": round(child["maxrss-kib"] / 1024.0, 1),
        **peak.as_dict(),
    }


def _child(config_file: Path) -> None:
    """``--child``: one in-process run; print its directory and peak RSS."""
    import resource

    from fedlr.launch.local import run_in_process

    config = json.loads(config_file.read_text())
    run_dir = run_in_process(config)
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(json.dumps({"run-dir": str(run_dir), "maxrss-kib": maxrss}), flush=True)


def _superlink_pids(home: str | None = None) -> list[int]:
    import psutil

    pids = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if any("flower-superlink" in part for part in cmdline) and (
            home is None or any(home in part for part in cmdline)
        ):
            pids.append(int(proc.info["pid"]))
    return pids


def run_ray(
    config: dict[str, Any], timeout: float, client_cpus: int = 0
) -> dict[str, Any]:
    """``flwr run`` on the Ray simulation engine, every process's memory sampled.

    The sampled group: this process's children (the ``flwr`` CLI) and the
    local SuperLink started under this run's ``FLWR_HOME``, with all their
    descendants (SuperExec, the simulation process with the ServerApp, Ray's
    GCS, raylet and the actors running the ClientApp).
    """
    import psutil

    from fedlr.launch.flwr_run import flwr_run, stop_local_superlinks

    others = _superlink_pids()
    if others:
        raise RuntimeError(
            f"a flower-superlink is already running (PIDs {others}); `flwr run` "
            "would use it. Stop it first."
        )
    output = Path(config["output-dir"])
    output.mkdir(parents=True, exist_ok=True)
    before = {p.parent for p in output.glob("*/results.csv")}
    home = (output / "flwr-home").resolve()
    me = psutil.Process()

    def roots() -> list[int]:
        return [c.pid for c in me.children()] + _superlink_pids(str(home))

    federation: dict[str, bool | int | float | str] = {
        "num-supernodes": int(config["num-partitions"])
    }
    if client_cpus:
        federation["client-resources-num-cpus"] = client_cpus
    sampler = MemorySampler(roots)
    sampler.start()
    started = time.perf_counter()
    saved = os.environ.copy()
    os.environ.update(_env())
    try:
        flwr_run(
            ROOT,
            flwr_home=home,
            run_config=config,
            federation_config=federation,
            timeout=timeout,
        )
    finally:
        wall = time.perf_counter() - started
        peak = sampler.stop()
        stop_local_superlinks(home)
        os.environ.clear()
        os.environ.update(saved)
    run_dir = _new_run_dir(output, before)
    return {
        "engine": "ray",
        "run-dir": str(run_dir),
        "wall-seconds": round(wall, 1),
        "client-cpus": client_cpus or 2,
        **peak.as_dict(),
    }


# ------------------------------------------------------------------ report
def add_rounds(result: dict[str, Any]) -> dict[str, Any]:
    """Add the per-round rows of the run's ``results.csv``."""
    import pandas as pd

    frame = pd.read_csv(Path(result["run-dir"]) / "results.csv")
    result["rounds"] = [
        {"round": int(row["round"]), **{c: float(row[c]) for c in ROUND_COLUMNS}}
        for _, row in frame.iterrows()
    ]
    result["mean-round-seconds"] = round(float(frame["seconds"].mean()), 1)
    return result


def markdown(results: list[dict[str, Any]], config: dict[str, Any]) -> str:
    """The per-round table and the memory table."""
    shown = " ".join(f"{k}={v}" for k, v in config.items() if k != "output-dir")
    lines = [
        f"Run config: `{shown}`",
        "",
        "| engine | round | clients | round s | train s | aggregate s | eval s "
        "| accuracy |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        for row in res["rounds"]:
            lines.append(
                f"| {res['engine']} | {row['round']} | {row['clients']:.0f} | "
                f"{row['seconds']:.1f} | {row['train-seconds']:.1f} | "
                f"{row['aggregate-seconds']:.1f} | {row['eval-seconds']:.1f} | "
                f"{row['accuracy']:.4f} |"
            )
    lines += [
        "",
        "| engine | wall s (run) | mean round s | peak RSS, sum (MiB) | peak PSS, sum "
        "(MiB) | largest process (MiB) | processes |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        pss = res["peak-pss-sum-mib"]
        lines.append(
            f"| {res['engine']} | {res['wall-seconds']:.0f} | "
            f"{res['mean-round-seconds']:.1f} | {res['peak-rss-sum-mib']:.0f} | "
            f"{'-' if pss is None else f'{pss:.0f}'} | "
            f"{res['largest-process-mib']:.0f} ({res['largest-process']}) | "
            f"{res['peak-processes']} |"
        )
    return "\n".join(lines) + "\n"


def _parse_set(text: str) -> dict[str, Any]:
    import tomllib

    return dict(tomllib.loads("\n".join(text.split()))) if text.strip() else {}


def main(argv: list[str] | None = None) -> None:
    """Run the engines and write ``scale_runs.json`` and ``scale_runs.md``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "scale")
    parser.add_argument("--num-partitions", type=int, default=1000)
    parser.add_argument("--fraction-train", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--local-steps", type=int, default=2)
    parser.add_argument(
        "--client-cpus",
        type=int,
        default=0,
        help="Ray engine: CPUs per client actor (0: Flower's default, 2)",
    )
    parser.add_argument("--set", default="", help="extra run config, TOML pairs")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        _child(args.child)
        return
    out = args.out.resolve()
    results = []
    for engine in args.engines.split(","):
        if engine not in ENGINES:
            parser.error(f"unknown engine {engine!r}; choose from {ENGINES}")
        config = scale_config(
            out / engine,
            num_partitions=args.num_partitions,
            fraction_train=args.fraction_train,
            rounds=args.rounds,
            local_steps=args.local_steps,
            extra=_parse_set(args.set),
        )
        print(f"== {engine}: {config}", flush=True)
        if engine == "inprocess":
            result = run_inprocess(config, args.timeout)
        else:
            result = run_ray(config, args.timeout, args.client_cpus)
        results.append(add_rounds(result))
        print(json.dumps(result, indent=1), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale_runs.json").write_text(json.dumps(results, indent=1))
    table = markdown(results, config)
    (out / "scale_runs.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
