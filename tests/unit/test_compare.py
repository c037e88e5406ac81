"""The sweep collector: fixture runs -> the table's means and stds."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import pandas as pd
import pytest

from fedlr.errors import ConfigError
from fedlr.launch.compare import main, parse_overrides, read_conf
from fedlr.runs.results import ResultsWriter
from fedlr.runs.table import collect, summarise, to_markdown


def _run(root, method, seed, accs, gaps, seconds=2.0, extra=None, **config):
    run_dir = root / f"{method}-seed{seed}-{len(accs)}"
    writer = ResultsWriter(run_dir, method=method, config={"seed": seed, **config})
    for t, (acc, gap) in enumerate(zip(accs, gaps, strict=True), start=1):
        writer.append(
            {
                "round": t,
                "accuracy": acc,
                "loss": 1.0,
                "frobenius-gap": gap,
                "bytes-up": 100.0,
                "bytes-down": 300.0,
                "seconds": seconds,
            }
        )
    (run_dir / "summary.json").write_text(json.dumps(extra or {}))
    return run_dir


def test_table_has_mean_and_std_over_seeds(tmp_path):
    dirs = [
        _run(tmp_path, "fedex-lora", 0, [0.5, 0.70], [0.2, 0.1]),
        _run(tmp_path, "fedex-lora", 1, [0.5, 0.80], [0.4, 0.3]),
        _run(tmp_path, "fedex-lora", 2, [0.5, 0.75], [0.6, 0.5]),
        _run(tmp_path, "fedavg-lora", 0, [0.5, 0.60, 0.65], [1.0, 1.0, 1.0], 4.0),
    ]
    runs = collect(dirs)
    assert runs["final-accuracy"].tolist() == pytest.approx([0.70, 0.80, 0.75, 0.65])
    table = summarise(runs)
    assert table["method"].tolist() == ["fedex-lora", "fedavg-lora"]
    fedex = table.iloc[0]
    assert fedex["seeds"] == 3
    assert fedex["accuracy-mean"] == pytest.approx(0.75)
    assert fedex["accuracy-std"] == pytest.approx(0.05)  # sample std of .70 .80 .75
    assert fedex["mean-gap"] == pytest.approx((0.15 + 0.35 + 0.55) / 3)
    assert fedex["total-bytes"] == pytest.approx(2 * 400.0)
    assert fedex["seconds"] == pytest.approx(4.0)
    fedavg = table.iloc[1]
    assert fedavg["accuracy-std"] == 0.0 and fedavg["seconds"] == pytest.approx(12.0)
    text = to_markdown(table)
    assert "| fedex-lora | 3 | 0.7500 ± 0.0500 | 3.500e-01 |" in text
    assert text.count("\n") == 4


def test_rows_split_by_a_setting_and_continual_columns(tmp_path):
    dirs = [
        _run(
            tmp_path / "a",
            "fot",
            0,
            [0.9],
            [math.nan],
            extra={"acc": 0.8, "fgt": 0.1},
            partitioner="iid",
        ),
        _run(
            tmp_path / "b",
            "fot",
            0,
            [0.7],
            [math.nan],
            extra={"acc": 0.6, "fgt": 0.3},
            partitioner="dirichlet",
        ),
    ]
    table = summarise(collect(dirs, by=["partitioner"]), by=["partitioner"])
    assert table["partitioner"].tolist() == ["iid", "dirichlet"]
    assert table["acc"].tolist() == pytest.approx([0.8, 0.6])
    text = to_markdown(table, by=["partitioner"])
    assert "| fot | iid | 1 | 0.9000 | — |" in text  # one seed: no "± 0"
    assert text.splitlines()[0].endswith("| ACC | FGT |")
    out = tmp_path / "out"
    assert (
        main(["table", *map(str, dirs), "--out", str(out), "--by", "partitioner"]) == 0
    )
    assert {p.name for p in out.iterdir()} == {
        "table.md",
        "table.csv",
        "comparison.png",
        "summary.png",
    }


def test_conf_files_are_validated(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text('method = "fedex-lora"\nnum-server-rounds = 3\n')
    assert read_conf(good) == {"method": "fedex-lora", "num-server-rounds": 3}
    bad = tmp_path / "bad.toml"
    bad.write_text("num-server-round = 3\n")
    with pytest.raises(ConfigError, match="num-server-round"):
        read_conf(bad)


def test_shipped_experiment_configs_are_valid():
    from tests.conftest import ROOT

    confs = sorted((ROOT / "benchmarks" / "conf").glob("*.toml"))
    assert confs, "no experiment configs found"
    for conf in confs:
        assert "method" in read_conf(conf), conf.name


def test_overrides_parse_like_flwr_run_config():
    assert parse_overrides(['partitioner="iid" lora-rank=3', "lr=0.5"]) == {
        "partitioner": "iid",
        "lora-rank": 3,
        "lr": 0.5,
    }
    assert parse_overrides(['x="a b" flag=true']) == {"x": "a b", "flag": True}
    assert parse_overrides([]) == {}


@pytest.mark.parametrize(
    ("item", "key"),
    [("partitioner=iid", "partitioner"), ("lora-rank", "--set"), ("=3", "--set")],
)
def test_bad_override_names_the_problem(item, key):
    with pytest.raises(ConfigError) as info:
        parse_overrides([item])
    assert info.value.key == key


@pytest.mark.slow  # whole in-process runs: the integration stage
def test_inprocess_sweep_runs_every_cell_and_tabulates(tmp_path, assets):
    """`run --engine inprocess`: two seeds of a 1-round tiny run, one table row."""
    from tests.conftest import tiny_run_config

    conf = tmp_path / "tiny.toml"
    values = tiny_run_config(tmp_path, **{"num-server-rounds": 1, "local-steps": 2})
    del values["output-dir"], values["seed"]
    conf.write_text(
        "".join(
            f"{k} = {json.dumps(v) if isinstance(v, str) else v}\n"
            for k, v in values.items()
        )
    )
    out = tmp_path / "sweep"
    code = main(
        [
            "run",
            "--conf",
            str(conf),
            "--methods",
            "fedavg-lora",
            "--seeds",
            "0,1",
            "--out",
            str(out),
            "--engine",
            "inprocess",
        ]
    )
    assert code == 0
    runs = collect(sorted(p.parent for p in out.glob("runs/*/*/results.csv")))
    assert sorted(runs["seed"]) == [0, 1]
    assert (runs["rounds"] == 1).all()
    assert runs["final-accuracy"].between(0, 1).all()
    table = (out / "table.md").read_text()
    assert "| fedavg-lora | 2 |" in table
    # different seeds give different clients and heads: not one run twice
    assert runs["mean-gap"].nunique() == 2


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [({"engine": "ray"}, "--engine"), ({"client_gpus": -1.0}, "--client-gpus")],
)
def test_bad_sweep_options_are_refused_before_any_run(tmp_path, kwargs, key):
    from fedlr.launch.compare import run_sweep

    conf = tmp_path / "c.toml"
    conf.write_text('method = "fedex-lora"\n')
    with pytest.raises(ConfigError) as info:
        run_sweep(conf, ["fedex-lora"], [0], tmp_path / "out", **kwargs)
    assert info.value.key == key
    assert not (tmp_path / "out").exists()


def test_comparison_figure_shows_loss_when_no_run_has_a_gap(tmp_path):
    from fedlr.runs.table import comparison_figure

    nan = float("nan")
    vision = [_run(tmp_path / "v", "fedavg", s, [0.5, 0.6], [nan, nan]) for s in (0, 1)]
    fig = comparison_figure(vision)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[1].startswith("evaluation loss")
    assert len(fig.axes[1].get_lines()) == 1  # one group, two seeds
    lora = [_run(tmp_path / "l", "fedavg-lora", 0, [0.5, 0.6], [0.2, 0.01])]
    fig = comparison_figure(lora)
    assert fig.axes[1].get_title().startswith("Frobenius gap")
    # the gaps span a decade: symmetric-log, still from 0
    assert fig.axes[1].get_yscale() == "symlog"
    assert fig.axes[1].get_ylim()[0] == 0.0
    narrow = [_run(tmp_path / "n", "fedavg-lora", 0, [0.5, 0.6], [0.2, 0.1])]
    gap_ax = comparison_figure(narrow).axes[1]
    assert gap_ax.get_yscale() == "linear" and gap_ax.get_ylim()[0] == 0.0


def test_comparison_figure_of_a_causal_lm_shows_exact_match_and_perplexity(tmp_path):
    from fedlr.runs.table import comparison_figure

    dirs = []
    for seed in (0, 1):
        run_dir = tmp_path / f"lm-{seed}"
        writer = ResultsWriter(
            run_dir,
            method="fedavg-lora",
            config={"seed": seed},
            extra_columns=("perplexity", "exact-match"),
        )
        for t, (em, ppl) in enumerate([(0.02, 4.7), (0.04, 3.9)], start=1):
            row = {"round": t, "accuracy": em, "loss": math.log(ppl)}
            row.update({"frobenius-gap": 0.5, "perplexity": ppl, "exact-match": em})
            writer.append({**row, "seconds": 1.0})
        summary = {"initial-exact-match": 0.0, "initial-perplexity": 70.0 + seed}
        (run_dir / "summary.json").write_text(json.dumps(summary))
        dirs.append(run_dir)
    fig = comparison_figure(dirs)
    em, ppl, gap = fig.axes
    assert em.get_title().startswith("exact match")
    assert "accuracy" not in " ".join(ax.get_title() for ax in fig.axes)
    # round 0's perplexity (70.5) is in the title, not on the axis
    assert ppl.get_title().startswith("response perplexity (round 0: 70.5)")
    (line,) = ppl.get_lines()
    assert list(line.get_xdata()) == [1, 2]
    assert list(line.get_ydata()) == pytest.approx([4.7, 3.9])
    assert list(em.get_lines()[0].get_xdata()) == [0, 1, 2]
    assert gap.get_title().startswith("Frobenius gap")


def test_comparison_figure_has_legends_everywhere_and_no_band_for_one_seed(tmp_path):
    from matplotlib.collections import PolyCollection

    from fedlr.runs.table import comparison_figure

    one = [_run(tmp_path / "l", "fedavg-lora", 0, [0.5, 0.6], [0.2, 0.1])]
    fig = comparison_figure(one)
    for ax in fig.axes:
        assert ax.get_legend() is not None
        assert not [c for c in ax.collections if isinstance(c, PolyCollection)]
        assert "±" not in ax.get_title()
    fig.canvas.draw()
    ticks = [t for t in fig.axes[0].get_xticks() if 1 <= t <= 2]
    assert ticks and all(float(t).is_integer() for t in ticks)
    two = [
        _run(tmp_path / f"s{s}", "fedavg-lora", s, [0.5, 0.6 + s / 10], [0.2, 0.1])
        for s in (0, 1)
    ]
    fig = comparison_figure(two)
    bands = [c for c in fig.axes[0].collections if isinstance(c, PolyCollection)]
    assert len(bands) == 1 and "± std" in fig.axes[0].get_title()


def test_flwr_engine_passes_the_gpu_share_and_nodes_to_flwr_run(tmp_path, monkeypatch):
    """`--client-gpus 0.25` reaches `flwr run` as the clients' num-gpus."""
    import fedlr.launch.compare as compare
    from fedlr.launch.compare import run_sweep

    calls = []

    def fake_flwr_run(app_dir, *, flwr_home, run_config, federation_config, **kw):
        calls.append((run_config, federation_config, kw))
        run_dir = _run(
            tmp_path / "made", run_config["method"], run_config["seed"], [0.5], [0.1]
        )
        out = Path(run_config["output-dir"]) / run_dir.name
        out.parent.mkdir(parents=True, exist_ok=True)
        run_dir.rename(out)

    monkeypatch.setattr(compare, "flwr_run", fake_flwr_run)
    conf = tmp_path / "c.toml"
    conf.write_text('method = "fedex-lora"\nnum-partitions = 3\n')
    run_dirs, failures = run_sweep(
        conf, ["fedavg-lora"], [0, 1], tmp_path / "out", client_gpus=0.25
    )
    assert failures == {}
    assert len(run_dirs) == 2
    assert [c[0]["seed"] for c in calls] == [0, 1]
    for _, federation, kw in calls:
        assert federation == {
            "num-supernodes": 3,
            "client-resources-num-gpus": 0.25,
        }
        assert kw["keep_superlink"] is False  # each cell stops its SuperLink


def test_table_marks_unfinished_runs(tmp_path):
    """Runs without summary.json are counted apart and never averaged in."""
    dirs = [
        _run(tmp_path, "fedex-lora", 0, [0.5, 0.70], [0.2, 0.1]),
        _run(tmp_path, "fedex-lora", 1, [0.5, 0.80], [0.4, 0.3]),
        _run(tmp_path, "fedex-lora", 2, [0.5, 0.10], [0.6, 0.5]),
        _run(tmp_path, "fedavg-lora", 0, [0.5], [1.0]),
    ]
    (dirs[2] / "summary.json").unlink()  # interrupted after round 2
    (dirs[3] / "summary.json").unlink()
    runs = collect(dirs)
    assert runs["finished"].tolist() == [True, True, False, False]
    table = summarise(runs)
    fedex, fedavg = table.iloc[0], table.iloc[1]
    assert (fedex["seeds"], fedex["unfinished"]) == (2, 1)
    assert fedex["accuracy-mean"] == pytest.approx(0.75)  # 0.10 is not counted
    assert (fedavg["seeds"], fedavg["unfinished"]) == (0, 1)
    text = to_markdown(table)
    assert "| fedex-lora | 2 (+1 unfinished) | 0.7500 ± 0.0707 |" in text
    fedavg_line = next(x for x in text.splitlines() if x.startswith("| fedavg-lora"))
    cells = [c.strip() for c in fedavg_line.strip("|").split("|")]
    assert cells[1] == "0 (+1 unfinished)"
    assert cells[2:] == ["unfinished"] * (len(cells) - 2)
    out = tmp_path / "out"
    assert main(["table", *map(str, dirs), "--out", str(out)]) == 0
    assert "unfinished" in (out / "table.md").read_text()


def _tiny_conf(tmp_path):
    from tests.conftest import tiny_run_config

    conf = tmp_path / "tiny.toml"
    values = tiny_run_config(
        tmp_path, **{"num-server-rounds": 1, "local-steps": 1, "num-partitions": 2}
    )
    del values["output-dir"], values["seed"]
    conf.write_text(
        "".join(
            f"{k} = {json.dumps(v) if isinstance(v, str) else v}\n"
            for k, v in values.items()
        )
    )
    return conf


class _Lines(logging.Handler):
    """The messages of the logger it is added to."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_sweep_resumes_skipping_finished_cells(tmp_path, assets, monkeypatch, capfd):
    """Ctrl-C stops the sweep; a rerun skips finished cells, resumes the rest."""
    import fedlr.launch.compare as compare

    conf, out = _tiny_conf(tmp_path), tmp_path / "sweep"
    argv = ["run", "--conf", str(conf), "--methods", "fedavg-lora", "--seeds", "0,1"]
    argv += ["--out", str(out), "--engine", "inprocess"]
    real = compare.run_in_process

    def interrupted_at_seed_1(config, **kw):
        if config["seed"] == 1:
            raise KeyboardInterrupt
        return real(config, **kw)

    monkeypatch.setattr(compare, "run_in_process", interrupted_at_seed_1)
    capfd.readouterr()
    assert main(argv) == 130
    err = capfd.readouterr().err
    (line,) = [x for x in err.splitlines() if "interrupted" in x]
    assert "1 of 2 cells finished" in line and "again to resume" in line
    assert "Traceback" not in err
    seed0 = out / "runs" / "fedavg-lora-seed0"
    (first,) = [p.parent for p in seed0.glob("*/summary.json")]

    monkeypatch.setattr(compare, "run_in_process", real)
    flower_lines = _Lines()
    logging.getLogger("flwr").addHandler(flower_lines)
    try:
        assert main(argv) == 0
    finally:
        logging.getLogger("flwr").removeHandler(flower_lines)
    assert [p.parent for p in seed0.glob("*/results.csv")] == [first]  # skipped
    err = capfd.readouterr().err
    assert "finished earlier" in err
    # the round line: elapsed time and (on the last round) no ETA
    (line,) = [x for x in flower_lines.messages if "[round 1/1] accuracy" in x]
    assert re.search(r"\d+\.\ds elapsed \d+(m\d\d)?s$", line), line
    seed1 = out / "runs" / "fedavg-lora-seed1"
    (second,) = [p.parent for p in seed1.glob("*/summary.json")]

    # an interrupted cell (rows and checkpoints, no summary.json) continues
    (second / "summary.json").unlink()
    assert main([*argv, "--set", "num-server-rounds=2"]) == 0
    assert [p.parent for p in seed1.glob("*/results.csv")] == [second]
    summary = json.loads((second / "summary.json").read_text())
    assert summary["resumed-after-round"] == 1
    assert pd.read_csv(second / "results.csv")["round"].tolist() == [1, 2]
    runs = collect([first, second])
    assert runs["rounds"].tolist() == [1, 2]


def test_a_bad_cell_is_refused_before_any_cell_runs(tmp_path, capfd):
    conf = tmp_path / "c.toml"
    conf.write_text('method = "fedex-lora"\n')
    out = tmp_path / "out"
    argv = ["run", "--conf", str(conf), "--methods", "fedavg-lora,fedex_lora"]
    code = main([*argv, "--out", str(out), "--engine", "inprocess"])
    err = [x for x in capfd.readouterr().err.splitlines() if x.strip()]
    assert code == 2
    assert len(err) == 1 and "did you mean 'fedex-lora'?" in err[0]
    assert not (out / "runs").exists()  # fedavg-lora did not run either


def test_the_privacy_study_is_the_lora_family_task_with_dp_sgd():
    """Its no-DP column is the lora-dirichlet sweep: the same task exactly."""
    from tests.conftest import ROOT

    conf = ROOT / "benchmarks" / "conf"
    private = read_conf(conf / "privacy.toml")
    plain = read_conf(conf / "lora-family.toml")
    dp = {k: v for k, v in private.items() if k.startswith("dp-")}
    assert dp == {"dp-max-grad-norm": 1.0, "dp-epsilon": 3.0, "dp-delta": 1e-5}
    rest = {k: v for k, v in private.items() if not k.startswith("dp-")}
    assert {k: v for k, v in rest.items() if k != "method"} == {
        k: v for k, v in plain.items() if k != "method"
    }


def test_in_process_runs_print_flower_lines_once_and_drop_library_noise(recwarn):
    import logging
    import warnings

    from fedlr.launch.compare import quiet_in_process

    def noise() -> None:
        logging.getLogger("flwr").info("round 7: aggregated 4 replies")
        warnings.warn_explicit(
            "`is_gradient_checkpointing` is deprecated",
            FutureWarning,
            "modeling_utils.py",
            1,
            module="transformers.modeling_utils",
        )

    class Seen(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    root, seen = logging.getLogger(), Seen()
    root.addHandler(seen)
    try:
        noise()  # without: the root's handler prints Flower's line a second time
        assert seen.lines == ["round 7: aggregated 4 replies"]
        seen.lines.clear()
        with quiet_in_process():
            noise()
        with quiet_in_process(verbose=True):
            noise()
    finally:
        root.removeHandler(seen)
    assert seen.lines == []  # Flower's own handler only
    assert logging.getLogger("flwr").handlers
    deprecations = [w for w in recwarn if issubclass(w.category, FutureWarning)]
    assert len(deprecations) == 2  # the bare call's and the verbose call's


def test_in_process_runs_keep_fedlr_lines_and_drop_flowers_round_lines_without_colour():
    """What `compare run --engine inprocess > log` writes: fedlr's lines, no ANSI."""
    import io
    import logging

    from fedlr.launch.compare import quiet_in_process

    flower = logging.getLogger("flwr")
    console = next(h for h in flower.handlers if hasattr(h, "colored"))
    out = io.StringIO()  # not a terminal
    saved_stream, saved_colour = console.stream, console.colored
    console.stream = out
    try:
        with quiet_in_process():
            flower.info("")
            flower.info("[ROUND 1/6]")
            flower.info("configure_train: Sampled 4 nodes (out of 4)")
            flower.info("aggregate_train: Received 4 results and 0 failures")
            flower.info("fedlr [round 1/6] accuracy 0.7525")
            flower.warning("a client failed")
        inside = out.getvalue()
        out.seek(0), out.truncate()
        with quiet_in_process(verbose=True):
            flower.info("configure_train: Sampled 4 nodes (out of 4)")
        verbose = out.getvalue()
    finally:
        console.stream, console.colored = saved_stream, saved_colour
    lines = inside.splitlines()
    assert [line.split(":", 1)[1].strip() for line in lines] == [
        "fedlr [round 1/6] accuracy 0.7525",
        "a client failed",
    ]
    assert "\x1b[" not in inside and lines[0].startswith("INFO")
    assert "configure_train: Sampled 4 nodes" in verbose and "\x1b[" not in verbose
    assert console.colored == saved_colour  # restored
