"""What a person reads: the ServerApp's start-up and round lines, summary.json's
code version and headline metric, and the plots' titles, labels and legends.

The plot tests draw small synthetic run directories (``results.csv``,
``summary.json``, ``config.json``); the console tests run tiny in-process
runs and read their log.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fedlr.config.run import RunConfig
from fedlr.runs.plots import (
    EPSILON_PANELS,
    FOLDED_GAP_TITLE,
    epsilon_figure,
    figures,
    load_run,
    plot_runs,
    run_labels,
)
from fedlr.runs.results import COLUMNS, ResultsWriter
from fedlr.runs.table import comparison_figure
from fedlr.runs.tracking import code_version
from fedlr.server_apps.runner import REPRODUCIBLE, guarantee_lines
from tests.conftest import tiny_run_config

ROUND_LINE = re.compile(r"fedlr \[round (\d+)/(\d+)\] (.*)")


@pytest.fixture(autouse=True)
def _close_figures():
    import matplotlib.pyplot as plt

    yield
    plt.close("all")


def _run_dir(
    root: Path,
    name: str,
    method: str,
    config: dict[str, Any],
    *,
    summary: dict[str, Any] | None = None,
    accuracy: float = 0.6,
    extra: dict[str, list[float]] | None = None,
    rounds: int = 3,
) -> Path:
    """A synthetic finished run: results.csv, config.json, summary.json."""
    run_dir = root / name
    columns = tuple(k for k in extra or {} if k not in COLUMNS)
    writer = ResultsWriter(
        run_dir,
        method=method,
        config={"method": method, **config},
        extra_columns=columns,
    )
    for t in range(1, rounds + 1):
        row: dict[str, Any] = {
            "round": t,
            "accuracy": accuracy + 0.01 * t,
            "loss": 1.0 / t,
            "frobenius-gap": 0.1 / t,
            "bytes-up": 1e6,
            "bytes-down": 2e6,
        }
        for key, values in (extra or {}).items():
            row[key] = values[t - 1]
        writer.append(row)
    writer.close()
    (run_dir / "summary.json").write_text(
        json.dumps({"initial-accuracy": 0.5, "initial-loss": 1.5, **(summary or {})})
    )
    return run_dir


def _legend_texts(ax: Any) -> list[str]:
    legend = ax.get_legend()
    assert legend is not None
    return [t.get_text() for t in legend.get_texts()]


def _legend_outside(fig: Any) -> None:
    """Every legend lies below its panel's data area."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        box = legend.get_window_extent(renderer)
        area = ax.get_window_extent(renderer)
        assert box.y1 <= area.y0 + 1e-6, (ax.get_title(), box, area)


# ---------------------------------------------------------------- the labels


def test_runs_are_labelled_by_the_keys_that_differ(tmp_path: Path) -> None:
    common = {"seed": 0, "lora-rank": 4, "output-dir": str(tmp_path / "x")}
    a = _run_dir(tmp_path, "a" * 60, "fedex-lora", {**common, "lr": 0.01})
    b = _run_dir(tmp_path, "b" * 60, "fedex-lora", {**common, "lr": 0.003})
    runs = [load_run(a), load_run(b)]
    assert run_labels(runs) == ["fedex-lora lr=0.01", "fedex-lora lr=0.003"]
    fig = figures(runs)["accuracy_loss.png"]
    for ax in fig.axes:
        assert _legend_texts(ax) == ["fedex-lora lr=0.01", "fedex-lora lr=0.003"]
    _legend_outside(fig)
    # a method's own option (only one run has it) does not label it
    own = _run_dir(tmp_path, "own", "fedspec", {**common, "lr": 0.01, "fedspec-x": 1})
    assert run_labels([load_run(a), load_run(own)]) == ["fedex-lora", "fedspec"]
    # same method, same config: the directory names tell them apart
    c = _run_dir(tmp_path, "c", "fedex-lora", {**common, "lr": 0.01})
    labels = run_labels([load_run(a), load_run(c)])
    assert labels[0] != labels[1] and labels[1].endswith("(c)")


def test_comparison_labels_say_what_differs_and_pool_the_seeds(tmp_path: Path) -> None:
    dirs = [
        _run_dir(tmp_path, f"r{lr}-{seed}", "fedavg-lora", {"seed": seed, "lr": lr})
        for lr in (0.01, 0.003)
        for seed in (0, 1)
    ]
    fig = comparison_figure(dirs)
    for ax in fig.axes:
        assert _legend_texts(ax) == [
            "fedavg-lora lr=0.01 (n=2)",
            "fedavg-lora lr=0.003 (n=2)",
        ]
    _legend_outside(fig)


# ------------------------------------------------------- personalised accuracy


def _family(tmp_path: Path) -> list[Path]:
    """A global method, a folding one and a personalised one."""
    return [
        _run_dir(tmp_path, "avg", "fedavg-lora", {"seed": 0}, accuracy=0.6),
        _run_dir(
            tmp_path,
            "fedex",
            "fedex-lora",
            {"seed": 0},
            summary={"folds-base": True, "evaluation": "global"},
        ),
        _run_dir(
            tmp_path,
            "fedsa",
            "fedsa-lora",
            {"seed": 0},
            accuracy=0.8,
            extra={"personal-clients": [3.0, 3.0, 3.0]},
        ),
    ]


def test_comparison_puts_personalised_accuracy_on_its_own_panel(tmp_path: Path) -> None:
    fig = comparison_figure(_family(tmp_path))
    titles = [ax.get_title() for ax in fig.axes]
    assert len(fig.axes) == 3
    assert titles[0].startswith("accuracy of the global model")
    assert titles[1].startswith("personalised accuracy")
    assert "each on its own held-out part" in titles[1]
    global_ax, personal_ax, gap_ax = fig.axes
    assert _legend_texts(global_ax) == ["fedavg-lora (n=1)", "fedex-lora (n=1)"]
    assert _legend_texts(personal_ax) == ["fedsa-lora [personalised] (n=1)"]
    # fedsa's 0.81-0.83 are not on the global models' axis
    tops = [max(line.get_ydata()) for line in global_ax.get_lines()]
    assert max(tops) < 0.7
    assert "before the fold" in gap_ax.get_title()
    styles = {
        line.get_label(): line.get_linestyle()
        for line in gap_ax.get_lines()
        if line.get_label().startswith("fed")
    }
    assert styles["fedex-lora (n=1)"] == "--"
    assert styles["fedavg-lora (n=1)"] == "-"


def test_run_plots_dash_and_label_personalised_accuracy(tmp_path: Path) -> None:
    runs = [load_run(d) for d in _family(tmp_path)]
    assert [r.personalised for r in runs] == [False, False, True]
    acc = figures(runs)["accuracy_loss.png"].axes[0]
    assert "dashed: personalised" in acc.get_title()
    styles = {line.get_label(): line.get_linestyle() for line in acc.get_lines()}
    assert styles["fedsa-lora [personalised]"] == "--"
    assert styles["fedavg-lora"] == "-"
    alone = figures([runs[2]])["accuracy_loss.png"].axes[0]
    assert "personalised: mean over clients" in alone.get_title()


# ------------------------------------------------------------------ the gap


def test_a_folding_methods_gap_says_it_is_the_gap_before_the_fold(
    tmp_path: Path,
) -> None:
    fedex = _run_dir(tmp_path, "fedex", "fedex-lora", {}, summary={"folds-base": True})
    ax = figures([load_run(fedex)])["gap.png"].axes[0]
    assert ax.get_title() == FOLDED_GAP_TITLE
    assert "before the fold" in ax.get_title() and "exact" in ax.get_title()
    plain = _run_dir(tmp_path, "avg", "fedavg-lora", {}, summary={"folds-base": False})
    ax = figures([load_run(plain)])["gap.png"].axes[0]
    assert "fold" not in ax.get_title()
    assert ax.get_title().startswith("Frobenius gap")


def test_iloras_gap_is_not_called_folded(tmp_path: Path) -> None:
    """ILoRA moves W once, at initialisation (docs/methods/ilora.md: W
    unchanged by aggregation): its gap is what the clients receive, so the
    title makes no claim of a fold that makes the model exact."""
    from fedlr.strategies.registry import available_methods

    available_methods()  # the registry loaded, as in the ServerApp
    run = _run_dir(tmp_path, "ilora", "ilora", {}, summary={"folds-base": True})
    ax = figures([load_run(run)])["gap.png"].axes[0]
    assert ax.get_title().startswith("Frobenius gap") and "exact" not in ax.get_title()


# ----------------------------------------------------------------- epsilon


def test_epsilon_panel_per_dp_column(tmp_path: Path) -> None:
    eps = {"dp-epsilon": [0.5, 0.9, 1.2], "client-dp-epsilon": [2.0, 3.0, 4.0]}
    run_dir = _run_dir(tmp_path, "dp", "fedavg-lora", {}, extra=eps)
    fig = epsilon_figure([load_run(run_dir)])
    assert [ax.get_title() for ax in fig.axes] == list(EPSILON_PANELS.values())
    assert [list(ax.get_lines()[0].get_ydata()) for ax in fig.axes] == [
        [0.5, 0.9, 1.2],
        [2.0, 3.0, 4.0],
    ]
    no_dp = _run_dir(tmp_path, "plain", "fedavg-lora", {})
    assert "epsilon.png" not in figures([load_run(no_dp)])


# ------------------------------------------------------------- start-up lines


def _config(**values: Any) -> RunConfig:
    return RunConfig.from_mapping({"method": "fedavg-lora", **values})


def test_guarantee_lines_name_every_mechanism_and_its_settings() -> None:
    lines = guarantee_lines(
        _config(
            **{
                "dp-max-grad-norm": 0.5,
                "dp-epsilon": 3.0,
                "client-dp-clip": 0.1,
                "client-dp-noise-multiplier": 1.3,
                "robust": "trimmed-mean",
                "reproducible-noise": True,
            }
        ),
        nodes=4,
    )
    dp, client, robust, screen, seeded = lines
    assert dp.startswith("DP-SGD") and "clip 0.5" in dp
    assert "budget epsilon 3" in dp and "accountant prv" in dp
    assert "own limits" in dp and "may refuse" in dp
    assert "clip 0.1" in client and "z 1.3" in client
    assert "delta 1e-05" in client and "central" in client
    assert robust == "robust aggregation: trimmed-mean leaving out 0.2 of the clients"
    assert screen.startswith("update-size screen") and "20x" in screen
    assert seeded.startswith(REPRODUCIBLE)
    assert guarantee_lines(_config(**{"screen-ratio": 0.0}), nodes=4) == []


def test_guarantee_line_of_centred_clipping_names_its_bound_and_buckets() -> None:
    lines = guarantee_lines(
        _config(robust="centred-clip", **{"clip-ratio": 2.0, "bucket-size": 2}),
        nodes=4,
    )
    assert lines[0] == (
        "robust aggregation: centred clipping at 2 x the median distance to "
        "the geometric median, buckets of 2"
    )
    plain = guarantee_lines(_config(robust="centred-clip", **{"clip-norm": 0.5}), 4)
    assert plain[0] == "robust aggregation: centred clipping at 0.5"


def test_guarantee_lines_under_secagg_say_distributed_and_the_shares() -> None:
    config = _config(
        **{
            "secure-aggregation": True,
            "client-dp-clip": 1.0,
            "client-dp-noise-multiplier": 1.0,
            "secagg-clipping-range": 16.0,
        }
    )
    exchange: Any = SimpleNamespace(settings=config.secagg)
    client, secagg = guarantee_lines(config, nodes=4, exchange=exchange)
    assert "distributed under SecAgg+" in client
    assert secagg == (
        "SecAgg+ on every train round (the server sees only the sum): 4 shares "
        "of 4 clients, threshold 3, clipping range [-16, 16], 4194304 "
        "quantisation levels"
    )


def _round_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if ROUND_LINE.match(r.getMessage())]


@pytest.mark.slow  # a subprocess or a whole run: the integration stage
@pytest.mark.usefixtures("assets")
def test_a_dp_run_shows_its_guarantee_and_epsilon_every_round(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from fedlr.launch.local import run_in_process

    config = tiny_run_config(
        tmp_path,
        method="fedavg-lora",
        **{"dp-max-grad-norm": 1.0, "dp-noise-multiplier": 1.0},
    )
    with caplog.at_level(logging.INFO):
        run_dir = run_in_process(config)
    messages = [r.getMessage() for r in caplog.records]
    startup = [m for m in messages if m.startswith("fedlr: DP-SGD")]
    assert len(startup) == 1
    assert "clip 1, sigma 1," in startup[0] and "accountant prv" in startup[0]
    rounds = _round_lines(caplog)
    assert len(rounds) == 2
    results = json.loads((run_dir / "summary.json").read_text())
    for line in rounds:
        spent = re.search(r" dp-epsilon (\d\S*)", line)
        assert spent is not None, line
        assert float(spent.group(1)) > 0
    assert float(re.search(r" dp-epsilon (\S+)", rounds[-1]).group(1)) == (  # type: ignore[union-attr]
        pytest.approx(results["dp-epsilon"], rel=1e-2)
    )
    final = [m for m in messages if m.startswith("fedlr: finished")]
    assert final and final[0].startswith("fedlr: finished, final accuracy ")
    assert results["headline-metric"] == "accuracy"
    assert (run_dir / "epsilon.png").stat().st_size > 5000
    fig = figures([load_run(run_dir)])["epsilon.png"]
    assert [ax.get_title() for ax in fig.axes] == [EPSILON_PANELS["dp-epsilon"]]


@pytest.mark.slow  # a subprocess or a whole run: the integration stage
@pytest.mark.usefixtures("assets")
def test_a_causal_lm_runs_last_line_names_exact_match(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from fedlr.launch.local import run_in_process

    config = {
        "method": "fedavg-lora",
        "model": "tiny-gpt2",
        "dataset": "arith-instruct",
        "num-partitions": 2,
        "partitioner": "iid",
        "num-server-rounds": 1,
        "local-steps": 1,
        "batch-size": 4,
        "max-length": 96,
        "max-eval-examples": 4,
        "max-new-tokens": 4,
        "lora-rank": 2,
        "lora-alpha": 4.0,
        "target-modules": "all-linear",
        "seed": 3,
        "device": "cpu",
        "output-dir": str(tmp_path),
    }
    with caplog.at_level(logging.INFO):
        run_dir = run_in_process(config)
    final = [
        r.getMessage() for r in caplog.records if "finished, final" in r.getMessage()
    ]
    assert len(final) == 1 and "final exact-match " in final[0]
    assert "accuracy" not in final[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["headline-metric"] == "exact-match"
    value = float(re.search(r"exact-match (\S+);", final[0]).group(1))  # type: ignore[union-attr]
    assert value == pytest.approx(summary["final-exact-match"], abs=1e-4)


# --------------------------------------------------------------- code version

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(cwd: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


@needs_git
def test_code_version_is_git_describe_of_the_checkout(tmp_path: Path) -> None:
    package = tmp_path / "checkout" / "fedlr"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    checkout = package.parent
    _git(checkout, "init", "-q")
    _git(checkout, "add", ".")
    _git(checkout, "commit", "-q", "-m", "one")
    commit = _git(checkout, "rev-parse", "--short", "HEAD")
    assert code_version([package]) == f"git {commit}"
    (package / "__init__.py").write_text("x = 1\n")
    assert code_version([package]) == f"git {commit}-dirty"
    # an untracked copy inside the work tree (flwr run's app copy) does not count
    copy = checkout / ".flwr" / "fedlr"
    copy.mkdir(parents=True)
    (copy / "__init__.py").write_text("")
    assert code_version([copy]) == f"fedlr {version('fedlr')}"
    assert code_version([copy, package]) == f"git {commit}-dirty"


def test_code_version_falls_back_to_the_package_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "fedlr"
    package.mkdir()
    (package / "__init__.py").write_text("")
    assert code_version([package]) == f"fedlr {version('fedlr')}"
    monkeypatch.setenv("PATH", str(tmp_path / "no-git-here"))  # git missing
    assert code_version() == f"fedlr {version('fedlr')}"


def test_plot_files_of_a_personalised_family_are_written(tmp_path: Path) -> None:
    written = plot_runs(_family(tmp_path), tmp_path / "plots")
    assert sorted(p.name for p in written) == [
        "accuracy_loss.png",
        "bytes.png",
        "gap.png",
    ]
    assert all(p.stat().st_size > 5000 for p in written)
