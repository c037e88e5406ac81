"""The launcher checks the run config locally, before anything starts.

A method typo, an unknown key or a value of the wrong type is one line on
stderr with a suggestion, exit code 2, in seconds, and nothing is started
(no FLWR_HOME, no SuperLink). Also: the noise filter, the private SuperLink's
environment, and the round line's elapsed/ETA and in-round progress.
"""

from __future__ import annotations

import logging
import math
import time

import pytest

from fedlr.errors import ConfigError, UnknownMethodError
from fedlr.launch.flwr_run import (
    LocalSuperLink,
    check_run_config,
    flwr_env,
    is_noise,
    main,
    parse_run_config,
)
from fedlr.server_apps.progress import ProgressGrid, RoundClock, duration, gap_text
from tests.conftest import ROOT

#: Seconds within which a bad config must be reported (the registry included).
LIMIT = 10.0


def _timed(run_config: str) -> tuple[Exception, float]:
    started = time.perf_counter()
    with pytest.raises((ConfigError, UnknownMethodError)) as info:
        check_run_config(ROOT, run_config)
    return info.value, time.perf_counter() - started


def test_method_typo_suggests_the_method_in_one_line_within_seconds():
    error, seconds = _timed('method="fedex_lora"')
    assert isinstance(error, UnknownMethodError)
    text = str(error)
    assert "did you mean 'fedex-lora'?" in text
    assert "\n" not in text
    assert seconds < LIMIT, f"{seconds:.1f} s"


def test_unknown_key_suggests_the_key_and_lists_no_keys():
    error, seconds = _timed("num-server-round=3")
    assert isinstance(error, ConfigError)
    assert error.key == "num-server-round"
    assert "did you mean 'num-server-rounds'?" in str(error)
    assert "\n" not in str(error)
    assert len(str(error)) < 200  # not the ~70 known keys
    assert seconds < LIMIT, f"{seconds:.1f} s"


def test_unknown_key_without_a_close_one_points_to_the_docs():
    error, _ = _timed("zzzz=1")
    assert "no key is close" in str(error)
    assert "docs/configuration.md" in str(error)


def test_wrong_type_names_key_value_and_expected_type():
    error, seconds = _timed('lora-rank="four"')
    assert isinstance(error, ConfigError)
    assert error.key == "lora-rank"
    assert "expected an integer, got 'four'" in str(error)
    assert seconds < LIMIT


def test_good_overrides_resolve_with_the_apps_defaults():
    method = check_run_config(ROOT, 'method="fedavg-lora" lora-rank=4')
    assert method.spec.name == "fedavg-lora"
    assert method.run.lora_rank == 4
    assert method.run.num_server_rounds == 15  # pyproject's default


def test_run_config_that_is_not_toml_names_the_option():
    with pytest.raises(ConfigError) as info:
        parse_run_config("lora-rank=four")
    assert info.value.key == "lora-rank"
    assert parse_run_config('a=1 b="x y"') == {"a": 1, "b": "x y"}


@pytest.mark.parametrize(
    ("run_config", "expected"),
    [
        ('method="fedex_lora"', "did you mean 'fedex-lora'?"),
        ("num-server-round=3", "did you mean 'num-server-rounds'?"),
        ('lora-rank="four"', "expected an integer, got 'four'"),
    ],
)
def test_cli_reports_one_line_exit_2_and_starts_nothing(
    tmp_path, capfd, run_config, expected
):
    home = tmp_path / "flwr-home"
    started = time.perf_counter()
    code = main(
        ["--app", str(ROOT), "--flwr-home", str(home), "--run-config", run_config]
    )
    seconds = time.perf_counter() - started
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and expected in lines[0]
    assert "Traceback" not in err
    assert not home.exists()  # no FLWR_HOME, so no SuperLink was started
    assert seconds < LIMIT


def test_noise_lines_are_recognised_and_fedlr_lines_are_not():
    noise = [
        "WARNING :   Since flwr 1.32, default simulated SuperNodes changed from "
        "10 to 2.",
        "INFO :      To change federation size, use the following command:",
        "INFO :      \tflwr federation simulation-config @none/default <superlink> "
        "--num-supernodes <N>",
        "/x/ray/_private/worker.py:2051: FutureWarning: Tip: In future versions "
        "of Ray, Ray will no longer override accelerator visible devices",
        "Loading weights: 100%|██████████| 39/39 [00:00<00:00, 812.33it/s]",
        "Flower configuration not found. Created default configuration at /h/c.toml",
    ]
    kept = [
        "INFO :      fedlr [round 3/15] accuracy 0.7000 loss 0.5000 up 1.21 MB "
        "down 29.52 MB clients 4 dropped 0 15.8s elapsed 1m02s eta 3m10s",
        "Successfully started run 123",
        "ERROR :     ServerApp raised an exception",
    ]
    assert all(is_noise(line) for line in noise)
    assert not any(is_noise(line) for line in kept)


def test_private_superlink_has_its_own_ports_and_home(tmp_path, monkeypatch):
    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    first = LocalSuperLink.allocate(tmp_path)
    second = LocalSuperLink.allocate(tmp_path)
    ports = {first.http_port, first.control_port, second.http_port}
    assert len(ports) == 3 and 39091 not in ports
    assert first.home.parent == tmp_path.resolve() / "local"
    env = flwr_env(tmp_path, link=first, quiet=True)
    assert env["FLWR_HOME"] == str(first.home)
    assert env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"] == str(first.http_port)
    assert env["FLWR_LOCAL_CONTROL_API_PORT"] == str(first.control_port)
    assert env["TRANSFORMERS_VERBOSITY"] == "error"
    assert "ignore::FutureWarning:ray._private.worker" in env["PYTHONWARNINGS"]
    assert "TRANSFORMERS_VERBOSITY" not in flwr_env(tmp_path, quiet=False)


def test_round_clock_eta_is_the_mean_round_time_times_rounds_left():
    clock = RoundClock(started=time.monotonic() - 125.0)
    assert clock.lap(10.0, rounds_left=4) == "elapsed 2m05s eta 40s"
    assert clock.lap(20.0, rounds_left=3) == "elapsed 2m05s eta 45s"
    assert clock.lap(5.0, rounds_left=0) == "elapsed 2m05s"
    assert [duration(s) for s in (3, 65, 7325, math.nan)] == [
        "3s",
        "1m05s",
        "2h02m",
        "?",
    ]


def test_gap_is_left_out_where_a_method_has_none():
    assert gap_text({"frobenius-gap": math.nan, "relative-gap": math.nan}) == ""
    assert gap_text({}) == ""
    assert gap_text({"frobenius-gap": 4.149e-3, "relative-gap": 2.553e-3}) == (
        "gap 4.149e-03 (rel 2.553e-03) "
    )


def test_progress_grid_reports_replies_while_one_is_missing(tmp_path, caplog):
    """A lost reply keeps the round waiting: `k/n clients replied` lines."""
    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.clientapp import ClientApp

    from fedlr.flower import InProcessGrid

    app = ClientApp()

    @app.train()
    def train(msg: Message, context) -> Message:
        return Message(RecordDict({"c": ConfigRecord({"ok": 1})}), reply_to=msg)

    lose_node_1 = lambda partition, sent, reply: None if partition == 1 else reply  # noqa: E731
    inner = InProcessGrid(app, num_nodes=3, run_config={}, reply_hook=lose_node_1)
    grid = ProgressGrid(inner, label="round 1/2", every=0.0, poll=0.01)
    messages = [
        grid.create_message(RecordDict(), "train", node, "1")
        for node in grid.get_node_ids()
    ]
    with caplog.at_level(logging.INFO, logger="flwr"):
        replies = list(grid.send_and_receive(messages, timeout=0.2))
    assert len(replies) == 2
    lines = [
        r.getMessage() for r in caplog.records if "clients replied" in r.getMessage()
    ]
    assert lines, "no progress line"
    assert lines[0].startswith("fedlr [round 1/2] 2/3 clients replied")
