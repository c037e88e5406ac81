"""Trackers fed by the results writer, read back with each tool's own reader.

TensorBoard's event files are read with tensorboard's ``EventAccumulator``,
MLflow's file store with ``MlflowClient``: every finite number of every row
the writer appends arrives at its round, NaN cells are left out, the settings
arrive once.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fedlr.config.run import TRACKERS, RunConfig
from fedlr.errors import ConfigError
from fedlr.runs.results import ResultsWriter
from fedlr.runs.tracking import (
    MlflowTracker,
    NoTracker,
    TensorBoardTracker,
    code_version,
    numeric_metrics,
    open_tracker,
)

SETTINGS = {"method": "fedavg-lora", "lora-rank": 4, "lr": 0.01}
ROWS = [
    {"round": 1, "accuracy": 0.5, "loss": 0.69, "bytes-up": 1000.0, "rank": 4},
    {"round": 2, "accuracy": math.nan, "loss": 0.61, "bytes-up": 2000.0, "rank": 4},
    {"round": 3, "accuracy": 0.75, "loss": 0.52, "bytes-up": 3000.0, "rank": 6},
]


def _write(run_dir: Path, tracker_name: str) -> ResultsWriter:
    tracker = open_tracker(tracker_name, run_dir)
    writer = ResultsWriter(
        run_dir, method="fedavg-lora", config=SETTINGS, tracker=tracker
    )
    for row in ROWS:
        writer.append(row)
    writer.close()
    return writer


def test_numeric_metrics_keeps_finite_numbers_only() -> None:
    row = {"a": 1, "b": 0.5, "c": math.nan, "d": math.inf, "e": "x", "f": True}
    assert numeric_metrics(row) == {"a": 1.0, "b": 0.5}
    typed = numeric_metrics({"n": np.int64(3), "x": np.float32(0.25)})
    assert typed == {"n": 3.0, "x": 0.25}
    assert all(type(v) is float for v in typed.values())


def test_tensorboard_events_hold_every_row(tmp_path: Path) -> None:
    writer = _write(tmp_path, "tensorboard")
    assert isinstance(writer.tracker, TensorBoardTracker)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"accuracy", "loss", "bytes-up", "rank"} <= set(scalars)
    assert "round" not in scalars
    loss = [(e.step, e.value) for e in events.Scalars("loss")]
    assert loss == [(1, pytest.approx(0.69)), (2, pytest.approx(0.61)),
                    (3, pytest.approx(0.52))]  # fmt: skip
    accuracy = [(e.step, e.value) for e in events.Scalars("accuracy")]
    assert accuracy == [(1, 0.5), (3, 0.75)]  # round 2's NaN is left out
    assert [e.value for e in events.Scalars("rank")] == [4.0, 4.0, 6.0]
    text = events.Tensors("settings/text_summary")[0].tensor_proto.string_val[0]
    assert b"lora-rank" in text and b"0.01" in text


def test_tensorboard_resume_purges_the_steps_after_the_checkpoint(
    tmp_path: Path,
) -> None:
    _write(tmp_path, "tensorboard")
    resumed = ResultsWriter(
        tmp_path,
        method="fedavg-lora",
        tracker=open_tracker("tensorboard", tmp_path, resume_step=3),
    )
    resumed.append({"round": 3, "accuracy": 0.25, "loss": 0.4})
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    accuracy = [(e.step, e.value) for e in events.Scalars("accuracy")]
    assert accuracy == [(1, 0.5), (3, 0.25)]


def test_mlflow_file_store_holds_params_and_metric_histories(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    writer = _write(tmp_path, "mlflow")
    tracker = writer.tracker
    assert isinstance(tracker, MlflowTracker)
    assert tracker.tracking_uri == (tmp_path / "mlruns").resolve().as_uri()
    client = MlflowClient(tracking_uri=tracker.tracking_uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == tmp_path.name
    assert run.data.params == {k: str(v) for k, v in SETTINGS.items()}
    history = client.get_metric_history(tracker.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(1, 0.69), (2, 0.61), (3, 0.52)]
    accuracy = client.get_metric_history(tracker.run_id, "accuracy")
    assert [(m.step, m.value) for m in accuracy] == [(1, 0.5), (3, 0.75)]
    assert run.data.metrics["bytes-up"] == 3000.0  # the latest value


def test_none_tracker_writes_nothing_besides_the_csv(tmp_path: Path) -> None:
    writer = _write(tmp_path, "none")
    assert isinstance(writer.tracker, NoTracker)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "results.csv"]


@pytest.mark.skipif(
    importlib.util.find_spec("wandb") is not None,
    reason="wandb is installed here: the missing-package message cannot show",
)
def test_wandb_without_the_package_is_a_one_line_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="pip install wandb") as err:
        open_tracker("wandb", tmp_path)
    assert "\n" not in str(err.value) and err.value.key == "tracker"


def test_tracker_option_is_checked() -> None:
    assert RunConfig().tracker == "none"
    for name in TRACKERS:
        assert RunConfig.from_mapping({"tracker": name}).tracker == name
    with pytest.raises(ConfigError, match="not one of"):
        RunConfig.from_mapping({"tracker": "neptune"})
    with pytest.raises(ConfigError, match="not one of"):
        open_tracker("neptune", Path("/nonexistent"))


def test_code_version_names_a_commit_or_a_version() -> None:
    version = code_version()
    assert version.startswith(("git ", "fedlr ")) and len(version) > 5
