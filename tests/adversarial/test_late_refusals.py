"""Every refusal at configuration, named, before any client trains (issue 35, item 5).

* scaffold-lora and fot with client-level DP: refused when the run config is
  resolved (the ServerApp, and the launcher before any SuperLink starts) and
  when a plug-in user builds the strategy (its constructor), never in round 1
  after the clients trained;
* a checkpoint whose strategy state holds a key the method does not keep: a
  ``CheckpointStateError`` naming the key, the method and the file, before
  round 1 trains (not the loader's bare ``ValueError``);
* ``HeteroFedExLoRA(fedex_fold_scale=...)`` built directly: taken by name
  (1.0 builds it) or a ``ConfigError`` naming the option and the class, not
  Flower's ``TypeError``.

Each refusal is one line (its message) and no client trains before it.
"""

from __future__ import annotations

import re
import time

import pytest
from flwr.app import Context, Message, RecordDict

from fedlr.errors import (
    CheckpointStateError,
    ConfigError,
    PrivacyUnsupportedError,
)
from fedlr.flower import InProcessGrid
from fedlr.launch import flwr_run as launch
from fedlr.launch.client_app import app as client_app
from fedlr.privacy.settings import ClientDpSettings, PrivacyConfig
from fedlr.runs.checkpoint import (
    check_checkpoint_state,
    checkpoint_name,
    get_rng_state,
    save_checkpoint,
)
from fedlr.server_apps.runner import run_server
from fedlr.strategies import FedAvgLoRA, FedExLoRA, ScaffoldLoRA
from fedlr.strategies.fedex_lora import HeteroFedExLoRA
from fedlr.strategies.registry import resolve
from tests.conftest import ROOT, tiny_run_config
from tests.plugin_app.task import build_model

CLIENT_DP = {"client-dp-clip": 0.1, "client-dp-noise-multiplier": 1.0}


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert text and "\n" not in text, text
    return text


def _run(config: dict[str, object]) -> tuple[BaseException, list[int], float]:
    """``run_server`` on an in-process grid: the error it raised, the nodes
    that replied before it (each reply is a client that trained), seconds."""
    trained: list[int] = []

    def count(pid: int, instruction: Message, reply: Message) -> Message:
        trained.append(pid)
        return reply

    grid = InProcessGrid(client_app, num_nodes=3, run_config=config, reply_hook=count)
    context = Context(
        run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=config
    )
    start = time.perf_counter()
    with pytest.raises(Exception) as info:
        run_server(grid, context)
    return info.value, trained, time.perf_counter() - start


# ------------------------------------------------ client-level DP, run config
@pytest.mark.parametrize(
    ("method", "record"), [("scaffold-lora", "scaffold-delta"), ("fot", "sketches")]
)
def test_client_dp_with_extra_records_is_refused_before_any_client_trains(
    tmp_path, method, record
):
    config = tiny_run_config(tmp_path, method=method, **CLIENT_DP)
    error, trained, seconds = _run(config)
    assert isinstance(error, PrivacyUnsupportedError)
    text = _one_line(error)
    assert text.startswith("client-dp-clip:")
    assert f"method '{method}'" in text and f"'{record}'" in text
    assert trained == []  # refused before the first instruction went out
    assert seconds < 5.0
    assert not any(tmp_path.iterdir())  # no run directory, no checkpoint


def test_the_launcher_refuses_client_dp_with_scaffold_before_anything_starts(
    tmp_path, monkeypatch, capsys
):
    started: list[object] = []
    monkeypatch.setattr(launch, "flwr_run", lambda *a, **k: started.append(a))
    overrides = (
        f"method='scaffold-lora' client-dp-clip=0.1 client-dp-noise-multiplier=1.0 "
        f"output-dir='{tmp_path}'"
    )
    start = time.perf_counter()
    code = launch.main(
        [
            "--app",
            str(ROOT),
            "--flwr-home",
            str(tmp_path / "home"),
            "--run-config",
            overrides,
        ]
    )
    assert time.perf_counter() - start < 5.0
    assert code == 2 and started == []  # no SuperLink, no flwr run
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: client-dp-clip:")
    assert "'scaffold-delta'" in lines[0]


# ------------------------------------------------ client-level DP, plug-in use
def _client_dp() -> PrivacyConfig:
    return PrivacyConfig(client_dp=ClientDpSettings(clip=0.1, noise_multiplier=1.0))


def test_a_plugin_scaffold_with_client_dp_is_refused_by_its_constructor():
    model = build_model("scaffold-lora")
    with pytest.raises(PrivacyUnsupportedError) as info:
        ScaffoldLoRA.for_model(model, privacy=_client_dp())
    text = _one_line(info.value)
    assert "method 'scaffold-lora'" in text and "'scaffold-delta'" in text
    # the same words as the run config's refusal
    with pytest.raises(PrivacyUnsupportedError) as resolved:
        resolve({"method": "scaffold-lora", **CLIENT_DP})
    assert str(resolved.value) == text


def test_a_plugin_strategy_refuses_what_its_registration_refuses():
    model = build_model("fedex-lora")
    with pytest.raises(PrivacyUnsupportedError, match="method 'fedex-lora'"):
        FedExLoRA.for_model(model, privacy=_client_dp())  # not sum-only
    strategy = FedAvgLoRA.for_model(build_model("fedavg-lora"), privacy=_client_dp())
    assert (
        strategy.privacy.client_dp is not None
        and strategy.privacy.client_dp.clip == 0.1
    )

    class OwnScaffold(ScaffoldLoRA):  # a user's subclass keeps its method's refusal
        pass

    with pytest.raises(PrivacyUnsupportedError, match="'scaffold-delta'"):
        OwnScaffold.for_model(build_model("scaffold-lora"), privacy=_client_dp())


# ------------------------------------------------ a checkpoint's strategy state
def test_an_unknown_strategy_state_key_is_named_with_the_method_and_file():
    with pytest.raises(CheckpointStateError) as info:
        check_checkpoint_state(
            {"momentum": {}, "velocity": 1, "zz": 2},
            ["momentum"],
            method="fedavgm-lora",
            source="/runs/x/checkpoint-00003.pt",
        )
    text = _one_line(info.value)
    assert text.startswith("/runs/x/checkpoint-00003.pt: strategy-state key 'velocity'")
    assert "(and 1 more)" in text and "method 'fedavgm-lora'" in text
    assert "['momentum']" in text
    check_checkpoint_state(  # the keys it keeps, or fewer: accepted
        {"momentum": {}}, ["momentum"], method="fedavgm-lora", source="f"
    )
    check_checkpoint_state({}, ["momentum"], method="fedavgm-lora", source="f")
    with pytest.raises(CheckpointStateError, match="is a list, not a mapping"):
        check_checkpoint_state([1], [], method="fedavg-lora", source="f")


def test_resuming_a_checkpoint_with_an_unknown_state_key_fails_before_round_1(
    tmp_path, assets
):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = tiny_run_config(
        tmp_path, method="fedavgm-lora", **{"resume-from": str(run_dir)}
    )
    saved = resolve(config).to_mapping()
    save_checkpoint(
        run_dir,
        {
            "round": 1,
            "arrays": {},
            "strategy": {"momentum": {}, "velocity": {}},
            "rng": get_rng_state(),
            "config": saved,
        },
    )
    error, trained, seconds = _run(config)
    assert isinstance(error, CheckpointStateError), error
    text = _one_line(error)
    assert str(run_dir / checkpoint_name(1)) in text
    assert "'velocity'" in text and "method 'fedavgm-lora'" in text
    assert trained == []
    assert seconds < 10.0


# ------------------------------------------------ HeteroFedExLoRA's options
def test_hetero_fedex_takes_fedex_fold_scale_by_name():
    model = build_model("fedex-lora")
    strategy = HeteroFedExLoRA.for_model(
        model, client_ranks=(2, 4), fedex_fold_scale=1.0
    )
    assert strategy.method_options.fedex_fold_scale == 1.0
    for value, match in ((0.5, "HeteroFedExLoRA"), (2.0, r"\[0, 1\]")):
        with pytest.raises(ConfigError) as info:
            HeteroFedExLoRA.for_model(
                model, client_ranks=(2, 4), fedex_fold_scale=value
            )
        assert not isinstance(info.value, TypeError)
        text = _one_line(info.value)
        assert text.startswith("run-config 'fedex-fold-scale':")
        assert re.search(match, text), text
