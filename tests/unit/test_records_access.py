"""Typed access to a message's records: missing or mistyped values are named."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedlr.errors import FedLRError, RecordError, RecordMissingError, RecordTypeError
from fedlr.flower import (
    array_record,
    config_float,
    config_int,
    config_record,
    config_str,
)

CONFIG = ConfigRecord(
    {
        "local-steps": 5,
        "lr": 0.05,
        "lr-int": 1,
        "train-roles": "lora_A,lora_B",
        "word": "abc",
        "flag": True,
        "steps-float": 5.0,
        "sizes": [1, 2],
    }
)


def _content() -> RecordDict:
    return RecordDict(
        {
            "arrays": ArrayRecord([np.zeros(3, dtype=np.float32)]),
            "config": CONFIG,
            "metrics": MetricRecord({"num-examples": 3}),
        }
    )


def test_records_are_returned_when_present():
    content = _content()
    assert array_record(content) is content["arrays"]
    assert config_record(content) is content["config"]


@pytest.mark.parametrize("accessor", [array_record, config_record])
def test_missing_record_is_named(accessor):
    content = RecordDict({"metrics": MetricRecord({"num-examples": 3})})
    with pytest.raises(RecordMissingError, match=r"no \w+Record '(arrays|config)'"):
        accessor(content)
    with pytest.raises(KeyError):  # still a KeyError for existing handlers
        accessor(content)


def test_missing_record_under_another_name():
    with pytest.raises(RecordMissingError, match=r"'bases'.*records: 'arrays'"):
        array_record(_content(), "bases")


def test_wrong_record_kind_is_named():
    content = _content()
    with pytest.raises(
        RecordTypeError, match="record 'config' is a ConfigRecord, expected an Array"
    ):
        array_record(content, "config")
    with pytest.raises(
        RecordTypeError, match="record 'arrays' is an ArrayRecord, expected a Config"
    ):
        config_record(content, "arrays")
    with pytest.raises(TypeError):
        config_record(content, "metrics")


def test_values_are_returned_unchanged():
    assert config_int(CONFIG, "local-steps") == 5
    assert type(config_int(CONFIG, "local-steps")) is int
    assert config_float(CONFIG, "lr") == 0.05
    assert config_float(CONFIG, "lr-int") == 1.0
    assert type(config_float(CONFIG, "lr-int")) is float
    assert config_str(CONFIG, "train-roles") == "lora_A,lora_B"


def test_missing_key_uses_the_default():
    assert config_int(CONFIG, "server-round", 0) == 0
    assert config_int(CONFIG, "gpse-task", -1) == -1
    assert config_float(CONFIG, "momentum", 0.9) == 0.9
    assert type(config_float(CONFIG, "momentum", 1)) is float
    assert config_str(CONFIG, "keep-roles", "") == ""


@pytest.mark.parametrize("accessor", [config_int, config_float, config_str])
def test_missing_key_without_default_is_named(accessor):
    with pytest.raises(
        RecordMissingError, match="config key 'server-round' is missing"
    ) as info:
        accessor(CONFIG, "server-round")
    assert info.value.name == "server-round"
    assert isinstance(info.value, KeyError)
    assert isinstance(info.value, FedLRError)
    assert "local-steps" in str(info.value)  # lists the keys that are there


def test_present_key_ignores_the_default():
    assert config_int(CONFIG, "local-steps", 99) == 5


@pytest.mark.parametrize(
    ("accessor", "key", "message"),
    [
        (
            config_int,
            "word",
            r"config key 'word' is str \('abc'\), expected an integer",
        ),
        (config_int, "lr", r"config key 'lr' is float .*expected an integer"),
        (config_int, "steps-float", r"'steps-float' is float .*expected an integer"),
        (config_int, "sizes", r"'sizes' is list .*expected an integer"),
        (config_float, "word", r"config key 'word' is str .*expected a number"),
        (config_str, "local-steps", r"'local-steps' is int .*expected a string"),
    ],
)
def test_wrong_value_type_is_named(accessor, key, message):
    with pytest.raises(RecordTypeError, match=message) as info:
        accessor(CONFIG, key)
    assert info.value.name == key
    assert isinstance(info.value, TypeError)
    assert isinstance(info.value, RecordError)


@pytest.mark.parametrize("accessor", [config_int, config_float])
def test_bool_is_not_a_number(accessor):
    with pytest.raises(RecordTypeError, match=r"config key 'flag' is bool \(True\)"):
        accessor(CONFIG, "flag")


def test_long_values_are_shortened_in_the_message():
    config = ConfigRecord({"blob": "x" * 500})
    with pytest.raises(RecordTypeError) as info:
        config_int(config, "blob")
    assert len(str(info.value)) < 150
