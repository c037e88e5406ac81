"""RunConfig: typed parsing, bad types and unknown keys name their key.

The pyproject table and docs/configuration.md are generated from the
declarations (tests/unit/test_configdoc.py); the out-of-range values each key
refuses are its declaration's ``bad`` values (tests/unit/test_config_errors.py).
"""

from __future__ import annotations

import pytest

from fedlr.config.run import RunConfig
from fedlr.errors import ConfigError, UnknownMethodError


def test_round_trip_and_types():
    cfg = RunConfig.from_mapping({"lr": 1, "lora-rank": 4, "target-modules": "q, v"})
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)
    assert cfg.targets == ("q", "v")
    assert RunConfig.from_mapping(cfg.to_mapping()) == cfg


BAD = [
    ("batch-size", 1.5, "expected an integer"),
    ("seed", True, "expected an integer"),
    ("lr", "fast", "expected a number"),
    ("method", 3, "expected a string"),
    ("gradient-checkpointing", 1, "expected true/false"),
    ("no-such-key", 1, "unknown key"),
]


@pytest.mark.parametrize(("key", "value", "message"), BAD)
def test_bad_value_names_the_key(key, value, message):
    with pytest.raises(ConfigError, match=message) as info:
        RunConfig.from_mapping({key: value}, method_keys=())
    assert info.value.key == key
    assert f"'{key}'" in str(info.value)


def test_unknown_keys_are_refused_where_every_method_is_known():
    """RunConfig knows no method: alone it leaves other keys to the method's
    options; with the methods' keys (what the registry's resolve passes) it
    refuses a key none declares, suggesting the closest."""
    from fedlr.strategies.registry import all_option_keys, resolve

    assert RunConfig.from_mapping({"fedspec-threshold": 0.5, "zzz": 1}) == RunConfig()
    with pytest.raises(ConfigError, match="did you mean 'fedspec-threshold'") as info:
        resolve({"fedspec-treshold": 0.5})
    assert info.value.key == "fedspec-treshold"
    with pytest.raises(ConfigError, match="did you mean 'num-server-rounds'"):
        RunConfig.from_mapping({"num-server-round": 3}, method_keys=all_option_keys())
    assert resolve(
        {"method": "fedavg-lora", "robust": "none", "fedspec-threshold": 0.5}
    ).run == RunConfig(method="fedavg-lora", robust="none")


def test_unknown_method_lists_known_ones():
    from fedlr.strategies import get_method

    with pytest.raises(UnknownMethodError, match=r"known methods: .*fedex-lora"):
        get_method("fedx-lora")


def test_task_rejects_image_and_unknown_datasets_at_start(assets):
    from fedlr.data import UnknownDatasetError
    from fedlr.tasks.text import TextTask

    with pytest.raises(
        ConfigError, match=r"'digits' is not a text data set \(kind: image\)"
    ) as info:
        TextTask(RunConfig(dataset="digits"))
    assert info.value.key == "dataset" and "polarity" in str(info.value)
    with pytest.raises(UnknownDatasetError, match="polarity"):
        TextTask(RunConfig(dataset="imdbb"))
