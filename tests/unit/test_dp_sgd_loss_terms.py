"""DP-SGD with a loss term that reads no data (fedlr.privacy.dp_sgd, issue 34).

FedProx's proximal term ``(mu / 2) ||w - w_g||^2`` is a function of the
parameters and the global ones only. Under DP-SGD its gradient is added after
the per-example clipping and noise, so one local step moves the parameters by

    (sum_i clip_C(g_i) + xi) / (q n) + mu (w - w_g),

``g_i`` each drawn example's gradient of its own loss, ``xi`` the Gaussian
noise of standard deviation ``sigma C``. Checked here in float64 on a tiny
peft LoRA model against that formula computed by hand, with the same Poisson
draw and the same noise (the reproducible-noise path: both come from the
seeded generators of :func:`fedlr.randomness.seeded_generator`). The
term changes nothing the accountant sees: the epsilon a node reports is the one
without it. A term that reads the data stays refused, at configuration and on
the node.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord, Context, Message, RecordDict
from peft import LoraConfig, get_peft_model

from fedlr import apply_round
from fedlr.adapters.plugin import adapted
from fedlr.adapters.roles import Role
from fedlr.client.features import ClientFeature, RoundJob
from fedlr.client.train import TrainSettings, train_steps
from fedlr.errors import PrivacyUnsupportedError, ProtocolError
from fedlr.flower.records import state_to_record
from fedlr.privacy.accounting import epsilon
from fedlr.privacy.dp_sgd import DP_EPSILON_RUN, DP_EPSILON_SPENT, sample_mean_loss
from fedlr.privacy.settings import DpSgdSettings, PrivacyConfig, default_delta
from fedlr.randomness import seeded_generator
from fedlr.strategies.fedprox_lora import PROXIMAL_MU, ProximalTerm
from fedlr.strategies.refusals import check_privacy
from fedlr.strategies.registry import get_method, resolve
from fedlr.wire import protocol

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")

F64 = torch.float64
ROLES = (Role.LORA_A, Role.LORA_B, Role.HEAD)
N, BATCH, CLIP, SIGMA, MU, SEED = 8, 4, 0.05, 1.0, 0.3, 7


class _Tiny(torch.nn.Module):
    """``classifier(tanh(fc(x)))``; LoRA on ``fc``, the head trained."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.classifier = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        logits = self.classifier(torch.tanh(self.fc(x)))
        return SimpleNamespace(logits=logits, loss=F.cross_entropy(logits, labels))


class _Data:
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(N, 4, generator=g, dtype=F64)
        self.y = torch.randint(0, 2, (N,), generator=g)

    def __len__(self) -> int:
        return N

    def batch(self, indices: Any) -> dict[str, torch.Tensor]:
        rows = list(indices)
        return {"x": self.x[rows], "labels": self.y[rows]}


class _Recorder(torch.optim.SGD):
    """SGD with step size 1 (the step is minus the gradient it is given)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=1.0)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LoraConfig(
        r=2, lora_alpha=4, target_modules=["fc"], modules_to_save=["classifier"]
    )
    model = get_peft_model(_Tiny(), config).double()
    with torch.no_grad():  # B = 0 at init: give the adapter a nonzero product
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, dtype=F64))
    return model


def _instruction(model: torch.nn.Module, mu: float | None) -> Message:
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 0
    settings = DpSgdSettings(
        max_grad_norm=CLIP, noise_multiplier=SIGMA, reproducible=True
    )
    config: dict[str, Any] = {
        protocol.SERVER_ROUND: 1,
        protocol.LR: 0.1,
        protocol.LOCAL_STEPS: 1,
        protocol.BATCH_SIZE: BATCH,
        protocol.TRAIN_ROLES: protocol.encode_roles(ROLES),
        **settings.instruction(),
    }
    if mu is not None:
        config[PROXIMAL_MU] = mu
    arrays = state_to_record(adapted(model).state(ROLES))
    content = RecordDict(
        {protocol.ARRAYS: arrays, protocol.CONFIG: ConfigRecord(config)}
    )
    return Message(content=content, dst_node_id=1, message_type="train")


def _context(state_dir: Path) -> Context:
    node = {
        "dp-allow-reproducible-noise": True,  # the simulation's seeded noise
        "state-dir": str(state_dir),
        "dp-ledger-id": "tiny",
    }
    return Context(
        run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config={}
    )


def _one_step(mu: float | None, state_dir: Path, offset: float = 0.1):
    """One DP-SGD step after moving the parameters ``offset`` away from the
    received ones: (parameters before, received, after, the job's reply)."""
    model = _model()
    job = apply_round(model, _instruction(model, mu), _context(state_dir))
    params = job.parameters()
    received = [p.detach().clone() for p in params]
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # w != w_g, so the proximal gradient is not 0
        for p in params:
            p.add_(offset * torch.randn(p.shape, generator=g, dtype=F64))
    before = [p.detach().clone() for p in params]
    train_steps(
        job.model,
        _Data(),
        TrainSettings(local_steps=1, lr=0.1, batch_size=BATCH),
        seed=SEED,
        device=torch.device("cpu"),
        penalty=job.penalty if job.has_penalty else None,
        wrap_optimizer=lambda opt: _Recorder(params),
        control=job.loop_control(),
    )
    after = [p.detach().clone() for p in params]
    return job, params, received, before, after


def _by_hand(
    model_params: list[torch.nn.Parameter], before, model
) -> list[torch.Tensor]:
    """``(sum_i clip_C(g_i) + xi) / (q n)`` at ``before``, the same draws."""
    data = _Data()
    # 1. the Poisson draw of the loop (seed + 1), then each drawn example's
    #    gradient of its own loss by plain autograd
    drawn = torch.rand(N, generator=seeded_generator([SEED + 1])) < BATCH / N
    rows = drawn.nonzero().flatten().tolist()
    assert 0 < len(rows) < N  # a real subsample
    with torch.no_grad():
        for p, value in zip(model_params, before, strict=True):
            p.copy_(value)
    grads = []
    for i in rows:
        one = data.batch([i])
        loss = sample_mean_loss(model(**one).logits, one["labels"])
        grads.append(torch.autograd.grad(loss, model_params))
    # 2. clipped to C as Opacus does (its 1e-6 in the denominator), summed
    norms = torch.stack([torch.sqrt(sum(g.square().sum() for g in gs)) for gs in grads])
    factors = (CLIP / (norms + 1e-6)).clamp(max=1.0)
    assert bool((norms > CLIP).any())  # the clipping binds
    summed = [
        sum(float(factors[k]) * grads[k][j] for k in range(len(rows)))
        for j in range(len(model_params))
    ]
    # 3. the noise: N(0, (sigma C)^2) per entry, from the loop's seeded
    #    generator (seed), drawn parameter by parameter in the optimizer's order
    noise = seeded_generator([SEED])
    expected_batch = round(BATCH / N * N)
    out = []
    for p, s in zip(model_params, summed, strict=True):
        xi = torch.normal(
            mean=0.0, std=SIGMA * CLIP, size=p.shape, generator=noise, dtype=F64
        )
        out.append((s + xi) / expected_batch)
    return out


def test_the_step_is_the_noised_clipped_data_gradient_plus_the_proximal_gradient(
    tmp_path,
):
    plain, params, _, before, after = _one_step(None, tmp_path / "plain")
    prox, _, received, prox_before, prox_after = _one_step(MU, tmp_path / "prox")
    assert not plain.has_penalty
    assert any(isinstance(f, ProximalTerm) for f in prox.features)
    assert all(torch.equal(a, b) for a, b in zip(before, prox_before, strict=True))
    # 1. without the term: the noised mean of the clipped per-example
    #    gradients, by hand with the same draws (the per-example losses are
    #    computed in float32, sample_mean_loss; the rest in float64)
    data_part = _by_hand(params, before, plain.model)
    for b, a, want in zip(before, after, data_part, strict=True):
        assert torch.allclose(b - a, want, rtol=1e-6, atol=1e-9)
    # 2. with it: the same step plus mu (w - w_g), in float64
    for b, a, pa, w_g in zip(prox_before, after, prox_after, received, strict=True):
        added = (b - pa) - (b - a)  # the step with the term minus the one without
        want = MU * (b - w_g)
        assert float(want.abs().max()) > 1e-3  # w != w_g: a real term
        assert torch.allclose(added, want, rtol=0.0, atol=1e-14), (
            (added - want).abs().max()
        )


def test_the_proximal_term_leaves_the_reported_epsilon_unchanged(tmp_path):
    with_term, *_ = _one_step(MU, tmp_path / "a")
    without, *_ = _one_step(None, tmp_path / "b")
    a = with_term.reply(num_examples=N).content[protocol.METRICS]
    b = without.reply(num_examples=N).content[protocol.METRICS]
    assert a[DP_EPSILON_SPENT] == b[DP_EPSILON_SPENT]
    assert a[DP_EPSILON_RUN] == b[DP_EPSILON_RUN]
    # and both are the accountant's epsilon of one step (sigma, q, 1)
    want = epsilon([(SIGMA, BATCH / N, 1)], default_delta(N), "prv")
    assert a[DP_EPSILON_SPENT] == pytest.approx(want, rel=1e-12)


# ----------------------------------------------------------- configuration
DP = {"dp-max-grad-norm": 1.0, "dp-epsilon": 4.0}


def test_fedprox_lora_with_dp_sgd_is_accepted_at_configuration():
    config = resolve({"method": "fedprox-lora", "proximal-mu": 0.1, **DP})
    assert config.run.privacy.dp_sgd is not None
    assert config.options.proximal_mu == 0.1  # type: ignore[attr-defined]
    assert ProximalTerm.loss_reads_data is False and ProximalTerm.adds_loss()


class _ReadsData(ClientFeature):
    """A loss term computed on the node's examples (a distillation loss, say)."""

    order = 41

    @classmethod
    def training_change(cls, options: Any) -> str | None:
        return "a distillation loss on the node's examples"

    @classmethod
    def for_round(cls, job: RoundJob) -> _ReadsData | None:
        return cls() if job.is_train and "distil-weight" in job.config else None

    def loss(self, job: RoundJob) -> Any:
        params = job.parameters()
        return lambda: sum(p.sum() for p in params)


def test_a_loss_term_that_reads_the_data_is_refused_at_configuration():
    assert _ReadsData.loss_reads_data  # the default: assume it reads the data
    privacy = PrivacyConfig(dp_sgd=DpSgdSettings(max_grad_norm=1.0, epsilon=4.0))
    spec = get_method("fedprox-lora")
    with pytest.raises(PrivacyUnsupportedError) as caught:
        check_privacy(
            "distil-lora", True, "lora", privacy, (*spec.client, _ReadsData), None
        )
    message = str(caught.value)
    assert "dp-max-grad-norm: DP-SGD clips" in message
    assert "method 'distil-lora'" in message
    assert "a distillation loss on the node's examples" in message
    assert "a loss term that reads the data (_ReadsData)" in message
    # the proximal term alone passes the same check
    check_privacy("fedprox-lora", True, "lora", privacy, spec.client, None)


def test_the_node_refuses_a_data_reading_term_beside_dp_sgd(tmp_path, monkeypatch):
    import fedlr.client.round as client

    features = client.client_features()
    monkeypatch.setattr(client, "client_features", lambda: [*features, _ReadsData])
    model = _model()
    message = _instruction(model, MU)
    message.content[protocol.CONFIG]["distil-weight"] = 1.0
    job = apply_round(model, message, _context(tmp_path))
    assert {type(f) for f in job.features} >= {ProximalTerm, _ReadsData}
    with pytest.raises(
        ProtocolError, match=r"\['_ReadsData'\] \(a loss term that reads"
    ):
        job.loop_control()


# ----------------------------------------------------- once per step
class _Counted(ClientFeature):
    """A loss term that reads no data and counts its calls."""

    order = 42
    loss_reads_data = False
    calls = 0

    @classmethod
    def training_change(cls, options: Any) -> str | None:
        return "a counted term of the parameters"

    @classmethod
    def for_round(cls, job: RoundJob) -> _Counted | None:
        return cls() if job.is_train and "count-weight" in job.config else None

    def loss(self, job: RoundJob) -> Any:
        params = job.parameters()

        def term() -> torch.Tensor:
            _Counted.calls += 1
            return 1e-3 * sum(p.square().sum() for p in params)

        return term


@pytest.mark.parametrize("private", [True, False])
def test_a_data_free_term_runs_once_per_step(tmp_path, monkeypatch, private):
    """Under DP-SGD the term runs in the step hook only (not in the loss as
    well); without it, in the loss: one call per step either way."""
    import fedlr.client.round as client

    features = client.client_features()
    monkeypatch.setattr(client, "client_features", lambda: [*features, _Counted])
    model = _model()
    message = _instruction(model, None)
    config = message.content[protocol.CONFIG]
    config["count-weight"] = 1.0
    if not private:
        for key in DpSgdSettings(max_grad_norm=CLIP, epsilon=1.0).instruction():
            config.pop(key, None)
    job = apply_round(model, message, _context(tmp_path))
    control = job.loop_control()
    assert (control is not None) is private and job.has_penalty
    steps = 5
    _Counted.calls = 0
    train_steps(
        job.model,
        _Data(),
        TrainSettings(local_steps=steps, lr=0.1, batch_size=BATCH),
        seed=SEED,
        device=torch.device("cpu"),
        penalty=job.penalty,
        control=control,
    )
    assert _Counted.calls == steps
