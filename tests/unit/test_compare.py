"""The sweep collector: fixture runs -> the table's means and stds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fedlr.compare import (
    collect,
    main,
    parse_overrides,
    read_conf,
    summarise,
    to_markdown,
)
from fedlr.errors import ConfigError
from fedlr.results import ResultsWriter


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
    assert "| fot | iid | 1 | 0.9000 ± 0.0000 | — |" in text
    assert text.splitlines()[0].endswith("| ACC | FGT |")
    out = tmp_path / "out"
    assert (
        main(["table", *map(str, dirs), "--out", str(out), "--by", "partitioner"]) == 0
    )
    assert {p.name for p in out.iterdir()} == {
        "table.md",
        "table.csv",
        "comparison.png",
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
    from fedlr.compare import run_sweep

    conf = tmp_path / "c.toml"
    conf.write_text('method = "fedex-lora"\n')
    with pytest.raises(ConfigError) as info:
        run_sweep(conf, ["fedex-lora"], [0], tmp_path / "out", **kwargs)
    assert info.value.key == key
    assert not (tmp_path / "out").exists()


def test_comparison_figure_shows_loss_when_no_run_has_a_gap(tmp_path):
    from fedlr.compare import comparison_figure

    nan = float("nan")
    vision = [_run(tmp_path / "v", "fedavg", s, [0.5, 0.6], [nan, nan]) for s in (0, 1)]
    fig = comparison_figure(vision)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[1].startswith("evaluation loss")
    assert len(fig.axes[1].get_lines()) == 1  # one group, two seeds
    lora = [_run(tmp_path / "l", "fedavg-lora", 0, [0.5, 0.6], [0.2, 0.1])]
    fig = comparison_figure(lora)
    assert fig.axes[1].get_title().startswith("Frobenius gap")
    assert fig.axes[1].get_yscale() == "log"


def test_flwr_engine_passes_the_gpu_share_and_nodes_to_flwr_run(tmp_path, monkeypatch):
    """`--client-gpus 0.25` reaches `flwr run` as the clients' num-gpus."""
    import fedlr.flower.launch as launch
    from fedlr.compare import run_sweep

    calls = []

    def fake_flwr_run(app_dir, *, flwr_home, run_config, federation_config):
        calls.append((run_config, federation_config))
        run_dir = _run(
            tmp_path / "made", run_config["method"], run_config["seed"], [0.5], [0.1]
        )
        out = Path(run_config["output-dir"]) / run_dir.name
        out.parent.mkdir(parents=True, exist_ok=True)
        run_dir.rename(out)

    monkeypatch.setattr(launch, "flwr_run", fake_flwr_run)
    monkeypatch.setattr(launch, "stop_local_superlinks", lambda home: [])
    conf = tmp_path / "c.toml"
    conf.write_text('method = "fedex-lora"\nnum-partitions = 3\n')
    run_dirs, failures = run_sweep(
        conf, ["fedavg-lora"], [0, 1], tmp_path / "out", client_gpus=0.25
    )
    assert failures == {}
    assert len(run_dirs) == 2
    assert [c[0]["seed"] for c in calls] == [0, 1]
    for _, federation in calls:
        assert federation == {
            "num-supernodes": 3,
            "client-resources-num-gpus": 0.25,
        }
