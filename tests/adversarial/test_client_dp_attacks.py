"""Attacks on client-level DP (``client-dp-clip``), and why they fail.

* **Replay** (the clients know the run config, seed included): on the
  secure path two runs of the same seed publish different noise, and a
  client that recomputes the noise of the old seeded scheme (``seed *
  1_000_003 + round * 7_919 + 17``) or of ``reproducible-noise``'s stream
  and subtracts it from the published arrays is left with a residual of
  about ``sqrt(2) z C / m``, not 3e-8. With ``reproducible-noise = true``
  the two runs are identical, the subtraction is exact, and the results
  say so (``summary.json``'s ``privacy-noise``, the ``noise-reproducible``
  column, the round line's ``REPRODUCIBLE NOISE``).
* **Influence** with the default ``screen-ratio`` (20): an attacker at
  0.999 x the screen's limit claiming ``num-examples`` 10^6, beside honest
  clients one of which the round's *median* rule would keep only when the
  attacker is there, moves the published mean by at most ``C / m`` (its
  own clipped update over the five nodes sent an instruction, nothing
  else).
* **Presence**: over 40 trials with secure noise, a threshold attacker who
  knows every other update guesses whether the target took part no more
  often than the (epsilon, delta) bound plus three standard errors; with
  reproducible noise the same attacker wins every trial.
"""

from __future__ import annotations

import logging
import math
import random
from types import SimpleNamespace

import pytest
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp

from fedlr import adapter_state
from fedlr.flower import InProcessGrid
from fedlr.privacy.client_dp import (
    ClientDpLedger,
    gaussian_noise,
    noise_generator,
    privatize,
)
from fedlr.privacy.settings import ClientDpSettings, PrivacyConfig
from fedlr.robust.screen import DEFAULT_SCREEN_RATIO, screen_sizes
from fedlr.runs.results import COLUMNS, ResultsWriter, privacy_summary, read_results
from fedlr.server_apps.progress import RoundClock
from fedlr.server_apps.runner import ServerRun
from fedlr.strategies import FedAvgLoRA
from fedlr.strategies.base import weighted_means
from fedlr.wire.protocol import ARRAYS, METRICS, NUM_EXAMPLES
from fedlr.wire.updates import ClientUpdate
from tests.strategies.test_client_dp import (
    CLIP,
    LAYOUT,
    MODEL,
    Z,
    _clipped_mean,
    _privacy,
    _start,
)

F64 = torch.float64


def _flat(arrays, keys) -> torch.Tensor:
    return torch.cat([arrays[k].double().flatten() for k in keys])


def _old_scheme(seed: int, server_round: int) -> torch.Generator:
    """The noise generator fedlr used before: a function of seed and round."""
    return torch.Generator().manual_seed(seed * 1_000_003 + server_round * 7_919 + 17)


def _published(reproducible: bool, seed: int = 5):
    strategy = FedAvgLoRA(
        layout=LAYOUT,
        privacy=_privacy(seed, reproducible=reproducible),
        screen_ratio=0.0,
        fraction_evaluate=0.0,
    )
    result, current, seen = _start(strategy)
    replies = [arrays for _, arrays in sorted(seen, key=lambda s: s[0])]
    keys = sorted(replies[0])
    clean = _clipped_mean(current, replies, denominator=3)  # what the clients know
    published = result.arrays.to_torch_state_dict()
    return _flat(published, keys), _flat(clean, keys), keys, current


def _guesses(keys, current, seed: int = 5) -> dict[str, torch.Tensor]:
    """The noise a client holding the run config recomputes, two ways."""
    shapes = {k: tuple(current[k].shape) for k in keys}
    std = Z * CLIP / 3
    seeded = ClientDpSettings(
        clip=CLIP, noise_multiplier=Z, seed=seed, reproducible=True
    )
    return {
        "old scheme": _flat(gaussian_noise(shapes, std, _old_scheme(seed, 1)), keys),
        "seeded stream": _flat(
            gaussian_noise(shapes, std, noise_generator(seeded, 1)), keys
        ),
    }


# ------------------------------------------------------------------ replay
def test_clients_cannot_replay_the_secure_noise():
    std = Z * CLIP / 3
    first, clean, keys, current = _published(reproducible=False)
    second, clean_again, _, _ = _published(reproducible=False)
    assert torch.allclose(clean, clean_again)  # the same clients, the same mean
    assert first.numel() > 800
    # the same seed, two different draws: their difference has std sqrt(2) std
    assert float((first - second).std()) == pytest.approx(math.sqrt(2) * std, rel=0.15)
    noise = first - clean
    assert float(noise.std()) == pytest.approx(std, rel=0.15)
    for name, guess in _guesses(keys, current).items():
        residual = float((noise - guess).std())
        # independent draws: the subtraction adds noise instead of removing it
        assert residual == pytest.approx(math.sqrt(2) * std, rel=0.15), name
        assert residual > 1e3 * 3e-8


def test_reproducible_noise_repeats_and_is_labelled_no_guarantee(tmp_path, caplog):
    first, clean, keys, current = _published(reproducible=True)
    second, _, _, _ = _published(reproducible=True)
    assert torch.equal(first, second)
    residual = first - clean - _guesses(keys, current)["seeded stream"]
    assert float(residual.abs().max()) < 1e-5  # the noise is subtracted away
    privacy = _privacy(reproducible=True)
    summary = privacy_summary(privacy, COLUMNS)
    assert summary["privacy-noise"] == "reproducible (epsilon is not a guarantee)"
    secure = privacy_summary(_privacy(reproducible=False), COLUMNS)
    assert secure["privacy-noise"] == "secure"
    assert privacy_summary(PrivacyConfig(), COLUMNS) == {}
    writer = ResultsWriter(tmp_path, method="fedavg-lora", privacy=privacy)
    writer.append({"round": 1, "client-dp-epsilon": 3.2})
    assert read_results(tmp_path)["noise-reproducible"].tolist() == [1]
    run = SimpleNamespace(
        headline="accuracy",
        plan=SimpleNamespace(columns=()),
        config=SimpleNamespace(num_server_rounds=1, privacy=privacy),
        clock=RoundClock(),
    )
    with caplog.at_level(logging.INFO):
        ServerRun.log_round(run, 1, (0.5, 0.7), {}, {}, 1.0)  # type: ignore[arg-type]
    assert "REPRODUCIBLE NOISE" in caplog.text


def test_values_computed_from_replies_are_listed_outside_epsilon():
    outside = privacy_summary(_privacy(reproducible=False), COLUMNS)["outside-epsilon"]
    for column in ("train-loss", "frobenius-gap", "relative-gap", "clients"):
        assert column in outside
    for column in ("accuracy", "loss", "client-dp-epsilon", "round"):
        assert column not in outside
    clients_evaluate = privacy_summary(
        _privacy(reproducible=False), COLUMNS, server_evaluated=False
    )["outside-epsilon"]
    assert "accuracy" in clients_evaluate and "loss" in clients_evaluate


# ------------------------------------------------------------------ influence
ATTACKER = 4
HONEST = (0.1, 1.0, 1.6, 25.0)
"""Honest update norms in units of the state's norm ``S`` (product space):
with the attacker at ~20 S the round's lower median is 1.6 S (limit 32 S,
the 25 S client kept), without it 1 S (limit 20 S, that client dropped)."""


def _replies(strategy: FedAvgLoRA, current):
    """Every partition's reply arrays, scaled to its norm in the screen's space."""
    space = strategy.replies.space(current)

    update = ClientUpdate.of_arrays

    state = space.norm(update({k: torch.zeros_like(v) for k, v in current.items()}))
    limit = DEFAULT_SCREEN_RATIO * state  # one update, screened on its own
    targets = [h * state for h in HONEST] + [0.999 * limit]
    g = torch.Generator().manual_seed(7)
    b_keys = [m.b_key for m in LAYOUT.modules]
    out = []
    for target in targets:
        step = {k: torch.randn(current[k].shape, generator=g) for k in b_keys}
        moved = {**current, **{k: current[k] + step[k] for k in b_keys}}
        scale = target / space.norm(update(moved))
        out.append({**current, **{k: current[k] + scale * step[k] for k in b_keys}})
    return out, [update(a) for a in out], space


def _run(strategy: FedAvgLoRA, current, replies, *, attacker: bool):
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        examples = 10**6 if pid == ATTACKER else 10
        content = RecordDict(
            {
                ARRAYS: ArrayRecord(replies[pid]),
                METRICS: MetricRecord({NUM_EXAMPLES: examples}),
            }
        )
        return Message(content, reply_to=message)

    def hook(partition: int, message: Message, reply: Message) -> Message | None:
        return None if partition == ATTACKER and not attacker else reply

    grid = InProcessGrid(app, num_nodes=5, run_config={}, reply_hook=hook)
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(current),
        num_rounds=1,
        train_config=ConfigRecord({"lr": 0.1}),
    )
    return result.arrays.to_torch_state_dict(), result.train_metrics_clientapp[1]


def test_one_client_moves_the_published_mean_at_most_c_over_m_with_the_screen_on():
    g = torch.Generator().manual_seed(3)
    current = adapter_state(MODEL, LAYOUT, FedAvgLoRA.send_roles)
    current = {  # B != 0: the state has a norm, the screen a limit
        k: torch.randn(v.shape, generator=g) * 0.3 if k.endswith("lora_B.weight") else v
        for k, v in current.items()
    }
    assert any(k.endswith("lora_B.weight") for k in current)

    def strategy() -> FedAvgLoRA:
        privacy = PrivacyConfig(
            client_dp=ClientDpSettings(
                clip=0.05, noise_multiplier=Z, seed=9, reproducible=True
            )
        )  # reproducible: both runs draw the same noise, which then cancels
        return FedAvgLoRA(layout=LAYOUT, privacy=privacy, fraction_evaluate=0.0)

    probe = strategy()
    assert probe.screen_ratio == DEFAULT_SCREEN_RATIO
    replies, updates, space = _replies(probe, current)
    # The round's median rule would let the attacker decide the 25 S client:
    with_att = screen_sizes(updates, space, DEFAULT_SCREEN_RATIO)
    without = screen_sizes(updates[:ATTACKER], space, DEFAULT_SCREEN_RATIO)
    assert len(with_att.updates) == 5 and len(without.updates) == 3
    keys = sorted(probe.reply_shapes())
    present, m_present = _run(strategy(), current, replies, attacker=True)
    absent, m_absent = _run(strategy(), current, replies, attacker=False)
    # Screened one by one: the 25 S client is dropped either way, the
    # attacker (0.999 x its limit) is kept.
    assert (m_present["clients"], m_present["dropped"]) == (4, 1)
    assert (m_absent["clients"], m_absent["dropped"]) == (3, 2)
    assert m_present["client-dp-sent"] == m_absent["client-dp-sent"] == 5
    influence = float(
        torch.linalg.vector_norm(_flat(present, keys) - _flat(absent, keys))
    )
    bound = 0.05 / 5
    assert influence <= bound * (1 + 1e-4)
    assert influence >= bound * 0.99  # clipped to exactly C: the bound is tight


# ------------------------------------------------------------------ presence
TRIALS = 40


def _presence_trials(reproducible: bool) -> tuple[float, float, float]:
    """Success rate of a threshold attacker who knows every other update
    (and, with reproducible noise, subtracts the seeded draw); the epsilon
    reported and the delta."""
    d, m, clip, z = 64, 5, 1.0, 5.0
    settings = ClientDpSettings(
        clip=clip, noise_multiplier=z, seed=2, reproducible=reproducible
    )
    g = torch.Generator().manual_seed(11)
    honest = [torch.randn(d, generator=g, dtype=F64) * 0.1 for _ in range(m - 1)]
    target = torch.zeros(d, dtype=F64)
    target[0] = 3.0  # clipped to C along e_0
    current = {"w": torch.zeros(d, dtype=F64)}
    coins = random.Random(0)
    wins = 0
    spent = math.nan
    for trial in range(1, TRIALS + 1):
        present = coins.random() < 0.5
        arrays = honest + ([target] if present else [])
        updates = [
            ClientUpdate.of_arrays({"w": a}, node_id=i) for i, a in enumerate(arrays)
        ]
        noised, metrics = privatize(
            updates,
            current,
            ["w"],
            settings,
            sent=m,
            population=m,
            server_round=trial,
            ledger=ClientDpLedger(),
        )
        spent = metrics["client-dp-epsilon"]
        mean = weighted_means(noised, ["w"])["w"]
        known = sum(honest) / m
        if reproducible:  # the attacker recomputes the noise from the seed
            known = (
                known
                + gaussian_noise(
                    {"w": (d,)}, z * clip / m, noise_generator(settings, trial)
                )["w"]
            )
        guess = float(mean[0] - known[0]) > clip / (2 * m)
        wins += guess == present
    return wins / TRIALS, spent, 1e-5


def _bound(eps: float, delta: float) -> float:
    best = math.exp(eps) / (1 + math.exp(eps))
    return best + delta + 3 * math.sqrt(best * (1 - best) / TRIALS)


def test_presence_attack_stays_within_the_epsilon_delta_bound_on_secure_noise():
    success, eps, delta = _presence_trials(reproducible=False)
    assert 0 < eps < 1.0  # z = 5, q = 1: about 0.74 (PRV)
    assert success <= _bound(eps, delta)


def test_presence_attack_wins_every_trial_on_reproducible_noise():
    success, eps, delta = _presence_trials(reproducible=True)
    assert success == 1.0 > _bound(eps, delta)
