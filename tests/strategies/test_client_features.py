"""Client features (fedlr.client.features): the registry's list, SCAFFOLD and FedAvgM.

The features run through the public client helpers (``apply_round``,
``ClientRound.after_backward``, ``ClientRound.reply``) on the plug-in app's
real peft LoRA model; the numbers are checked against the formulas of
docs/methods/scaffold-lora.md and docs/methods/fedavgm-lora.md in float64.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fedlr import apply_round
from fedlr.adapters import Role, parameters_by_key
from fedlr.client.features import ClientFeature, common_features
from fedlr.errors import ProtocolError
from fedlr.flower import InProcessGrid
from fedlr.flower.records import record_to_state
from fedlr.robust.rules import RobustConfig, robust_aggregate
from fedlr.round.pipeline import run_round
from fedlr.strategies.fedavgm_lora import FedAvgMLoRA, ServerMomentumOptions
from fedlr.strategies.feddyn_lora import FedDynLoRA
from fedlr.strategies.registry import client_features, registered_methods
from fedlr.strategies.scaffold_lora import (
    CONTROL,
    CONTROL_DELTA,
    ScaffoldLoRA,
    ScaffoldOptions,
)
from fedlr.wire.updates import ClientUpdate
from tests.plugin_app.client_app import app as plugin_client
from tests.plugin_app.task import build_model, load_data
from tests.strategies.conftest import reply
from tests.strategies.test_plugin import _config, _context, _instruction

F64 = torch.float64


# ------------------------------------------------------------------ registry
def test_every_feature_is_registered_by_a_method_and_lives_in_a_strategy_module():
    listed = {c for spec in registered_methods() for c in spec.client}
    common = set(common_features())  # any method's (DP-SGD)
    features = client_features()
    assert set(features) == listed | common and len(features) == len(listed | common)
    for cls in features:
        assert issubclass(cls, ClientFeature)
        home = "fedlr.privacy." if cls in common else "fedlr.strategies."
        assert cls.__module__.startswith(home), cls
    orders = [(c.order, c.__module__, c.__qualname__) for c in features]
    assert orders == sorted(orders)
    # the proximal term is summed before the pruning term, as before
    names = [c.__name__ for c in features]
    assert names.index("ProximalTerm") < names.index("RankSelfPruning")


def test_a_method_without_features_gets_none_on_the_node():
    model = build_model("fedavg-lora")
    strategy = FedAvgMLoRA.for_model(model)
    job = apply_round(model, _instruction(strategy, model), _context())
    assert job.features == () and not job.has_gradient_hooks
    assert not job.has_penalty


# ------------------------------------------------------------------ SCAFFOLD
def _scaffold_instruction(strategy: ScaffoldLoRA, model, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    strategy.control = {
        k: 0.1 * torch.randn(v.shape, generator=g) for k, v in strategy.control.items()
    }
    message = _instruction(strategy, model)
    arrays = message.content.array_records["arrays"]
    [message] = strategy.instructions(1, [message], arrays, train=True)
    return message


def _loss_and_grads(job, x, y):
    for p in job.parameters():
        p.grad = None
    loss = torch.nn.functional.cross_entropy(job.model(x), y)
    loss.backward()
    return {id(p): p.grad.detach().clone() for p in job.parameters()}


def test_scaffold_corrects_gradients_and_updates_the_control_variate():
    model = build_model("scaffold-lora")
    strategy = ScaffoldLoRA.for_model(model, options=ScaffoldOptions(scaffold_lr=0.1))
    context = _context()
    message = _scaffold_instruction(strategy, model)
    job = apply_round(model, message, context)
    assert [type(f).__name__ for f in job.features] == ["ScaffoldCorrection"]
    x, y = load_data(0)
    keys = strategy.layout.keys(*strategy.train_roles)
    from fedlr.adapters import parameters_by_key

    params = parameters_by_key(model, strategy.layout)
    start = {k: params[k].detach().double().clone() for k in keys}
    lr, steps = 0.1, 3
    for _ in range(steps):
        raw = _loss_and_grads(job, x, y)
        job.after_backward()
        for k in keys:  # c_i = 0 on a new node: the correction is c
            want = raw[id(params[k])].double() + strategy.control[k].double()
            torch.testing.assert_close(params[k].grad.double(), want)
        with torch.no_grad():
            for p in job.parameters():
                p.sub_(lr * p.grad)
    answer = job.reply(num_examples=len(y))
    delta = record_to_state(answer.content[CONTROL_DELTA])
    assert set(delta) == set(keys)
    for k in keys:
        c = strategy.control[k].double()
        new_ci = -c + (start[k] - params[k].detach().double()) / (steps * lr)
        torch.testing.assert_close(delta[k].double(), new_ci, rtol=1e-5, atol=1e-6)
    stored = record_to_state(context.state["fedlr-scaffold"])
    kept = {k: stored[f"pending:{k}"] for k in keys}  # pending until applied
    for k in keys:
        torch.testing.assert_close(kept[k], delta[k])  # c_i was 0
        assert not stored[f"c_i:{k}"].any()

    # Round 2 on the same node, the server having applied round 1's delta:
    # the correction is c - c_i.
    strategy.applied[1000] = (1, 1.0, 1.0)
    job = apply_round(model, _scaffold_instruction(strategy, model, 4), context)
    raw = _loss_and_grads(job, x, y)
    job.after_backward()
    for k in keys:
        want = raw[id(params[k])].double() + (
            strategy.control[k].double() - kept[k].double()
        )
        torch.testing.assert_close(params[k].grad.double(), want)


@pytest.mark.parametrize(
    "bad",
    ["shape", "nan", "missing"],
)
def test_scaffold_node_refuses_a_bad_control_record(bad):
    model = build_model("scaffold-lora")
    strategy = ScaffoldLoRA.for_model(model)
    message = _scaffold_instruction(strategy, model)
    control = record_to_state(message.content[CONTROL])
    key = sorted(control)[0]
    if bad == "shape":
        control[key] = torch.zeros(control[key].shape[0] + 1, *control[key].shape[1:])
    elif bad == "nan":
        control[key] = torch.full_like(control[key], math.nan)
    else:
        del control[key]
    message.content[CONTROL] = ArrayRecord(control)
    with pytest.raises(ProtocolError, match=CONTROL):
        apply_round(model, message, _context())


def test_scaffold_reply_without_after_backward_says_what_to_call():
    model = build_model("scaffold-lora")
    strategy = ScaffoldLoRA.for_model(model)
    job = apply_round(model, _scaffold_instruction(strategy, model), _context())
    with pytest.raises(ProtocolError, match=r"after_backward"):
        job.reply(num_examples=4)


def test_scaffold_server_moves_c_by_the_mean_delta_and_drops_a_reply_without_it():
    model = build_model("scaffold-lora")
    strategy = ScaffoldLoRA.for_model(model)
    current = record_to_state(strategy.initial_arrays(model))
    strategy.begin_round(
        1, ArrayRecord(current), ConfigRecord({}), population=4
    )  # 3 of 4 nodes reply
    keys = strategy.layout.keys(*strategy.train_roles)
    g = torch.Generator().manual_seed(0)
    deltas, replies = [], []
    for node in range(3):
        delta = {k: torch.randn(current[k].shape, generator=g) for k in keys}
        deltas.append(delta)
        message = reply(1000 + node, current, {"num-examples": 1 + node})
        message.content[CONTROL_DELTA] = ArrayRecord(delta)
        replies.append(message)
    replies.append(reply(1003, current, {"num-examples": 5}))  # no delta
    _, metrics = strategy.aggregate_train(1, replies)
    assert metrics["dropped"] == 1 and metrics["clients"] == 3
    for k in keys:
        mean = torch.stack([d[k].double() for d in deltas]).mean(0)
        torch.testing.assert_close(
            strategy.control[k].double(), 0.75 * mean, rtol=1e-6, atol=1e-7
        )
    norm = math.sqrt(
        sum(float(v.double().square().sum()) for v in strategy.control.values())
    )
    assert metrics["control-norm"] == pytest.approx(norm, rel=1e-6)


def test_scaffold_two_rounds_in_process_through_the_plugin_app():
    config = _config("scaffold-lora")
    grid = InProcessGrid(plugin_client, num_nodes=3, run_config=config)
    model = build_model("scaffold-lora")
    strategy = ScaffoldLoRA.for_model(model)
    arrays = strategy.initial_arrays(model)
    norms = []
    for server_round in (1, 2):
        arrays = run_round(
            strategy, grid, server_round, arrays, ConfigRecord({"lr": 0.1})
        )
        report = strategy.last_report.metrics
        assert report["clients"] == 3 and report["dropped"] == 0
        norms.append(report["control-norm"])
        sent = sum(
            v.numel() * 4 for v in strategy.control.values()
        )  # float32 control to each of 3 nodes, beside the arrays
        assert report["bytes-down"] >= 3 * sent
    assert all(math.isfinite(n) and n > 0 for n in norms)


# ------------------------------------------------------------------- FedAvgM
def test_fedavgm_momentum_steps_match_the_formula_over_three_rounds():
    model = build_model("fedavgm-lora")
    beta, eta = 0.6, 0.8
    strategy = FedAvgMLoRA.for_model(
        model, options=ServerMomentumOptions(server_momentum=beta, server_lr=eta)
    )
    x = {
        k: v.double()
        for k, v in record_to_state(strategy.initial_arrays(model)).items()
    }
    keys = strategy.layout.keys(*strategy.train_roles)
    v = {k: torch.zeros_like(x[k]) for k in keys}
    g = torch.Generator().manual_seed(1)
    for server_round in (1, 2, 3):
        strategy.begin_round(
            server_round,
            ArrayRecord({k: t.float() for k, t in x.items()}),
            ConfigRecord({}),
        )
        clients = [
            {k: x[k] + 0.1 * torch.randn(x[k].shape, generator=g, dtype=F64) for k in x}
            for _ in range(3)
        ]
        weights = [2.0, 3.0, 5.0]
        replies = [
            reply(
                1000 + i, {k: t.float() for k, t in c.items()}, {"num-examples": int(w)}
            )
            for i, (c, w) in enumerate(zip(clients, weights, strict=True))
        ]
        arrays, metrics = strategy.aggregate_train(server_round, replies)
        new = record_to_state(arrays)
        sent = {k: t.float().double() for k, t in x.items()}
        for k in keys:
            mean = (
                sum(
                    w * c[k].float().double()
                    for c, w in zip(clients, weights, strict=True)
                )
                / 10
            )
            v[k] = beta * v[k] + (sent[k] - mean)
            want = sent[k] - eta * v[k]
            torch.testing.assert_close(new[k].double(), want, rtol=1e-5, atol=1e-6)
        norm = math.sqrt(sum(float(t.square().sum()) for t in v.values()))
        assert metrics["momentum-norm"] == pytest.approx(norm, rel=1e-5)
        x = {k: t.double() for k, t in new.items()}


def test_fedavgm_with_zero_momentum_and_unit_step_is_fedavg_bit_for_bit():
    from fedlr.strategies.fedavg_lora import FedAvgLoRA

    model = build_model("fedavgm-lora")
    plain = FedAvgLoRA.for_model(model)
    momentum = FedAvgMLoRA.for_model(
        model, options=ServerMomentumOptions(server_momentum=0.0, server_lr=1.0)
    )
    current = record_to_state(plain.initial_arrays(model))
    g = torch.Generator().manual_seed(2)
    replies = [
        reply(
            1000 + i,
            {
                k: t + 0.05 * torch.randn(t.shape, generator=g)
                for k, t in current.items()
            },
            {"num-examples": 1 + i},
        )
        for i in range(3)
    ]
    out = []
    for strategy in (plain, momentum):
        strategy.begin_round(1, ArrayRecord(current), ConfigRecord({}))
        arrays, _ = strategy.aggregate_train(1, replies)
        out.append(record_to_state(arrays))
    for k in out[0]:
        torch.testing.assert_close(out[0][k], out[1][k], rtol=0, atol=0)
    assert Role.HEAD in plain.train_roles


def test_a_clipped_scaffold_reply_moves_its_control_delta_with_its_step():
    """Robust norm clipping moves a reply's arrays to ``x + f (y - x)``; its
    ``scaffold-delta`` follows as ``f (delta + c) - c`` (what the node would
    have reported had its step been the clipped one)."""
    model = build_model("scaffold-lora")
    strategy = ScaffoldLoRA.for_model(model, robust=RobustConfig(rule="norm-clip"))
    current = record_to_state(strategy.initial_arrays(model))
    keys = strategy.layout.keys(*strategy.train_roles)
    g = torch.Generator().manual_seed(5)
    strategy.control = {
        k: 0.1 * torch.randn(v.shape, generator=g) for k, v in strategy.control.items()
    }
    control = {k: v.clone() for k, v in strategy.control.items()}
    strategy.begin_round(1, ArrayRecord(current), ConfigRecord({}), population=3)
    replies, deltas = [], []
    # the third is clipped (norm-clip), yet under the default screen's ratio
    for node, scale in enumerate((0.01, 0.01, 0.1)):
        arrays = {
            k: v + scale * torch.randn(v.shape, generator=g) if k in keys else v
            for k, v in current.items()
        }
        delta = {k: torch.randn(current[k].shape, generator=g) for k in keys}
        deltas.append(delta)
        message = reply(1000 + node, arrays, {"num-examples": 4})
        message.content[CONTROL_DELTA] = ArrayRecord(delta)
        replies.append(message)
    updates, _ = strategy.replies.validate_replies(replies, strategy.round.arrays)
    outcome = robust_aggregate(
        updates, strategy.replies.space(current), strategy.robust
    )
    factors = [u.clip_factor for u in outcome.updates]
    assert factors[:2] == [1.0, 1.0] and 0.0 < factors[2] < 0.5
    _, metrics = strategy.aggregate_train(1, replies)
    assert metrics["clients"] == 3
    # the record itself is then clipped at the round's median of that record
    # (the norm-clip rule's bound, factor g <= 1); the server remembers both
    applied = [strategy.applied[1000 + node] for node in range(3)]
    assert [a[:2] for a in applied] == [(1, f) for f in factors]
    scales = [a[2] for a in applied]
    assert all(0.0 < g <= 1.0 for g in scales)
    for k in keys:
        c = control[k].double()
        moved = [d[k].double() for d in deltas[:2]]
        moved.append(factors[2] * (deltas[2][k].double() + c) - c)
        moved = [g * m for g, m in zip(scales, moved, strict=True)]
        want = c + torch.stack(moved).mean(0)
        torch.testing.assert_close(
            strategy.control[k].double(), want, rtol=1e-5, atol=1e-6
        )


def test_clipped_extras_scale_linearly_by_default():
    strategy = FedAvgMLoRA.for_model(build_model("fedavgm-lora"))
    update = ClientUpdate(
        node_id=1,
        arrays={},
        num_examples=1,
        metrics={},
        content=RecordDict(),
        nbytes=0,
        extras={"x": {"a": torch.ones(2)}},
        clip_factor=0.25,
    )
    moved = strategy.replies.clip_extras(update)
    torch.testing.assert_close(moved.extras["x"]["a"], torch.full((2,), 0.25))
    same = dataclasses.replace(update, clip_factor=1.0)
    assert strategy.replies.clip_extras(same) is same


# ------------------------------------------------------------------ FedDyn
def test_feddyn_term_gradient_and_node_state_follow_the_formulas():
    """Loss-term gradient -g + alpha (theta - theta_0); after the reply
    g <- g - alpha (theta_k - theta_0), kept in context.state, read back."""
    model = build_model("feddyn-lora")
    strategy = FedDynLoRA.for_model(model, feddyn_alpha=0.3)
    context = _context()
    keys = strategy.layout.keys(*strategy.train_roles)
    params = parameters_by_key(model, strategy.layout)
    x, y = load_data(0)
    g = {k: torch.zeros_like(params[k], dtype=torch.float64) for k in keys}
    for _ in range(2):  # round 1 from g = 0, round 2 from the kept g
        job = apply_round(model, _instruction(strategy, model), context)
        assert [type(f).__name__ for f in job.features] == ["DynamicRegulariser"]
        start = {k: params[k].detach().double().clone() for k in keys}
        assert float(job.penalty().detach()) == 0.0
        for _ in range(3):
            for p in job.parameters():
                p.grad = None
            job.penalty().backward()
            for k in keys:
                d = params[k].detach().double() - start[k]
                torch.testing.assert_close(params[k].grad.double(), -g[k] + 0.3 * d)
            loss = torch.nn.functional.cross_entropy(job.model(x), y)
            loss.backward()
            with torch.no_grad():
                for p in job.parameters():
                    p.sub_(0.1 * p.grad)
        job.reply(num_examples=len(y))
        kept = record_to_state(context.state["fedlr-feddyn"])
        assert set(kept) == set(keys)
        for k in keys:
            g[k] = g[k] - 0.3 * (params[k].detach().double() - start[k])
            torch.testing.assert_close(kept[k].double(), g[k], rtol=1e-5, atol=1e-7)


def test_feddyn_reply_without_penalty_says_what_to_add():
    model = build_model("feddyn-lora")
    strategy = FedDynLoRA.for_model(model)
    job = apply_round(model, _instruction(strategy, model), _context())
    with pytest.raises(ProtocolError, match=r"job.penalty\(\)"):
        job.reply(num_examples=4)
