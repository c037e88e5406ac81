"""FedDPA: the dynamic weight (kernel) and the dual-adapter client feature.

In float64 against the paper's equations written out densely: the local
adapter's gradient is that of the mixed model ``W0 + (1 - a) [G] + a L``
(the global adapter frozen), the global adapter's that of ``W0 + G`` alone;
at evaluation every instance gets ``alpha(x) = clip(w mean_k cos(phi(x),
phi_k), 0, 1)`` and the model ``W0 + (1 - alpha) G + alpha L``. The feature
runs through the public client helpers on a peft MLP whose forward returns
its loss when given labels (as fedlr's tasks and Hugging Face models do).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from peft import LoraConfig, get_peft_model

from fedlr import apply_round
from fedlr.adapters import parameters_by_key
from fedlr.flower.records import record_to_state
from fedlr.strategies.feddpa import (
    FEDDPA_MIX,
    FEDDPA_WEIGHT,
    LOCAL_STEPS,
    FedDPA,
    dynamic_weight,
)
from fedlr.wire import protocol
from tests.plugin_app.task import MLP, load_data
from tests.strategies.test_plugin import _context, _message

F64 = torch.float64
MIX, WEIGHT, ANCHORS = 0.3, 0.8, 4


class LossMLP(MLP):
    """The plug-in MLP, returning its loss when called with labels."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None):  # type: ignore[override]
        logits = super().forward(x)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits, labels)
        return SimpleNamespace(logits=logits, loss=loss)


def _model():
    torch.manual_seed(0)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["fc1", "fc2"], modules_to_save=["classifier"]
    )
    return get_peft_model(LossMLP(), config)


def _strategy(model) -> FedDPA:
    return FedDPA.for_model(
        model, feddpa_mix=MIX, feddpa_weight=WEIGHT, feddpa_anchors=ANCHORS
    )


def _instruction(strategy, model, server_round: int, kind: str = "train"):
    g = torch.Generator().manual_seed(server_round)
    arrays = {
        k: v + 0.3 * torch.randn(v.shape, generator=g)
        for k, v in record_to_state(strategy.initial_arrays(model)).items()
    }
    config = strategy.begin_round(
        server_round, ArrayRecord(arrays), ConfigRecord({"lr": 0.1})
    )
    config[protocol.SERVER_ROUND] = server_round
    content = RecordDict(
        {protocol.ARRAYS: ArrayRecord(arrays), protocol.CONFIG: config}
    )
    return _message(content, 1000, kind), arrays


# --------------------------------------------------------- dense reference
def _dense(model, global_: dict, local: dict, x, alpha_g, alpha_l):
    """Logits of ``W0 x + alpha_g s G x + alpha_l s L x`` per adapted layer, in
    float64 (``alpha_*``: scalars or (n, 1) columns), and fc2's output."""
    base = model.base_model.model
    h = x.double()
    outs = []
    for name in ("fc1", "fc2"):
        layer = getattr(base, name)
        a_key = f"base_model.model.{name}.lora_A.weight"
        b_key = f"base_model.model.{name}.lora_B.weight"
        s = float(layer.scaling["default"])  # lora-alpha / r, as the round set it
        w0 = layer.base_layer.weight.double()
        b0 = layer.base_layer.bias.double()
        glob = s * h @ global_[a_key].double().T @ global_[b_key].double().T
        loc = s * h @ local[a_key].T @ local[b_key].T
        out = h @ w0.T + b0 + alpha_g * glob + alpha_l * loc
        outs.append(out)
        h = torch.relu(out)
    head = base.classifier.modules_to_save["default"]
    return h @ head.weight.double().T + head.bias.double(), outs[-1]


# ------------------------------------------------------------------- kernel
def test_dynamic_weight_is_the_capped_mean_cosine():
    g = torch.Generator().manual_seed(3)
    reps = torch.randn(6, 5, generator=g, dtype=F64)
    anchors = torch.randn(4, 5, generator=g, dtype=F64)
    got = dynamic_weight(reps, anchors, 0.7)
    for i in range(6):
        cos = [
            float(reps[i] @ anchors[k] / (reps[i].norm() * anchors[k].norm()))
            for k in range(4)
        ]
        want = min(max(0.7 * sum(cos) / 4, 0.0), 1.0)
        assert abs(float(got[i]) - want) < 1e-12
    # an instance among the anchors' direction gets the cap, its opposite 0
    same = dynamic_weight(anchors[:1] * 3.0, anchors[:1], 0.7)
    assert abs(float(same[0]) - 0.7) < 1e-12
    assert float(dynamic_weight(-anchors[:1], anchors[:1], 0.7)[0]) == 0.0
    with pytest.raises(ValueError, match="width 5 against anchors of width 4"):
        dynamic_weight(reps, anchors[:, :4], 0.5)


# ------------------------------------------------------------------- server
def test_server_sends_the_mix_from_round_two_and_averages_the_global_adapter():
    strategy = _strategy(_model())
    first, second = strategy.round_config(1), strategy.round_config(2)
    assert FEDDPA_MIX not in first and second[FEDDPA_MIX] == MIX
    assert first[FEDDPA_WEIGHT] == WEIGHT and first[protocol.PERSONAL_SPLIT]
    assert strategy.personalised and strategy.fraction_evaluate == 1.0
    assert set(strategy.send_keys()) == set(strategy.reply_shapes())


# ------------------------------------------------------------------- client
def test_local_adapter_trains_in_the_mix_and_weights_each_instance_at_eval():
    model = _model()
    strategy = _strategy(model)
    context = _context()
    message, _ = _instruction(strategy, model, 2)
    job = apply_round(model, message, context)
    assert [type(f).__name__ for f in job.features] == [
        "PersonalArrays",
        "DualAdapter",
    ]
    (dual,) = [f for f in job.features if type(f).__name__ == "DualAdapter"]
    x, y = load_data(0)
    params = parameters_by_key(model, strategy.layout)
    keys = strategy.layout.keys(*strategy.train_roles)
    optimizer = job.optimizer(torch.optim.SGD(job.parameters(), lr=0.1))
    for _ in range(3):
        optimizer.zero_grad()
        out = job.model(x=x, labels=y)
        # the global adapter's gradient: its loss alone
        global_grads = torch.autograd.grad(
            out.loss, [params[k] for k in keys], retain_graph=True
        )
        objective = out.loss + job.penalty()
        objective.backward()
        for k, want in zip(keys, global_grads, strict=True):
            torch.testing.assert_close(params[k].grad, want)
        # the local adapter's gradient: the mixed model, G frozen (float64)
        local = {
            k: v.detach().double().requires_grad_(True) for k, v in dual.local.items()
        }
        now = {k: params[k].detach() for k in keys}
        logits, _ = _dense(model, now, local, x, 1.0 - MIX, MIX)
        dense_loss = torch.nn.functional.cross_entropy(logits, y)
        dense_grads = torch.autograd.grad(dense_loss, list(local.values()))
        for t, want in zip(dual.local.values(), dense_grads, strict=True):
            torch.testing.assert_close(t.grad.double(), want, rtol=1e-5, atol=1e-7)
        optimizer.step()
    answer = job.reply(num_examples=len(y))
    assert answer.content.metric_records[protocol.METRICS][LOCAL_STEPS] == 3
    assert set(record_to_state(answer.content[protocol.ARRAYS])) == set(keys)
    kept = record_to_state(context.state["fedlr-feddpa-local"])
    assert float(kept[strategy.layout.modules[0].b_key].abs().max()) > 0  # trained
    anchors = record_to_state(context.state["fedlr-feddpa-anchors"])["anchors"]
    assert anchors.shape == (ANCHORS, 16)  # fc2's width, K of the last batch

    # evaluation: alpha per instance, then the weighted dual-adapter model
    evaluation, sent_eval = _instruction(strategy, model, 3, kind="evaluate")
    job = apply_round(model, evaluation, context)
    assert job.personal_loaded
    xt, _ = load_data(0, split="test", n=10)
    with torch.no_grad():
        got = job.model(x=xt).logits
    local64 = {k: v.double() for k, v in kept.items()}
    _, phi = _dense(model, sent_eval, local64, xt, 0.0, 1.0)  # local adapter alone
    alpha = dynamic_weight(phi, anchors.double(), WEIGHT)
    assert 0.0 < float(alpha.max()) <= WEIGHT and float(alpha.std()) > 0
    want, _ = _dense(
        model, sent_eval, local64, xt, (1.0 - alpha)[:, None], alpha[:, None]
    )
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # not vacuous: the global model alone differs
    alone, _ = _dense(model, sent_eval, local64, xt, 1.0, 0.0)
    assert float((alone - want).abs().max()) > 1e-3


def test_a_model_without_its_own_loss_trains_the_global_adapter_only():
    from tests.plugin_app.task import build_model

    model = build_model("feddpa")
    strategy = _strategy(model)
    context = _context()
    job = apply_round(model, _instruction(strategy, model, 2)[0], context)
    x, y = load_data(0)
    loss = torch.nn.functional.cross_entropy(job.model(x), y) + job.penalty()
    loss.backward()
    answer = job.reply(num_examples=len(y))
    assert answer.content.metric_records[protocol.METRICS][LOCAL_STEPS] == 0
    assert "fedlr-feddpa-local" in context.state.array_records
    # the hooks are gone after the reply: the model is the global one again
    before = copy.deepcopy(model)
    torch.testing.assert_close(model(x), before(x))
