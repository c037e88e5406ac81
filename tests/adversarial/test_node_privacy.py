"""A hostile server against a node that owns its privacy (issue: privacy that
holds against the server).

The node's limits come from its own configuration (here the simulation's node
config file, ``FEDLR_NODE_CONFIG``), its ledger from its own state directory;
the server controls only the instruction. Each test is what such a server
would try, and asserts the node's named refusal, that its ledger never passes
its budget, and that it serves the next honest round.
"""

from __future__ import annotations

import math
import types
from pathlib import Path

import pandas as pd
import pytest
import torch
from flwr.app import RecordDict

from fedlr.client.train import TrainSettings, train_steps
from fedlr.errors import ConfigError, NoValidRepliesError
from fedlr.launch.local import run_in_process
from fedlr.privacy.accounting import epsilon, noise_multiplier_for
from fedlr.privacy.budget import PrivacyLedger, data_key
from fedlr.privacy.dp_sgd import PrivateLoop
from fedlr.privacy.node_policy import NODE_CONFIG_ENV, NodePolicy, node_policy
from fedlr.privacy.settings import DpSgdSettings
from tests.conftest import tiny_run_config

BUDGET = 3.0


# ---------------------------------------------------------------- replay attack
class _Tiny(torch.nn.Module):
    """A linear classifier whose output has ``.logits``, as the loop expects."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> types.SimpleNamespace:
        return types.SimpleNamespace(logits=self.lin(x))


class _Rows:
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        return {"x": self.x[indices], "labels": self.y[indices]}


def _neighbours() -> tuple[_Rows, _Rows]:
    """D and D' = D plus one outlier example (add/remove neighbours)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
    outlier = torch.full((1, 4), 5.0)
    return _Rows(x, y), _Rows(torch.cat([x, outlier]), torch.cat([y, y[:1] * 0 + 1]))


def _release(
    data: _Rows, sigma: float, seed: int, *, reproducible: bool, state_dir: Path
) -> torch.Tensor:
    """The weights one DP-SGD step on ``data`` publishes (q = 1: every example)."""
    model = _Tiny()
    settings = DpSgdSettings(
        max_grad_norm=1.0, noise_multiplier=sigma, delta=1e-5, reproducible=reproducible
    )
    policy = NodePolicy(
        dp_allow_reproducible_noise=True, state_dir=str(state_dir), dp_delta=1e-5
    )
    control = PrivateLoop(settings, RecordDict(), policy)
    train_steps(
        model,
        data,
        TrainSettings(local_steps=1, lr=1.0, batch_size=1000),
        seed=seed,
        device=torch.device("cpu"),
        control=control,
    )
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _replay_attack(
    reproducible: bool, trials: int, tmp_path: Path
) -> tuple[int, float]:
    """The server knows the model, both candidate data sets and the run seed;
    it replays the node's noise for each candidate and picks the closer one."""
    sigma = noise_multiplier_for(1.0, 1e-5, 1.0, 1, "prv")
    d0, d1 = _neighbours()
    wins = 0
    residuals = []
    for trial in range(trials):
        secret = trial % 2
        seed = 1000 + trial
        observed = _release(
            (d0, d1)[secret],
            sigma,
            seed,
            reproducible=reproducible,
            state_dir=tmp_path / f"node-{trial}",
        )
        replays = [
            _release(d, sigma, seed, reproducible=True, state_dir=tmp_path / "server")
            for d in (d0, d1)
        ]
        errors = [float((observed - r).norm()) for r in replays]
        wins += int(errors.index(min(errors)) == secret)
        residuals.append(errors[secret])
    return wins, float(torch.tensor(residuals).median())


def test_the_server_cannot_replay_dp_sgd_noise(tmp_path):
    trials = 40
    eps = 1.0  # one step at q = 1, sigma planned for epsilon 1 at delta 1e-5
    bound = math.exp(eps) / (1 + math.exp(eps)) + 1e-5
    secure, secure_residual = _replay_attack(False, trials, tmp_path / "secure")
    replayed, replay_residual = _replay_attack(True, trials, tmp_path / "seeded")
    # The reproducible (simulation-only) path: the replay subtracts the noise
    # exactly and the server always wins.
    assert replayed == trials and replay_residual < 1e-6
    # The secure path: the replay leaves the whole noise (sigma C / n per
    # entry) and the server does no better than (epsilon, delta)-DP allows,
    # up to three standard errors of 40 trials.
    assert secure_residual > 0.05
    assert secure / trials <= bound + 3 * math.sqrt(bound * (1 - bound) / trials)


# ---------------------------------------------------------------- hostile instructions
@pytest.fixture
def strict_nodes(tmp_path, monkeypatch) -> Path:
    """Every node requires DP-SGD with a lifetime budget of 3 (its own file)."""
    path = tmp_path / "nodes.toml"
    path.write_text(f"dp-required = true\ndp-epsilon-budget = {BUDGET}\n")
    monkeypatch.setenv(NODE_CONFIG_ENV, str(path))
    return path


def _private(tmp_path: Path, **overrides: object) -> dict[str, object]:
    base: dict[str, object] = {
        "method": "fedavg-lora",
        "num-server-rounds": 1,
        "local-steps": 2,
        "dp-max-grad-norm": 1.0,
        "dp-noise-multiplier": 2.0,
    }
    base.update(overrides)
    return tiny_run_config(tmp_path / "out", **base)


def _ledgers(state_dir: Path) -> dict[str, list[tuple[float, float, int]]]:
    return {
        p.stem: PrivacyLedger(state_dir, p.stem).history()
        for p in sorted((state_dir / "dp-ledger").glob("*.json"))
    }


def _refused(config: dict[str, object], match: str) -> None:
    with pytest.raises(NoValidRepliesError, match=match):
        run_in_process(config)


@pytest.mark.parametrize(
    ("hostile", "reason"),
    [
        # a server that omits DP altogether
        ({"dp-max-grad-norm": 0.0, "dp-noise-multiplier": 0.0}, "dp-required"),
        # next to no noise: epsilon 1e12
        ({"dp-noise-multiplier": 1e-6}, "dp-epsilon-budget 3"),
        # a run budget of a million, sigma derived from it
        ({"dp-noise-multiplier": 0.0, "dp-epsilon": 1e6}, "dp-epsilon-budget 3"),
        # a delta that makes epsilon meaningless (or negative)
        ({"dp-delta": 0.9}, "'dp-delta' 0.9 is above this node's limit"),
    ],
)
def test_a_hostile_instruction_is_refused_by_name_and_spends_nothing(
    tmp_path, assets, strict_nodes, node_state_dir, hostile, reason
):
    _refused(_private(tmp_path, **hostile), reason)
    assert all(not h for h in _ledgers(node_state_dir).values())
    # the node serves the next honest round as before
    run_dir = run_in_process(_private(tmp_path))
    frame = pd.read_csv(run_dir / "results.csv")
    assert int(frame["clients"].iloc[-1]) == 3 and int(frame["dropped"].iloc[-1]) == 0
    assert len(_ledgers(node_state_dir)) == 3


def _clients(config: dict[str, object]) -> list[int] | str:
    """Replies per round of a run, or ``"refused"`` if no node trained."""
    try:
        run_dir = run_in_process(config)
    except NoValidRepliesError as exc:
        assert "dp-epsilon-budget 3" in str(exc)
        return "refused"
    return [int(c) for c in pd.read_csv(run_dir / "results.csv")["clients"]]


@pytest.mark.slow  # whole in-process runs: the integration stage
def test_the_budget_holds_across_runs_and_a_resume(
    tmp_path, assets, strict_nodes, node_state_dir
):
    """Two runs and a resumed one spend from one ledger per node; a node
    refuses the round that would pass 3, whatever the instruction's budget."""
    config = _private(
        tmp_path,
        **{
            "num-server-rounds": 2,
            "dp-noise-multiplier": 1.0,
            "batch-size": 32,
            "local-steps": 5,
        },
    )
    first = tmp_path / "first"
    outcomes = [_clients({**config, "output-dir": str(first)})]
    run_dir = next(first.iterdir())
    # a second run with the instruction's own budget raised to 100, then a
    # resume of the first that adds rounds: the ledgers go on counting
    outcomes.append(_clients({**config, "dp-epsilon": 100.0}))
    outcomes.append(
        _clients(
            {
                **config,
                "output-dir": str(first),
                "resume-from": str(run_dir),
                "num-server-rounds": 8,
            }
        )
    )
    ledgers = _ledgers(node_state_dir)
    assert len(ledgers) == 3
    trained = sum(len(h) for h in ledgers.values())
    for history in ledgers.values():
        assert history and epsilon(history, 1e-5, "prv") <= BUDGET
    # 12 rounds were asked of each node; the budget let fewer through
    asked = 3 * 12
    assert trained < asked, (outcomes, trained)
    assert outcomes[0][0] == 3  # the first round fits every budget


def test_a_clip_above_the_nodes_ceiling_is_refused(tmp_path, assets, monkeypatch):
    path = tmp_path / "nodes.toml"
    path.write_text("dp-max-grad-norm = 0.5\n[partition.7]\ndp-max-grad-norm = 2.0\n")
    monkeypatch.setenv(NODE_CONFIG_ENV, str(path))
    assert node_policy({"partition-id": 7}).dp_max_grad_norm == 2.0
    assert node_policy({"partition-id": 0}).dp_max_grad_norm == 0.5
    with pytest.raises(NoValidRepliesError) as info:
        run_in_process(_private(tmp_path))
    assert "'dp-max-grad-norm' 1 is above this node's ceiling 0.5" in str(info.value)
    # an instruction that asks for a smaller clip trains
    run_dir = run_in_process(_private(tmp_path, **{"dp-max-grad-norm": 0.25}))
    assert (pd.read_csv(run_dir / "results.csv")["dropped"] == 0).all()


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "final_arrays.pt", weights_only=True)


def test_reproducible_noise_needs_the_nodes_consent(tmp_path, assets):
    """The server asks for seeded noise: nodes whose own settings allow it
    repeat the run exactly; asked of nodes that did not consent (no setting,
    or an explicit false), the run is refused before it starts, and nothing
    sets the consent for them (a node that did not consent draws secure noise
    whatever the instruction says: tests/unit/test_dp_sgd.py)."""
    config = _private(tmp_path, **{"reproducible-noise": True})
    yes = {"dp-allow-reproducible-noise": True}
    allowed = [_final(run_in_process(config, node_config=yes)) for _ in range(2)]
    assert all(torch.equal(allowed[0][k], allowed[1][k]) for k in allowed[0])
    for no in (None, {"dp-allow-reproducible-noise": False}):
        with pytest.raises(ConfigError, match=r"reproducible-noise.*did not consent"):
            run_in_process(config, node_config=no)


def test_a_corrupt_ledger_stops_the_node_instead_of_restarting_at_zero(tmp_path):
    ledger = PrivacyLedger(tmp_path, "node-a")
    ledger.path.parent.mkdir(parents=True)
    ledger.path.write_text("{not json")
    with pytest.raises(Exception, match="unreadable"):
        ledger.history()
    d0, _ = _neighbours()
    assert len(data_key(d0)) == 64 and data_key(d0) != data_key(_neighbours()[1])


def test_the_launcher_checks_the_node_config_file_before_anything_starts(
    tmp_path, monkeypatch, capsys
):
    import argparse
    import time

    from fedlr.launch import flwr_run as launch

    bad = tmp_path / "bad.toml"
    bad.write_text("dp-epsilon-budget = -1.0\n")
    started = time.monotonic()
    code = launch.main(["--app", ".", "--node-config-file", str(bad)])
    assert code == 2 and time.monotonic() - started < 10
    err = capsys.readouterr().err
    assert "dp-epsilon-budget" in err and "finite and >= 0" in err
    good = tmp_path / "nodes.toml"
    good.write_text("dp-required = true\n[partition.1]\ndp-epsilon-budget = 2.0\n")
    args = argparse.Namespace(node_config_file=str(good))
    path = launch._nodes_file(args)  # checked, and passed on as it is
    assert path == str(good.resolve())
    environ = {NODE_CONFIG_ENV: path}
    assert node_policy({"partition-id": 1}, environ).dp_epsilon_budget == 2.0
    assert node_policy({"partition-id": 0}, environ).dp_required
