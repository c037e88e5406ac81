"""Every run-config key: an invalid value is refused by name before training.

``AT_PARSE`` holds, for every key that ``RunConfig`` or a registered method's
options validate themselves, a bad value and the expected message (a method
option is parsed with a method that declares it); ``AT_START`` the keys whose
validity depends on a registry or the model (checked when the ServerApp builds
its plan, before round 1). A new key without an entry in either table fails
``test_every_key_has_a_bad_value_case``.
"""

from __future__ import annotations

import pytest
from flwr.app import Context, RecordDict

from fedlr.config import RunConfig
from fedlr.errors import ConfigError, FedLRError
from fedlr.flower import InProcessGrid
from fedlr.strategies.registry import all_option_keys, registered_methods, resolve
from tests.conftest import tiny_run_config

AT_PARSE: dict[str, tuple[object, str]] = {
    "method": ("", "is empty"),
    "num-server-rounds": (0, "must be >= 1"),
    "local-steps": (0, "must be >= 1"),
    "lr": (0.0, "finite and > 0"),
    "lr-decay": (1.5, r"in \(0, 1\]"),
    "weight-decay": (1.0, r"in \[0, 1\)"),
    "batch-size": (0, "must be >= 1"),
    "eval-batch-size": (-1, "must be >= 0"),
    "eval-every": (0, "must be >= 1"),
    "max-length": (4, r"in \[8, 4096\]"),
    "pooling": ("max", "not one of mean, cls"),
    "lora-rank": (0, "must be >= 1"),
    "client-ranks": ("2,x", "not an integer"),
    "lora-alpha": (-1.0, "finite and > 0"),
    "lora-dropout": (1.0, r"in \[0, 1\)"),
    "target-modules": (",", "names no module"),
    "max-new-tokens": (0, r"in \[1, 1024\]"),
    "prompt-template": ("Q: {question}", "must contain"),
    "precision": ("fp8", "not one of"),
    "quantization": ("2bit", "not one of"),
    "partitioner": ("random", "not one of"),
    "dirichlet-alpha": (0.0, "finite and > 0"),
    "classes-per-partition": (0, "must be >= 1"),
    "num-partitions": (0, "must be >= 1"),
    "min-partition-size": (0, "must be >= 1"),
    "eval-fraction": (0.0, r"in \(0, 1\)"),
    "max-eval-examples": (-1, "must be >= 0"),
    "fraction-train": (1.5, r"in \(0, 1\]"),
    "min-replies": (0, "must be >= 1"),
    "seed": (-1, "must be in"),
    "device": ("cuda:abc", "not one of auto, cpu, mps, cuda, cuda:<index>"),
    "output-dir": ("relative", "absolute path"),
    "round-timeout": (0.0, "finite and > 0"),
    "keep-checkpoints": (0, "must be >= 1"),
    "robust": ("krum", "must be one of"),
    "clip-norm": (-1.0, "must be >= 0"),
    "trim-fraction": (0.5, r"in \[0, 0.5\)"),
    "max-client-weight": (0.0, r"in \(0, 1\]"),
    "max-num-examples": (-1, "must be >= 0"),
    "max-update-ratio": (float("nan"), "finite and >= 0"),
    "fedspec-threshold": (1.0, r"in \[0, 1\)"),
    "fedspec-max-rank": (0, "must be >= 1"),
    "proximal-mu": (float("inf"), "finite and >= 0"),
    "server-momentum": (1.0, r"in \[0, 1\)"),
    "server-lr": (0.0, "finite and > 0"),
    "momentum": (1.0, r"in \[0, 1\)"),
    "warmup-rounds": (-1, "must be >= 0"),
    "qrmix-tau": (0.0, "finite and > 0"),
    "qrmix-gamma": (float("nan"), "finite and > 0"),
    "qrmix-k": (0, "must be >= 1"),
    "qrmix-oversample": (-1, "must be >= 0"),
    "qrmix-power-iters": (-1, "must be >= 0"),
    "qrmix-form": ("exact", "not one of fisher, literal"),
    "qrmix-warmup-checkpoint": ("warm.pt", "absolute path"),
    "num-tasks": (0, "must be >= 1"),
    "rounds-per-task": (0, "must be >= 1"),
    "task-examples": (-1, "must be >= 0"),
    "fot-eps": (1.5, r"in \[0, 1\]"),
    "fot-eps-inc": (-0.1, r"in \[0, 1\]"),
    "fot-sketch-dim": (-1, "must be >= 0"),
    "fot-activation-examples": (0, "must be >= 1"),
    "vera-rank": (0, "must be >= 1"),
    "projection-seed": (-1, "must be in"),
    "vera-d-initial": (float("inf"), "must be finite"),
    "vera-lr": (0.0, "finite and > 0"),
    "fedex-lr": (1.5, r"in \(0, 1\]"),
    "fedex-downlink": ("sparse", r"one of \['factored', 'dense'\]"),
    "fedspec-energy": ("sigma3", r"one of \['sigma2', 'sigma'\]"),
    "hetlora-prune-gamma": (0.0, r"in \(0, 1\]"),
    "hetlora-prune-lambda": (-1.0, "finite and >= 0"),
    "sorf-rank": (65, "must be <= 64"),
    "sorf-d-scale-initial": (float("nan"), "must be finite"),
}

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
    missing = sorted(keys - set(AT_PARSE) - set(AT_START))
    assert not missing, f"keys without an invalid-value test: {missing}"


@pytest.mark.parametrize("key", sorted(AT_PARSE))
def test_invalid_value_is_refused_with_the_key_named(key):
    value, message = AT_PARSE[key]
    run_config: dict[str, object] = {key: value}
    if key not in RunConfig.option_fields():
        spec = next(s for s in registered_methods() if key in s.options.option_fields())
        run_config["method"] = spec.name
    with pytest.raises(ConfigError, match=message) as info:
        resolve(run_config)
    assert info.value.key == key and f"'{key}'" in str(info.value)


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
