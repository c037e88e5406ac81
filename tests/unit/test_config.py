"""RunConfig: defaults agree with pyproject.toml, bad values name their key."""

from __future__ import annotations

import tomllib

import pytest

from fedlr.config import RunConfig
from fedlr.errors import ConfigError, UnknownMethodError
from tests.conftest import ROOT


def _pyproject_config() -> dict[str, object]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return dict(data["tool"]["flwr"]["app"]["config"])


def test_every_pyproject_key_is_a_common_key_or_a_method_option_with_its_default():
    from fedlr.strategies.registry import option_defaults

    table = _pyproject_config()
    assert RunConfig.from_mapping(table) == RunConfig()
    expected = {**RunConfig().to_mapping(), **option_defaults()}
    assert set(table) == set(expected), sorted(set(table) ^ set(expected))
    for key, default in expected.items():
        assert table[key] == default, (key, table[key], default)


def test_configuration_docs_list_every_key():
    from fedlr.strategies.registry import option_defaults

    doc = (ROOT / "docs" / "configuration.md").read_text()
    keys = {*RunConfig.option_fields(), *option_defaults()}
    missing = sorted(k for k in keys if f"| `{k}` |" not in doc)
    assert not missing, f"docs/configuration.md lacks {missing}"


def test_round_trip_and_types():
    cfg = RunConfig.from_mapping({"lr": 1, "lora-rank": 4, "target-modules": "q, v"})
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)
    assert cfg.targets == ("q", "v")
    assert RunConfig.from_mapping(cfg.to_mapping()) == cfg


BAD = [
    ("num-server-rounds", 0, "must be >= 1"),
    ("local-steps", -3, "must be >= 1"),
    ("lora-rank", 0, "must be >= 1"),
    ("batch-size", 1.5, "expected an integer"),
    ("lr", -0.1, "finite and > 0"),
    ("lr", "fast", "expected a number"),
    ("lora-alpha", 0.0, "finite and > 0"),
    ("dirichlet-alpha", -1.0, "finite and > 0"),
    ("lora-dropout", 1.0, r"in \[0, 1\)"),
    ("eval-fraction", 1.0, r"in \(0, 1\)"),
    ("fraction-train", 0.0, r"in \(0, 1\]"),
    ("max-length", 4, r"in \[8, 4096\]"),
    ("partitioner", "random", "not one of iid, dirichlet, pathological"),
    ("pooling", "max", "not one of mean, cls"),
    ("device", "tpu", "not one of"),
    ("output-dir", "relative/path", "absolute path"),
    ("seed", -1, r"must be in \[0, 2\*\*32\)"),
    ("seed", 2**32, r"must be in \[0, 2\*\*32\)"),
    ("target-modules", " , ", "names no module"),
    ("method", 3, "expected a string"),
    ("no-such-key", 1, "unknown key"),
]


@pytest.mark.parametrize(("key", "value", "message"), BAD)
def test_bad_value_names_the_key(key, value, message):
    with pytest.raises(ConfigError, match=message) as info:
        RunConfig.from_mapping({key: value})
    assert info.value.key == key
    assert f"'{key}'" in str(info.value)


def test_unknown_method_lists_known_ones():
    from fedlr.strategies import get_method

    with pytest.raises(UnknownMethodError, match=r"known methods: .*fedex-lora"):
        get_method("fedx-lora")


def test_task_rejects_image_and_unknown_datasets_at_start(assets):
    from fedlr.data import UnknownDatasetError
    from fedlr.tasks import TextTask

    with pytest.raises(
        ConfigError, match=r"'digits' is not a text data set \(kind: image\)"
    ) as info:
        TextTask(RunConfig(dataset="digits"))
    assert info.value.key == "dataset" and "polarity" in str(info.value)
    with pytest.raises(UnknownDatasetError, match="polarity"):
        TextTask(RunConfig(dataset="imdbb"))
