"""Mistakes that used to fail after the SuperLink and Ray started fail first.

Each case runs the launcher CLI (``python -m fedlr.launch``, what
``make run`` calls) as a subprocess: exit code 2, one line on stderr that
names the key, within the time limit, and no SuperLink started (no
``FLWR_HOME/local/`` and no ``flower-superlink`` under that home). Also: the
echo of a run's output hides Flower's per-round INFO lines unless
``--verbose`` and drops ANSI colour codes off a terminal, and the
integration tests' FLWR_HOME fixture does not refuse while another
``flower-superlink`` runs on the machine.
"""

from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedlr.flower.output import OutputStream, is_noise, strip_ansi
from tests.conftest import ROOT
from tests.integration.conftest import local_superlink_home, superlink_pids

#: Seconds within which a mistake is reported on an idle machine.
LIMIT = 10.0

_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _launch(home: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "fedlr.launch", "--flwr-home", str(home), *args],
        cwd=ROOT,
        env=_ENV,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return proc, time.perf_counter() - started


@pytest.fixture(scope="module")
def limit() -> float:
    """The time limit: 10 s, or 1.5 times the launcher's own floor on a busy machine.

    The floor is what every launch pays before any check (the interpreter,
    torch and the method registry), timed here; on an idle machine it is well
    under 10 s, on a machine shared with a test suite it can exceed it.
    """
    started = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import fedlr.launch.flwr_run; from fedlr.strategies.registry import "
            "available_methods; available_methods()",
        ],
        cwd=ROOT,
        env=_ENV,
        check=True,
        timeout=120,
    )
    return max(LIMIT, 1.5 * (time.perf_counter() - started))


CASES = [
    pytest.param(["--run-config", 'dataset="imdb"'], "dataset", id="unknown-dataset"),
    pytest.param(["--run-config", 'dataset=""'], "dataset", id="empty-dataset"),
    pytest.param(
        ["--run-config", "secure-aggregation=true"],
        "secure-aggregation",
        id="secagg-with-fedex-lora",
    ),
    pytest.param(["--run-config", "lora-rank=four"], "lora-rank", id="not-toml"),
    pytest.param(
        ["--run-config", 'tracker="wandb"'],
        "tracker",
        id="tracker-not-installed",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("wandb") is not None, reason="wandb installed"
        ),
    ),
    pytest.param(
        ["--client-gpus", "0.25"],
        "--client-gpus",
        id="gpu-without-gpu",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("torch") is None
            or __import__("torch").cuda.is_available(),
            reason="this machine has a CUDA GPU",
        ),
    ),
    pytest.param(
        ["--run-config", 'dataset="arith-instruct"'],
        "model",
        id="instruction-set-with-an-encoder",
    ),
    pytest.param(["--run-config", "min-replies=5"], "min-replies", id="min-replies"),
    pytest.param(
        ["--run-config", 'resume-from="/nonexistent/fedlr-run"'],
        "resume-from",
        id="resume-from-not-a-run",
    ),
]


@pytest.mark.slow  # a subprocess or a whole run: the integration stage
@pytest.mark.parametrize(("args", "key"), CASES)
def test_mistake_is_one_line_before_anything_starts(tmp_path, limit, args, key):
    home = tmp_path / "flwr-home"
    proc, seconds = _launch(home, *args)
    lines = proc.stderr.splitlines()
    print(f"{args}: {seconds:.2f} s, {len(lines)} line(s): {proc.stderr.strip()}")
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert f"'{key}'" in lines[0]
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
    assert not (home / "local").exists()  # no private SuperLink home
    assert superlink_pids(home) == []
    assert seconds < limit, f"{seconds:.1f} s"


def test_a_valid_value_of_the_same_keys_passes_the_checks():
    from fedlr.launch.run_config import check_before_start, check_run_config

    method = check_run_config(ROOT, 'dataset="sst2" method="fedavg-lora"')
    check_before_start(method, num_supernodes=4, client_gpus=0.0)  # no error
    secure = check_run_config(ROOT, 'method="fedavg-lora" secure-aggregation=true')
    check_before_start(secure, num_supernodes=4)
    assert secure.run.secure_aggregation is True


def test_resume_from_is_checked_before_the_superlink_starts(tmp_path):
    """A directory without checkpoints, and a checkpoint of other settings,
    are refused by name before anything starts; a matching one passes."""
    from fedlr.errors import ConfigError
    from fedlr.launch.run_config import check_before_start, check_run_config
    from fedlr.runs.checkpoint import save_checkpoint

    empty = tmp_path / "empty"
    empty.mkdir()
    method = check_run_config(ROOT, f'resume-from="{empty}"')
    with pytest.raises(ConfigError) as caught:
        check_before_start(method, num_supernodes=4)
    assert caught.value.key == "resume-from" and "checkpoint" in str(caught.value)

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    saved = check_run_config(ROOT, "lr=0.01").to_mapping()
    entries = {"arrays": {}, "strategy": {}, "rng": {}, "config": saved}
    save_checkpoint(run_dir, {"round": 3, **entries})
    other = check_run_config(ROOT, f'lr=0.02 resume-from="{run_dir}"')
    with pytest.raises(ConfigError) as caught:
        check_before_start(other, num_supernodes=4)
    assert caught.value.key == "lr" and "0.01" in str(caught.value)
    same = check_run_config(ROOT, f'lr=0.01 resume-from="{run_dir}"')
    check_before_start(same, num_supernodes=4)  # no error
    check_before_start(other, num_supernodes=None)  # a deployment: its server's


def test_a_checkpoint_older_than_a_key_resumes_while_the_key_is_at_its_default(
    tmp_path,
):
    """A checkpoint written before ``heldout-check`` existed (its config lacks
    the key) resumes with the key at its default and is refused with it on."""
    from fedlr.errors import ConfigError
    from fedlr.launch.run_config import check_before_start, check_run_config
    from fedlr.runs.checkpoint import save_checkpoint

    saved = check_run_config(ROOT, "").to_mapping()
    del saved["heldout-check"]
    entries = {"arrays": {}, "strategy": {}, "rng": {}, "config": saved}
    save_checkpoint(tmp_path, {"round": 2, **entries})
    same = check_run_config(ROOT, f'resume-from="{tmp_path}"')
    check_before_start(same, num_supernodes=4)  # no error
    on = check_run_config(ROOT, f'heldout-check=true resume-from="{tmp_path}"')
    with pytest.raises(ConfigError) as caught:
        check_before_start(on, num_supernodes=4)
    assert caught.value.key == "heldout-check" and "predates" in str(caught.value)


def test_a_deployment_skips_the_node_count_and_gpu_checks():
    from fedlr.launch.run_config import check_before_start, check_run_config

    method = check_run_config(ROOT, "min-replies=5")
    check_before_start(method, num_supernodes=None, client_gpus=0.25)
    assert method.run.min_replies == 5


# --------------------------------------------------------------- the echo
_COLOUR = "\x1b[92mINFO \x1b[0m:      "
_FLOWER_ROUND = [
    f"{_COLOUR}\n",
    f"{_COLOUR}[ROUND 2/3]\n",
    f"{_COLOUR}configure_train: Sampled 4 nodes (out of 4)\n",
    f"{_COLOUR}aggregate_train: Received 4 results and 0 failures\n",
    f"{_COLOUR}\t└──> Aggregated MetricRecord: {{'train-loss': 0.5}}\n",
    f"{_COLOUR}configure_evaluate: Sampled 4 nodes (out of 4)\n",
    "INFO :      aggregate_evaluate: Received 4 results and 0 failures\n",
    "INFO :      \n",
    "DEBUG :     Pre-registering run with id 1\n",
]
_KEPT = [
    f"{_COLOUR}fedlr [round 2/3] accuracy 0.7000 loss 0.5000 clients 4\n",
    f"{_COLOUR}fedlr: method fedex-lora (FedEx-LoRA), results in /out/run\n",
    "\x1b[33mWARNING \x1b[0m:   round 2: dropped a reply: no reply\n",
    "\x1b[91mERROR \x1b[0m:     ServerApp raised an exception\n",
    "🎊 Successfully started run 77\n",
]


def test_flower_round_lines_are_noise_and_fedlr_warnings_errors_are_not():
    assert [is_noise(line) for line in _FLOWER_ROUND] == [True] * len(_FLOWER_ROUND)
    assert [is_noise(line) for line in _KEPT] == [False] * len(_KEPT)


def _echo(verbose: bool, colour: bool | None, capsys) -> tuple[OutputStream, str]:
    stream = OutputStream(echo=True, verbose=verbose, colour=colour)
    stream.read(io.StringIO("".join(_FLOWER_ROUND + _KEPT)))
    return stream, capsys.readouterr().out


def test_the_echo_keeps_fedlr_lines_without_ansi_off_a_terminal(capsys):
    stream, out = _echo(verbose=False, colour=None, capsys=capsys)  # not a TTY
    assert out.splitlines() == [strip_ansi(line).rstrip("\n") for line in _KEPT]
    assert "\x1b" not in out
    assert stream.run_id == "77"
    assert len(stream.lines) == len(_FLOWER_ROUND) + len(_KEPT)  # kept whole


def test_verbose_echoes_flower_round_lines_and_a_terminal_keeps_colour(capsys):
    _, out = _echo(verbose=True, colour=True, capsys=capsys)
    assert len(out.splitlines()) == len(_FLOWER_ROUND) + len(_KEPT)
    assert out.count("\x1b[") == 2 * 6 + 2 * 4  # every colour code kept


def _flower_failure(error: Exception) -> str:
    """A ServerApp failing with ``error``, as `flwr run --stream` prints it:
    Flower's ERROR line and traceback, its re-raise chained to it, its exit
    code lines; the same text twice (the ServerApp thread and the simulation)."""
    import traceback

    def server_app() -> None:
        raise error

    try:
        try:
            server_app()
        except Exception as exc:
            raise RuntimeError("An error was encountered. Ending simulation.") from exc
    except RuntimeError:
        chained = traceback.format_exc()
    text = (
        "\x1b[91mERROR \x1b[0m:     Simulation raised an exception\n"
        + chained
        + "\x1b[91mERROR \x1b[0m:     Exit Code: 700\n\n"
        "An unhandled exception occurred when running the simulation.\n\n"
        "For more information, visit: <https://flower.ai/docs/framework/1.41/en/"
        "ref-exit-codes/700.html>\n"
    )
    return text + text


def test_a_traceback_ending_in_a_fedlr_error_is_its_one_line(capsys):
    from fedlr.errors import NoValidRepliesError

    error = NoValidRepliesError(3, 0, 1, ["reply from node 7 rejected: budget"])
    stream = OutputStream(echo=True, verbose=False, colour=False)
    text = _flower_failure(error) + "INFO :      fedlr: a line after\n"
    stream.read(io.StringIO(text))
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "ERROR :     Simulation raised an exception",
        f"fedlr.errors.NoValidRepliesError: {error}",
        "ERROR :     Simulation raised an exception",  # its second copy: one line
        "INFO :      fedlr: a line after",
    ]
    assert stream.text == text  # kept whole


def test_any_other_traceback_is_shown_whole_and_verbose_shows_everything(capsys):
    text = _flower_failure(ValueError("a bug"))
    OutputStream(echo=True, verbose=False, colour=False).read(io.StringIO(text))
    out = capsys.readouterr().out
    assert out.count("Traceback (most recent call last):") == 4
    assert out.count("ValueError: a bug") == 2 and "Exit Code: 700" in out
    OutputStream(echo=True, verbose=True, colour=True).read(io.StringIO(text))
    assert capsys.readouterr().out == text


# ------------------------------------------- another run on the same machine
def test_the_flwr_home_fixture_ignores_another_superlink(tmp_path):
    other = subprocess.Popen(  # a stand-in for someone's `flower-superlink`
        [sys.executable, "-c", "import time; time.sleep(120)", "flower-superlink"]
    )
    try:
        deadline = time.monotonic() + 10
        while other.pid not in superlink_pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert other.pid in superlink_pids()
        started = time.perf_counter()
        with local_superlink_home(tmp_path / "flwr-home") as home:
            waited = time.perf_counter() - started
            assert superlink_pids(home) == []
        assert waited < 1.0  # no waiting for the other one to go away
        assert other.poll() is None  # and it is not stopped
    finally:
        other.kill()
        other.wait(timeout=10)
