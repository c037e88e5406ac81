"""A user's own data set and model, registered by a module the run config names.

The module is tests/plugin_app/extension.py, the one docs/data.md shows; the
``extensions`` key makes every process of the run import it before the rest of
the config is read.
"""

from __future__ import annotations

import re

import pandas as pd
import pytest

from fedlr.config.run import RunConfig
from fedlr.errors import ConfigError
from fedlr.models import VisionModel, build_vision_model, register_model, vision_models
from tests.conftest import ROOT

MODULE = "tests.plugin_app.extension"
_FILE = re.compile(r"<!-- file: (\S+) -->\n```python\n(.*?)```", flags=re.DOTALL)


def _config(output, **overrides):
    config = {
        "method": "fedavg",
        "extensions": MODULE,
        "dataset": "stripes",
        "model": "tiny-cnn",
        "num-server-rounds": 2,
        "local-steps": 5,
        "partitioner": "iid",
        "num-partitions": 2,
        "seed": 3,
        "device": "cpu",
        "output-dir": str(output),
    }
    config.update(overrides)
    return config


def test_the_docs_show_the_extension_module_as_it_is():
    text = (ROOT / "docs" / "data.md").read_text(encoding="utf-8")
    files = dict(_FILE.findall(text))
    path = "tests/plugin_app/extension.py"
    assert files[path] == (ROOT / path).read_text(encoding="utf-8")


def test_extensions_key_registers_the_names_before_the_config_is_read():
    config = RunConfig.from_mapping({"extensions": MODULE, "model": "tiny-cnn"})
    assert config.extensions == MODULE
    assert "tiny-cnn" in vision_models()
    model = build_vision_model("tiny-cnn", (1, 8, 8), 4, seed=0)
    assert isinstance(model, VisionModel) and model.head_layer().out_features == 4


def test_an_extension_that_does_not_import_is_one_config_error():
    with pytest.raises(ConfigError) as info:
        RunConfig.from_mapping({"extensions": "tests.no_such_module"})
    message = str(info.value)
    assert info.value.key == "extensions" and "\n" not in message
    assert "cannot import 'tests.no_such_module'" in message


def test_register_model_refuses_a_taken_name_and_a_builder_of_no_vision_model():
    with pytest.raises(ValueError, match="already registered"):
        register_model("cnn", lambda shape, n: None)  # type: ignore[arg-type,return-value]
    register_model("not-a-vision-model", lambda shape, n: object())  # type: ignore[arg-type,return-value]
    with pytest.raises(ConfigError, match=r"not a fedlr\.models\.VisionModel"):
        build_vision_model("not-a-vision-model", (1, 8, 8), 4, seed=0)


def test_registered_data_and_model_train_in_process(tmp_path):
    from fedlr.launch.local import run_in_process

    run = run_in_process(_config(tmp_path), num_nodes=2)
    frame = pd.read_csv(run / "results.csv")
    assert frame["round"].tolist() == [1, 2]
    assert frame["clients"].tolist() == [2, 2]
    assert frame["accuracy"].iloc[-1] > 0.5  # 4 classes: chance is 0.25


@pytest.mark.slow
def test_registered_data_and_model_run_under_flwr_run(tmp_path, flwr_home):
    """Server and SuperNodes are other processes: each imports the module."""
    from fedlr.launch.flwr_run import flwr_run

    config = _config(tmp_path)
    config.pop("num-partitions")  # the node config says how many
    outcome = flwr_run(
        ROOT,
        flwr_home=flwr_home,
        run_config=config,
        federation_config={"num-supernodes": 2},
        timeout=600,
    )
    assert outcome.status == "finished:completed"
    (results,) = tmp_path.glob("*/results.csv")
    frame = pd.read_csv(results)
    assert frame["clients"].tolist() == [2, 2]
    assert (frame["dropped"] == 0).all()
    assert frame["accuracy"].iloc[-1] > 0.5
