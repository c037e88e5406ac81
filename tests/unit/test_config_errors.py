"""Every run-config key: an invalid value is refused by name before training.

``AT_PARSE`` holds the bad values that the keys' declarations give
(``option(default, help, range=..., choices=..., bad=[(value, message
regex), ...])`` in ``RunConfig`` and the registered methods' options: a value
just outside each bound of the range, one outside the choices, and each
``bad`` value, :func:`fedlr.options.bad_values`): each is parsed, a method
option with a method that declares it, and must be refused with its message.
``AT_START`` holds the keys whose validity depends on a registry or the model
(checked when the ServerApp builds its plan, before round 1). A new key
without a bad value in its declaration or an entry in ``AT_START`` fails
``test_every_key_has_a_bad_value_case``.
"""

from __future__ import annotations

import math

import pytest
from flwr.app import Context, RecordDict

from fedlr.config.run import RunConfig
from fedlr.errors import ConfigError, FedLRError
from fedlr.flower import InProcessGrid
from fedlr.options import bad_values
from fedlr.strategies.registry import all_option_keys, registered_methods, resolve
from tests.conftest import tiny_run_config


def _declared_bad_values() -> list[tuple[str, object, str]]:
    """(key, value, message regex) for each value a declaration refuses."""
    keys = {**RunConfig.option_fields(), **all_option_keys()}
    return [
        (key, value, message)
        for key, f in keys.items()
        for value, message in bad_values(key, f)
    ]


AT_PARSE = _declared_bad_values()

# key -> (overrides making the value bad, expected error type, message)
AT_START: dict[str, tuple[dict[str, object], type[Exception], str]] = {
    "method": ({"method": "fedx-lora"}, FedLRError, "known methods: .*fedex-lora"),
    "model": ({"model": "no-such-model"}, ConfigError, "no-such-model"),
    "gradient-checkpointing": (
        {"gradient-checkpointing": True, "model": "minilm"},
        ConfigError,
        "gradient-checkpointing",
    ),
    "dataset": ({"dataset": "imdbb"}, FedLRError, "polarity"),
    "lora-rank": ({"lora-rank": 64}, ConfigError, "lora-rank"),
    "resume-from": ({"resume-from": "/nonexistent/run"}, ConfigError, "resume-from"),
}


def test_every_key_has_a_bad_value_case():
    keys = set(RunConfig.option_fields()) | set(all_option_keys())
    declared = {key for key, _, _ in AT_PARSE}
    missing = sorted(keys - declared - set(AT_START))
    assert not missing, f"keys without an invalid-value test: {missing}"


@pytest.mark.parametrize(
    ("key", "value", "message"),
    AT_PARSE,
    ids=[f"{key}={value!r}" for key, value, _ in AT_PARSE],
)
def test_invalid_value_is_refused_with_the_key_named(key, value, message):
    run_config: dict[str, object] = {key: value}
    if key not in RunConfig.option_fields():
        spec = next(s for s in registered_methods() if key in s.options.option_fields())
        run_config["method"] = spec.name
    with pytest.raises(ConfigError, match=message) as info:
        resolve(run_config)
    assert info.value.key == key and f"'{key}'" in str(info.value)


def _bounds() -> list[tuple[str, object]]:
    """(key, value) for each closed, finite bound of each declared range."""
    keys = {**RunConfig.option_fields(), **all_option_keys()}
    cases = []
    for key, f in keys.items():
        range_ = f.metadata.get("range")
        if range_ is None:
            continue
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        for bound, closed in (
            (range_.low, range_.low_closed),
            (range_.high, range_.high_closed),
        ):
            if closed and math.isfinite(bound):
                cases.append((key, int(bound) if kind == "int" else float(bound)))
    return cases


BOUNDS = _bounds()


def test_ranges_are_declared_and_each_gives_refusals():
    ranged = {key for key, _ in BOUNDS} | {
        key
        for key, f in {**RunConfig.option_fields(), **all_option_keys()}.items()
        if f.metadata.get("range") is not None
    }
    assert {"num-server-rounds", "seed", "lr", "fedspec-threshold"} <= ranged
    refused = {key for key, _, message in AT_PARSE if message.startswith("must")}
    assert ranged <= refused


@pytest.mark.parametrize(
    ("key", "value"), BOUNDS, ids=[f"{k}={v!r}" for k, v in BOUNDS]
)
def test_a_closed_bound_of_a_declared_range_is_accepted(key, value):
    run_config: dict[str, object] = {key: value}
    if key == "server-update-share":  # robust = auto would fill in its share
        run_config["robust"] = "none"
    if key not in RunConfig.option_fields():
        spec = next(s for s in registered_methods() if key in s.options.option_fields())
        run_config["method"] = spec.name
        assert getattr(resolve(run_config).options, key.replace("-", "_")) == value
    else:
        assert getattr(resolve(run_config).run, key.replace("-", "_")) == value


def _never_called(message, context):
    raise AssertionError("a client was asked to train: the error came too late")


@pytest.mark.parametrize("key", sorted(AT_START))
def test_invalid_value_stops_the_server_before_training(tmp_path, assets, key):
    from fedlr.server_apps.runner import run_server

    overrides, error, message = AT_START[key]
    config = tiny_run_config(tmp_path, **overrides)
    grid = InProcessGrid(_never_called, num_nodes=3, run_config=config)
    context = Context(
        run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=config
    )
    with pytest.raises(error, match=message):
        run_server(grid, context)
    assert grid.messages_sent == 0
    assert not list(tmp_path.glob("*/results.csv"))


@pytest.mark.skipif(
    __import__("torch").cuda.device_count() > 7,
    reason="this machine has a CUDA device 7, so 'cuda:7' is not absent here",
)
def test_an_absent_device_stops_the_server_before_training(tmp_path, assets):
    from fedlr.server_apps.runner import run_server

    config = tiny_run_config(tmp_path, device="cuda:7")
    grid = InProcessGrid(_never_called, num_nodes=3, run_config=config)
    context = Context(
        run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=config
    )
    with pytest.raises(ConfigError, match=r"'cuda:7' was asked for") as info:
        run_server(grid, context)
    assert info.value.key == "device"
    assert grid.messages_sent == 0


def test_run_directories_are_created_exclusively(tmp_path):
    from fedlr.server_apps.runner import _run_dir

    config = RunConfig(output_dir=str(tmp_path))
    first, second = _run_dir(config, 5), _run_dir(config, 5)
    assert first != second and first.is_dir() and second.is_dir()
    # Both in the same second: the second run gets a suffix (a new second
    # would give a new stamp instead; either way the folders differ).
    assert second.name == f"{first.name}-2" or second.name[:-4] != first.name[:-4]


@pytest.mark.parametrize(
    ("overrides", "sampled"),
    [({"min-replies": 4}, 3), ({"min-replies": 2, "fraction-train": 0.4}, 1)],
)
def test_min_replies_above_the_sampled_nodes_stops_before_training(
    tmp_path, assets, overrides, sampled
):
    from fedlr.server_apps.runner import run_server

    config = tiny_run_config(tmp_path, **overrides)
    grid = InProcessGrid(_never_called, num_nodes=3, run_config=config)
    context = Context(
        run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=config
    )
    with pytest.raises(ConfigError, match=f"samples {sampled} of the 3 connected"):
        run_server(grid, context)
    assert grid.messages_sent == 0
    assert not list(tmp_path.glob("*/results.csv"))
