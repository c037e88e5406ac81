"""Results writer and the `flwr run` launcher's pure helpers."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from fedlr.errors import CheckpointError
from fedlr.launch.flwr_run import format_run_config
from fedlr.runs.results import COLUMNS, ResultsWriter, read_results


def test_writer_appends_rows(tmp_path):
    writer = ResultsWriter(tmp_path / "run", method="fedex-lora", config={"lr": 0.1})
    writer.append({"round": 1, "accuracy": 0.5, "frobenius-gap": 0.2})
    writer.append(
        {"round": 2, "accuracy": 0.6}, layers={"l0": (0.1, 0.01), "l1": (0.2, 0.02)}
    )
    frame = read_results(tmp_path / "run")
    assert list(frame.columns) == list(COLUMNS)
    assert frame["round"].tolist() == [1, 2]
    assert frame["method"].tolist() == ["fedex-lora", "fedex-lora"]
    assert frame["accuracy"].tolist() == [0.5, 0.6]
    assert math.isnan(frame["frobenius-gap"].iloc[1])
    layers = pd.read_csv(tmp_path / "run" / "layers.csv")
    assert layers["layer"].tolist() == ["l0", "l1"] and (layers["round"] == 2).all()
    assert (tmp_path / "run" / "config.json").read_text().strip().startswith("{")
    assert not list((tmp_path / "run").glob("*.tmp"))


def test_writer_rejects_unknown_columns_and_missing_round(tmp_path):
    writer = ResultsWriter(tmp_path, method="m")
    with pytest.raises(KeyError, match="unknown result columns"):
        writer.append({"round": 1, "acc": 0.5})
    with pytest.raises(KeyError, match="needs 'round'"):
        writer.append({"accuracy": 0.5})
    with pytest.raises(FileNotFoundError, match=r"no results\.csv"):
        read_results(tmp_path / "nowhere")


def test_run_config_is_rendered_as_toml_pairs():
    text = format_run_config(
        {"method": "fedex-lora", "lr": 0.001, "num-server-rounds": 3, "x": True}
    )
    assert text == 'method="fedex-lora" lr=0.001 num-server-rounds=3 x=true'
    import tomllib

    parsed = tomllib.loads(text.replace(" ", "\n"))
    assert parsed == {
        "method": "fedex-lora",
        "lr": 0.001,
        "num-server-rounds": 3,
        "x": True,
    }


def test_extra_columns_follow_the_core_columns_in_declared_order(tmp_path):
    writer = ResultsWriter(
        tmp_path, method="m", extra_columns=("tail-energy", "accuracy-std")
    )
    writer.append({"round": 1, "accuracy": 0.5, "tail-energy": 0.25})
    frame = read_results(tmp_path)
    assert list(frame.columns) == [*COLUMNS, "tail-energy", "accuracy-std"]
    assert frame["tail-energy"].tolist() == [0.25]
    assert frame["accuracy-std"].isna().all()
    with pytest.raises(KeyError, match="unknown result columns"):
        writer.append({"round": 2, "tail-energi": 0.1})


def test_extra_columns_may_not_repeat_core_columns(tmp_path):
    with pytest.raises(ValueError, match="repeat a column"):
        ResultsWriter(tmp_path, method="m", extra_columns=("accuracy",))
    with pytest.raises(ValueError, match="repeat a column"):
        ResultsWriter(tmp_path, method="m", extra_columns=("x", "x"))


def test_append_writes_one_line_per_round_not_the_whole_file(tmp_path):
    """Bookkeeping is linear in the run: each round adds its own lines only."""
    writer = ResultsWriter(tmp_path, method="fedavg-lora")
    writer.append({"round": 1, "accuracy": 0.5}, layers={"l0": (0.1, 0.01)})
    first = (tmp_path / "results.csv").read_bytes()
    first_layers = (tmp_path / "layers.csv").read_bytes()
    writer.append({"round": 2, "accuracy": 0.6}, layers={"l0": (0.2, 0.02)})
    after = (tmp_path / "results.csv").read_bytes()
    assert after.startswith(first) and after.count(b"\n") == 3  # header + 2
    layers = (tmp_path / "layers.csv").read_bytes()
    assert layers.startswith(first_layers) and layers.count(b"\n") == 3


def test_restore_keeps_the_checkpointed_rounds_and_drops_a_torn_line(tmp_path):
    writer = ResultsWriter(tmp_path, method="fedavg-lora")
    for r in (1, 2, 3):
        writer.append({"round": r, "accuracy": 0.1 * r}, layers={"l0": (r, 0.0)})
    with (tmp_path / "results.csv").open("a") as f:
        f.write("1")  # a crash while appending round 4 (or 12...)
    resumed = ResultsWriter(tmp_path, method="fedavg-lora")
    resumed.restore(2)  # the newest checkpoint is after round 2
    frame = read_results(tmp_path)
    assert frame["round"].tolist() == [1, 2]
    assert frame["accuracy"].tolist() == pytest.approx([0.1, 0.2])
    assert pd.read_csv(tmp_path / "layers.csv")["round"].tolist() == [1, 2]
    resumed.append({"round": 3, "accuracy": 0.9})
    assert read_results(tmp_path)["round"].tolist() == [1, 2, 3]


def test_restore_refuses_a_results_file_without_the_checkpointed_rounds(tmp_path):
    writer = ResultsWriter(tmp_path, method="fedavg-lora")
    writer.append({"round": 1, "accuracy": 0.5})
    with pytest.raises(CheckpointError, match=r"rounds \[2, 3\] are missing"):
        ResultsWriter(tmp_path, method="fedavg-lora").restore(3)


def test_restore_takes_the_rows_of_an_older_checkpoint(tmp_path):
    rows = [{"round": 1, "accuracy": 0.25}]
    layer_rows = [
        {"round": 1, "layer": "l0", "frobenius-gap": 1.0, "relative-gap": 0.5}
    ]
    ResultsWriter(tmp_path, method="fedavg-lora").restore(1, rows, layer_rows)
    assert read_results(tmp_path)["accuracy"].tolist() == [0.25]
    assert pd.read_csv(tmp_path / "layers.csv")["layer"].tolist() == ["l0"]


def test_counts_are_written_as_integers_and_measures_as_floats(tmp_path):
    writer = ResultsWriter(
        tmp_path, method="m", extra_columns=("bytes-up-rank-2", "tail-energy")
    )
    writer.append(
        {
            "round": 1,
            "accuracy": 1.0,
            "clients": 4.0,
            "dropped": 0.0,
            "bytes-up": 7282848.0,
            "bytes-up-rank-2": 1024.0,
            "tail-energy": 2.0,
        }
    )
    writer.append({"round": 2.0, "clients": 3.0})  # bytes missing: empty, not 'nan'
    header, first, second = (
        (tmp_path / "results.csv").read_text(encoding="utf-8").splitlines()
    )
    row = dict(zip(header.split(","), first.split(","), strict=True))
    assert row["round"] == "1" and row["clients"] == "4" and row["dropped"] == "0"
    assert row["bytes-up"] == "7282848" and row["bytes-up-rank-2"] == "1024"
    assert row["accuracy"] == "1.0" and row["tail-energy"] == "2.0"
    later = dict(zip(header.split(","), second.split(","), strict=True))
    assert later["round"] == "2" and later["clients"] == "3" and later["bytes-up"] == ""
    frame = read_results(tmp_path)
    assert frame["clients"].tolist() == [4, 3]


def test_the_server_evaluated_columns_are_the_protocols_evaluation_metrics():
    from fedlr.runs.results import SERVER_EVALUATED
    from fedlr.wire import protocol

    assert {"accuracy", "loss", *protocol.TASK_EVAL_METRICS} == SERVER_EVALUATED
