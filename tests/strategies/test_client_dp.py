"""Client-level DP on the server (fedlr.privacy.client_dp) and Flower's DP wrappers.

* clipping and the fixed denominator: each clipped update's norm is at most
  ``C`` and the equal-weight mean is ``x + sum_i clip(u_i) / m`` exactly;
* the noise: with ``reproducible-noise`` it is exactly the seeded Gaussian
  (the aggregate minus that draw is the noiseless clipped mean), and its
  measured standard deviation is ``z C / m``; without it two draws differ;
* through a strategy driven by Flower's ``start()`` (reproducible noise):
  FedAvg-LoRA's and FFA-LoRA's new global arrays are the clipped
  fixed-denominator mean plus the seeded noise, FedSVD's new product is the
  noised mean of ``B`` times ``A``; the reported ``client-dp-epsilon`` is the
  settings' accountant's (RDP, PRV) for ``q = m / N``, ``z`` and the rounds;
* ``m`` is the nodes sent an instruction: with 5 sent of 8 and one reply
  lost, the noise std is ``z C / 5`` (metric and the actual noise) and the
  epsilon is that of ``[(z, 5/8, 1)] * rounds``; a rejected round still
  counts; the history survives a checkpoint (also FedAvgM's, whose
  ``state_dict`` does not call ``super()``), a missing history is refused,
  and without client-level DP the key stays unknown;
* refusals by name: non-sum-only methods, robust rules, extra records;
* Flower's ``DifferentialPrivacyServerSideFixedClipping`` wraps FedAvg-LoRA
  (same arrays out and back, clipped and noised as documented) and cannot
  wrap FFA-LoRA (its replies carry fewer arrays than it is sent).
"""

from __future__ import annotations

import math

import numpy as np
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
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping
from opacus.accountants import RDPAccountant
from peft import LoraConfig, get_peft_model

from fedlr import adapter_state, lora_layout
from fedlr.errors import CheckpointError, ConfigError, PrivacyUnsupportedError
from fedlr.flower import InProcessGrid
from fedlr.privacy.accounting import epsilon
from fedlr.privacy.client_dp import (
    CLIENT_DP_STATE,
    ClientDpLedger,
    clip_to_fixed_mean,
    gaussian_noise,
    noise_generator,
    privatize,
)
from fedlr.privacy.settings import ClientDpSettings, PrivacyConfig
from fedlr.robust.rules import RobustConfig
from fedlr.robust.spaces import ParameterSpace
from fedlr.strategies import FedAvgLoRA, FedAvgMLoRA, FedSVD, FFALoRA
from fedlr.strategies.base import weighted_means
from fedlr.strategies.registry import resolve
from fedlr.wire.protocol import ARRAYS, CONFIG, METRICS, NUM_EXAMPLES, decode_roles
from fedlr.wire.updates import ClientUpdate

F64 = torch.float64
CLIP = 0.5
Z = 1.3
SIZES = [10, 30, 60]


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(48, 48)
        self.fc2 = torch.nn.Linear(48, 48)
        self.head = torch.nn.Linear(48, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _model():
    torch.manual_seed(0)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["fc1", "fc2"], modules_to_save=["head"]
    )
    return get_peft_model(_MLP(), config)


MODEL = _model()
LAYOUT = lora_layout(MODEL)


def _client_app(scale: float = 1.0) -> ClientApp:
    """Clients that move every array they train by a seeded step; partition
    ``p``'s step has norm about ``scale * (p + 1)`` (some above ``CLIP``)."""
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        roles = decode_roles(message.content[CONFIG])
        sent = message.content[ARRAYS].to_torch_state_dict()
        own = adapter_state(MODEL, LAYOUT, roles)
        g = torch.Generator().manual_seed(100 + pid)
        steps = {k: torch.randn(v.shape, generator=g) for k, v in own.items()}
        total = math.sqrt(sum(float(s.square().sum()) for s in steps.values()))
        arrays = {
            k: sent.get(k, own[k]) + scale * (pid + 1) * steps[k] / total for k in own
        }
        content = RecordDict(
            {
                ARRAYS: ArrayRecord(arrays),
                METRICS: MetricRecord({NUM_EXAMPLES: SIZES[pid % 3]}),
            }
        )
        return Message(content, reply_to=message)

    return app


def _start(
    strategy,
    *,
    rounds: int = 1,
    scale: float = 1.0,
    inner=None,
    nodes: int = 3,
    lose: int = 0,
):
    """Run ``strategy.start()``; the replies each round received, as sent.

    ``lose``: the replies of the ``lose`` instructed nodes with the smallest
    ids are lost every round (the hook returns ``None``)."""
    seen: list[tuple[int, dict[str, torch.Tensor]]] = []

    def hook(partition: int, message: Message, reply: Message) -> Message | None:
        if message.metadata.dst_node_id in sorted(strategy_sent(strategy))[:lose]:
            return None
        seen.append((partition, reply.content[ARRAYS].to_torch_state_dict()))
        return reply

    grid = InProcessGrid(
        _client_app(scale), num_nodes=nodes, run_config={}, reply_hook=hook
    )
    roles = (inner or strategy).send_roles
    initial = ArrayRecord(adapter_state(MODEL, LAYOUT, roles))
    result = strategy.start(
        grid=grid,
        initial_arrays=initial,
        num_rounds=rounds,
        train_config=ConfigRecord({"lr": 0.1}),
    )
    return result, initial.to_torch_state_dict(), seen


def strategy_sent(strategy) -> list[int]:
    """The nodes the strategy (or the one it wraps) instructed this round."""
    inner = getattr(strategy, "strategy", strategy)
    return list(inner.round.sent or []) if inner.round is not None else []


def _privacy(
    seed: int = 5, *, reproducible: bool = True, accountant: str = "prv"
) -> PrivacyConfig:
    return PrivacyConfig(
        client_dp=ClientDpSettings(
            clip=CLIP,
            noise_multiplier=Z,
            seed=seed,
            reproducible=reproducible,
            accountant=accountant,
        )
    )


def _settings() -> ClientDpSettings:
    settings = _privacy().client_dp
    assert settings is not None
    return settings


def _clipped_mean(current, replies, denominator):
    """``x + sum_i clip(u_i) / W`` per reply key, float64, by the formula."""
    keys = sorted(replies[0])
    total = {k: torch.zeros_like(current[k], dtype=F64) for k in keys}
    for arrays in replies:
        delta = {k: arrays[k].double() - current[k].double() for k in keys}
        norm = math.sqrt(sum(float(d.square().sum()) for d in delta.values()))
        factor = min(1.0, CLIP / norm)
        for k in keys:
            total[k] += factor * delta[k]
    return {k: current[k].double() + total[k] / denominator for k in keys}


def _update(node: int, arrays: dict[str, torch.Tensor], n: int = 10) -> ClientUpdate:
    return ClientUpdate.of_arrays(arrays, n, node_id=node)


# ------------------------------------------------------------------ the kernel
def test_clipping_bounds_each_update_and_the_denominator_is_fixed():
    g = torch.Generator().manual_seed(0)
    current = {"a": torch.randn(6, 5, generator=g), "b": torch.randn(7, generator=g)}
    updates = [
        _update(
            i,
            {k: v + s * torch.randn(v.shape, generator=g) for k, v in current.items()},
            n=10 * (i + 1),
        )
        for i, s in enumerate([0.01, 0.5, 3.0])
    ]
    space = ParameterSpace(current, ["a", "b"])
    norms = [space.norm(u) for u in updates]
    assert norms[0] < CLIP < norms[2]
    moved, clipped = clip_to_fixed_mean(updates, space, CLIP, denominator=5)
    assert clipped == sum(n > CLIP for n in norms)
    assert all(u.weight == 1.0 for u in moved)  # num-examples do not count
    # each moved update is x + (m / W) clip(u_i): its clipped norm <= C
    for u in moved:
        assert space.norm(u) * 5 / 3 <= CLIP * (1 + 1e-6)
    mean = weighted_means(moved, ["a", "b"])
    want = _clipped_mean(current, [u.arrays for u in updates], 5)
    for k in want:
        assert torch.allclose(mean[k].double(), want[k], atol=1e-6)


def _zero_round(settings: ClientDpSettings, shape=(200, 150), server_round: int = 3):
    """Four zero updates of five sent: the published mean is the noise alone."""
    current = {"w": torch.zeros(shape, dtype=F64)}
    updates = [_update(i, {"w": torch.zeros(shape, dtype=F64)}) for i in range(4)]
    noised, metrics = privatize(
        updates,
        current,
        ["w"],
        settings,
        sent=5,
        population=20,
        server_round=server_round,
        ledger=ClientDpLedger(),
    )
    return weighted_means(noised, ["w"])["w"], metrics


def test_reproducible_noise_is_the_seeded_gaussian_of_std_z_c_over_m():
    shape = (200, 150)  # 30,000 entries: the std is measured to ~1%
    settings = ClientDpSettings(
        clip=CLIP, noise_multiplier=Z, seed=11, reproducible=True
    )
    mean, metrics = _zero_round(settings, shape)
    std = Z * CLIP / 5  # five sent, four replied: the denominator stays five
    assert metrics["client-dp-noise-std"] == pytest.approx(std)
    assert metrics["client-dp-sent"] == 5
    assert metrics["client-dp-reproducible"] == 1.0
    # the whole difference is the seeded draw (zero updates: nothing clipped)
    draw = gaussian_noise({"w": shape}, std, noise_generator(settings, 3))["w"]
    assert torch.allclose(mean, draw, atol=1e-12)
    assert float(mean.std()) == pytest.approx(std, rel=0.03)
    assert abs(float(mean.mean())) < 4 * std / math.sqrt(mean.numel())
    again, _ = _zero_round(settings, shape)
    assert torch.equal(again, mean)
    other, _ = _zero_round(settings, shape, server_round=4)
    assert not torch.equal(other, mean)


def test_secure_noise_has_std_z_c_over_m_and_never_repeats():
    shape = (200, 150)
    settings = ClientDpSettings(clip=CLIP, noise_multiplier=Z, seed=11)
    mean, metrics = _zero_round(settings, shape)
    std = Z * CLIP / 5
    assert metrics["client-dp-noise-std"] == pytest.approx(std)
    assert metrics["client-dp-reproducible"] == 0.0
    assert float(mean.std()) == pytest.approx(std, rel=0.03)
    again, _ = _zero_round(settings, shape)  # same seed, same round
    assert float((again - mean).std()) == pytest.approx(math.sqrt(2) * std, rel=0.03)


# ------------------------------------------------------------ through strategies
@pytest.mark.parametrize("cls", [FedAvgLoRA, FFALoRA])
def test_the_new_global_arrays_are_the_clipped_mean_plus_the_seeded_noise(cls):
    strategy = cls(
        layout=LAYOUT, privacy=_privacy(), screen_ratio=0.0, fraction_evaluate=0.0
    )
    result, current, seen = _start(strategy)
    replies = [arrays for _, arrays in sorted(seen, key=lambda s: s[0])]
    keys = sorted(replies[0])
    want = _clipped_mean(current, replies, denominator=3)
    std = Z * CLIP / 3
    shapes = {k: tuple(current[k].shape) for k in keys}
    noise = gaussian_noise(shapes, std, noise_generator(_settings(), 1))
    new = result.arrays.to_torch_state_dict()
    for k in keys:
        assert torch.allclose(new[k].double(), want[k] + noise[k], atol=1e-5), k
    for k in set(new) - set(keys):  # FFA-LoRA's frozen A: untouched
        assert torch.equal(new[k], current[k])
    metrics = result.train_metrics_clientapp[1]
    assert metrics["client-dp-clipped"] >= 1 and metrics["clients"] == 3


def test_fedsvd_publishes_the_svd_of_the_noised_mean_of_b_times_a():
    strategy = FedSVD(
        layout=LAYOUT, privacy=_privacy(), screen_ratio=0.0, fraction_evaluate=0.0
    )
    result, current, seen = _start(strategy)
    replies = [arrays for _, arrays in sorted(seen, key=lambda s: s[0])]
    keys = sorted(replies[0])
    mean = _clipped_mean(current, replies, denominator=3)
    noise = gaussian_noise(
        {k: tuple(current[k].shape) for k in keys},
        Z * CLIP / 3,
        noise_generator(_settings(), 1),
    )
    new = result.arrays.to_torch_state_dict()
    for module in LAYOUT.modules:
        a, b = current[module.a_key].double(), mean[module.b_key] + noise[module.b_key]
        product = new[module.b_key].double() @ new[module.a_key].double()
        assert torch.allclose(product, b @ a, atol=1e-5)


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_client_dp_epsilon_is_the_accountants_for_q_m_over_n(accountant):
    strategy = FedAvgLoRA(
        layout=LAYOUT,
        privacy=_privacy(accountant=accountant),
        screen_ratio=0.0,
        fraction_evaluate=0.0,
        fraction_train=0.67,
    )
    result, _, _ = _start(strategy, rounds=3)
    accountant_ = RDPAccountant()
    for server_round in (1, 2, 3):
        accountant_.step(noise_multiplier=Z, sample_rate=2 / 3)
        metrics = result.train_metrics_clientapp[server_round]
        assert metrics["clients"] == 2
        # delta = min(1e-5, 1 / (10 * 3))
        want = (
            accountant_.get_epsilon(delta=1e-5)
            if accountant == "rdp"
            else epsilon([(Z, 2 / 3, 1)] * server_round, 1e-5, "prv")
        )
        assert metrics["client-dp-epsilon"] == pytest.approx(want, rel=1e-9)


def test_the_denominator_is_the_nodes_sent_an_instruction_not_the_replies():
    """5 of 8 nodes sent an instruction, one reply lost each round."""
    strategy = FedAvgLoRA(
        layout=LAYOUT,
        privacy=_privacy(),
        screen_ratio=0.0,
        fraction_evaluate=0.0,
        fraction_train=0.625,
    )
    result, current, _ = _start(strategy, rounds=2, nodes=8, lose=1)
    for server_round in (1, 2):
        metrics = result.train_metrics_clientapp[server_round]
        assert metrics["clients"] == 4 and metrics["dropped"] == 1
        assert metrics["client-dp-sent"] == 5
        assert metrics["client-dp-noise-std"] == pytest.approx(Z * CLIP / 5)
        want = epsilon([(Z, 5 / 8, 1)] * server_round, 1e-5, "prv")
        assert metrics["client-dp-epsilon"] == pytest.approx(want, rel=1e-9)
    assert strategy.client_dp_ledger.history == [(Z, 5 / 8, 1)] * 2
    # Round 1's actual noise: the published arrays minus the exact clipped
    # mean over five is the seeded draw of std z C / 5 (over four: not).
    one = FedAvgLoRA(
        layout=LAYOUT,
        privacy=_privacy(),
        screen_ratio=0.0,
        fraction_evaluate=0.0,
        fraction_train=0.625,
    )
    first, _, seen_one = _start(one, rounds=1, nodes=8, lose=1)
    replies = [arrays for _, arrays in sorted(seen_one, key=lambda s: s[0])]
    assert len(replies) == 4
    keys = sorted(replies[0])
    shapes = {k: tuple(current[k].shape) for k in keys}
    noise = gaussian_noise(shapes, Z * CLIP / 5, noise_generator(_settings(), 1))
    new = first.arrays.to_torch_state_dict()
    for denominator, close in ((5, True), (4, False)):
        want = _clipped_mean(current, replies, denominator)
        residual = torch.cat([(new[k].double() - want[k]).flatten() for k in keys])
        drawn = torch.cat([noise[k].flatten() for k in keys])
        assert torch.allclose(residual, drawn, atol=1e-5) is close
    assert float(drawn.std()) == pytest.approx(Z * CLIP / 5, rel=0.1)


def test_a_rejected_round_still_counts_and_the_history_survives_a_checkpoint():
    strategy = FedAvgLoRA(
        layout=LAYOUT,
        privacy=_privacy(),
        screen_ratio=0.0,
        fraction_evaluate=0.0,
        max_update_ratio=1e-12,  # every round is rejected after its noise
    )
    result, _, _ = _start(strategy, rounds=2)
    for server_round in (1, 2):
        metrics = result.train_metrics_clientapp[server_round]
        assert metrics["rejected"] == 1.0
        want = epsilon([(Z, 1.0, 1)] * server_round, 1e-5, "prv")
        assert metrics["client-dp-epsilon"] == pytest.approx(want, rel=1e-9)
    state = strategy.state_dict()
    assert state[CLIENT_DP_STATE] == [[Z, 1.0, 1.0]] * 2
    resumed = FedAvgLoRA(layout=LAYOUT, privacy=_privacy())
    resumed.load_state_dict(state)
    assert resumed.client_dp_ledger.history == [(Z, 1.0, 1)] * 2
    with pytest.raises(CheckpointError, match=CLIENT_DP_STATE):
        resumed.load_state_dict({})
    with pytest.raises(CheckpointError, match="sample rate"):
        resumed.load_state_dict({CLIENT_DP_STATE: [[Z, 1.5, 1.0]]})
    plain = FedAvgLoRA(layout=LAYOUT)  # no client-level DP: an unknown key
    assert CLIENT_DP_STATE not in plain.state_dict()
    with pytest.raises(ValueError, match="keeps no state"):
        plain.load_state_dict(state)


def test_fedavgm_keeps_the_history_beside_its_momentum():
    strategy = FedAvgMLoRA(
        layout=LAYOUT, privacy=_privacy(), screen_ratio=0.0, fraction_evaluate=0.0
    )
    _start(strategy, rounds=2)
    state = strategy.state_dict()
    assert set(state) == {"momentum", CLIENT_DP_STATE}
    assert len(state[CLIENT_DP_STATE]) == 2
    resumed = FedAvgMLoRA(layout=LAYOUT, privacy=_privacy())
    resumed.load_state_dict(state)
    assert resumed.client_dp_ledger.history == strategy.client_dp_ledger.history
    assert set(resumed.momentum) == set(strategy.momentum)
    with pytest.raises(CheckpointError, match=CLIENT_DP_STATE):
        resumed.load_state_dict({"momentum": state["momentum"]})


# ------------------------------------------------------------ refusals
@pytest.mark.parametrize("method", ["fedex-lora", "fedspec", "flexlora", "vera-fedex"])
def test_client_dp_is_refused_for_methods_that_are_not_sum_only(method):
    with pytest.raises(PrivacyUnsupportedError, match="client-dp-clip"):
        resolve(
            {
                "method": method,
                "client-dp-clip": 1.0,
                "client-dp-noise-multiplier": 1.0,
            }
        )


def test_client_dp_is_refused_with_a_robust_rule():
    with pytest.raises(ConfigError, match="robust"):
        FedAvgLoRA(
            layout=LAYOUT, privacy=_privacy(), robust=RobustConfig(rule="median")
        )


def test_replies_with_extra_records_are_refused_by_name():
    current = {"w": torch.zeros(3)}
    update = ClientUpdate.of_arrays(
        {"w": torch.ones(3)}, node_id=1, extras={"scaffold-delta": {"w": torch.ones(3)}}
    )
    with pytest.raises(PrivacyUnsupportedError, match="scaffold-delta"):
        privatize(
            [update],
            current,
            ["w"],
            ClientDpSettings(clip=1.0, noise_multiplier=1.0),
            sent=1,
            population=1,
            server_round=1,
            ledger=ClientDpLedger(),
        )


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"client_dp_noise_multiplier": 1.0}, "client-dp-clip"),
        ({"client_dp_clip": 1.0}, "client-dp-noise-multiplier"),
        ({"client_dp_clip": 1.0, "client_dp_noise_multiplier": -1.0}, None),
    ],
)
def test_inconsistent_client_dp_settings_name_their_key(values, key):
    with pytest.raises(ConfigError) as caught:
        PrivacyConfig.from_values(**values)
    assert caught.value.key == (key or "client-dp-noise-multiplier")


# ------------------------------------------------------------ Flower's wrappers
@pytest.mark.parametrize("cls", [FedAvgLoRA, FFALoRA])
def test_flowers_server_side_fixed_clipping_wraps_sum_only_lora_methods(cls):
    np.random.seed(0)  # Flower's wrapper draws its noise from numpy's global RNG
    inner = cls(layout=LAYOUT, screen_ratio=0.0, fraction_evaluate=0.0)
    wrapped = DifferentialPrivacyServerSideFixedClipping(
        inner, noise_multiplier=Z, clipping_norm=CLIP, num_sampled_clients=3
    )
    replies: list[tuple[int, Message]] = []

    def hook(partition: int, message: Message, reply: Message) -> Message:
        replies.append((partition, reply))  # the wrapper clips these in place
        return reply

    grid = InProcessGrid(_client_app(), num_nodes=3, run_config={}, reply_hook=hook)
    current = adapter_state(MODEL, LAYOUT, inner.send_roles)
    result = wrapped.start(
        grid=grid,
        initial_arrays=ArrayRecord(current),
        num_rounds=1,
        train_config=ConfigRecord({"lr": 0.1}),
    )
    clipped = [
        r.content[ARRAYS].to_torch_state_dict()
        for _, r in sorted(replies, key=lambda pr: pr[0])
    ]
    keys = sorted(clipped[0])
    for arrays in clipped:  # flat update norms are now at most C
        norm = math.sqrt(
            sum(float((arrays[k] - current[k]).double().square().sum()) for k in keys)
        )
        assert norm <= CLIP * (1 + 1e-5)
    # The strategy then took its num-examples-weighted mean (Flower's wrapper
    # does not make it uniform), and the wrapper added N(0, (z C / 3)^2).
    weights = torch.tensor(SIZES, dtype=F64) / sum(SIZES)
    new = result.arrays.to_torch_state_dict()
    residual = torch.cat(
        [
            (
                new[k].double()
                - sum(w * a[k].double() for w, a in zip(weights, clipped, strict=True))
            ).flatten()
            for k in keys
        ]
    )
    assert residual.numel() > 300
    assert float(residual.std()) == pytest.approx(Z * CLIP / 3, rel=0.15)


def test_flowers_server_side_fixed_clipping_cannot_wrap_fedsvd():
    inner = FedSVD(layout=LAYOUT, screen_ratio=0.0, fraction_evaluate=0.0)
    wrapped = DifferentialPrivacyServerSideFixedClipping(
        inner, noise_multiplier=Z, clipping_norm=CLIP, num_sampled_clients=3
    )
    # It subtracts the sent arrays from the replies' by position; FedSVD sends
    # A and B but receives B only (where the shapes happened to agree it would
    # subtract the wrong arrays silently).
    with pytest.raises(ValueError, match="could not be broadcast"):
        _start(wrapped, inner=inner)
