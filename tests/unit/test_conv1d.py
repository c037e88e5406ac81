"""GPT-2's ``Conv1D`` stores ``W0`` as (d_in, d_out): folds transpose there only.

Real peft layers of both kinds (a tiny random GPT-2 with LoRA / VeRA on its
``c_attn`` and ``c_proj`` ``Conv1D`` layers, an ``nn.Linear`` MLP, and a model
mixing both), one simulated round of three clients through the strategies'
``aggregate_updates``, checked against dense float64:

* FedEx-LoRA: ``W0_new + s (B_bar A_bar)^T = W0 + s sum_i w_i (B_i A_i)^T``
  (no transpose for ``nn.Linear``); FLoRA: ``W0_new = W0 + sum_i w_i s
  (B_i A_i)^T``; VeRA-FedEx the same with ``Lambda_b B Lambda_d A``;
* each adapted layer's output under the new global arrays is the weighted mean
  of the client layers' outputs, and the whole model's logits are those of the
  model whose weights are the mean effective weights;
* the factored downlink, applied by a node (:func:`fedlr.wire.downlink.receive_base`
  after encoding), reproduces the server's new ``W0`` bit for bit.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
from flwr.app import ConfigRecord, RecordDict
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.pytorch_utils import Conv1D
from transformers.utils import logging as hf_logging

from fedlr.adapters import (
    AdaptedModel,
    AdapterLayout,
    LoraModule,
    LoraSettings,
    Role,
    SorfVeraSettings,
    VeraSettings,
    apply_lora,
    apply_sorf_vera,
    build_vera_model,
    lora_layout,
)
from fedlr.adapters.plugin import adapted, check_layout
from fedlr.adapters.vera import VeraModel
from fedlr.errors import ShapeMismatchError, UnsupportedModelError
from fedlr.flower.records import record_to_state
from fedlr.linalg import StreamedResidual, stacked_residual
from fedlr.linalg.vera import fold_vera_residual
from fedlr.round.ledger import BaseLedger
from fedlr.strategies import FedExLoRA, FLoRA, VeraFedEx
from fedlr.strategies.base import ClientUpdate, FedLRStrategy
from fedlr.strategies.fedex_downlink import FactoredDownlink
from fedlr.wire import protocol
from fedlr.wire.downlink import (
    LOWRANK,
    VERA,
    BaseDelta,
    decode_steps,
    encode_steps,
    receive_base,
    vera_delta,
)

F64 = torch.float64
KINDS = ("gpt2", "linear", "mixed")
WEIGHTS = torch.tensor([1.0, 2.0, 3.0], dtype=F64) / 6  # num-examples 1, 2, 3

hf_logging.set_verbosity_error()


# ------------------------------------------------------------------ models
def _gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        n_embd=32,
        n_layer=2,
        n_head=2,
        vocab_size=100,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config).eval()


class _Mlp(nn.Module):
    """``nn.Linear`` layers only."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(24, 40)
        self.fc2 = nn.Linear(40, 24)
        self.classifier = nn.Linear(24, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class _Mixed(nn.Module):
    """A square ``Conv1D`` (no shape tells its orientation) and an ``nn.Linear``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = Conv1D(24, 24)
        self.fc = nn.Linear(24, 40)
        self.classifier = nn.Linear(40, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.fc(torch.tanh(self.conv(x)))))


def _base(kind: str) -> tuple[nn.Module, tuple[str, ...], tuple[str, ...]]:
    """The model, its LoRA targets and its head modules."""
    if kind == "gpt2":
        return _gpt2(), ("c_attn", "c_proj"), ()
    torch.manual_seed(0)
    if kind == "linear":
        return _Mlp().eval(), ("fc1", "fc2"), ("classifier",)
    return _Mixed().eval(), ("conv", "fc"), ("classifier",)


def _lora(kind: str) -> Any:
    model, targets, heads = _base(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the mixed model: peft sets each layer's
        return apply_lora(
            model,
            LoraSettings(rank=2, alpha=4.0, target_modules=targets),
            head_modules=heads,
        )


def _vera(kind: str) -> VeraModel:
    model, targets, _ = _base(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_vera_model(
            model, VeraSettings(rank=4, projection_seed=3, target_modules=targets)
        )


def _logits(kind: str, model: nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        if kind == "gpt2":
            ids = torch.randint(0, 100, (2, 8), generator=g)
            return model(input_ids=ids).logits
        return model(torch.randn(4, 24, generator=g))


# ------------------------------------------------------------------ a round
def _updates(
    strategy: FedLRStrategy, start: Mapping[str, torch.Tensor], scale: float
) -> list[ClientUpdate]:
    """Three clients' replies: the start perturbed (seeded), 1, 2, 3 examples.

    A FedEx-family strategy's ledger first adopts the start's base weights as
    version 0 (as ``configure_train`` does).
    """
    if isinstance(strategy, FactoredDownlink):
        strategy.ledger.sync({k: start[k] for k in strategy.base_keys()})
    shapes = strategy.reply_shapes()
    assert {k: tuple(start[k].shape) for k in shapes} == shapes
    updates = []
    for i in range(3):
        g = torch.Generator().manual_seed(1000 + i)
        arrays = {
            key: start[key] + scale * torch.randn(*shape, generator=g)
            for key, shape in shapes.items()
        }
        updates.append(
            ClientUpdate(
                node_id=i + 1,
                arrays=arrays,
                num_examples=i + 1,
                metrics={},
                content=None,  # type: ignore[arg-type]
                nbytes=0,
            )
        )
    return updates


Effective = Callable[[Any, Mapping[str, torch.Tensor]], torch.Tensor]


def _lora_effective(m: LoraModule, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The layer's weight as stored: ``W0 + s B A`` (transposed for Conv1D)."""
    change = m.scaling * (state[m.b_key].to(F64) @ state[m.a_key].to(F64))
    return state[m.base_key].to(F64) + (change.T if m.fan_in_fan_out else change)


def _vera_effective(view: VeraModel) -> Effective:
    def effective(m: Any, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
        a = view.projection_a[:, : m.d_in].to(F64)
        b = view.projection_b[: m.d_out].to(F64)
        lb = state[m.lambda_b_key].to(F64)[:, None]
        ld = state[m.lambda_d_key].to(F64)[:, None]
        change = m.scaling * ((lb * b) @ (ld * a))
        return state[m.base_key].to(F64) + (change.T if m.fan_in_fan_out else change)

    return effective


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(torch.linalg.norm(x - y) / torch.linalg.norm(y))


def _check_round(
    kind: str,
    view: AdaptedModel,
    effective: Effective,
    current: Mapping[str, torch.Tensor],
    updates: list[ClientUpdate],
    new: Mapping[str, torch.Tensor],
    no_adapter: Mapping[str, torch.Tensor],
) -> dict[str, float]:
    """The exactness identity, layer outputs, whole-model logits; the errors."""
    modules = view.layout.modules  # type: ignore[attr-defined]
    clients = [{**current, **u.arrays} for u in updates]
    errors = {"identity": 0.0, "layer": 0.0, "logits": 0.0}
    mean_weights: dict[str, torch.Tensor] = {}
    for m in modules:
        want = sum(
            float(w) * effective(m, c) for w, c in zip(WEIGHTS, clients, strict=True)
        )
        assert isinstance(want, torch.Tensor)
        got = effective(m, new)
        assert new[m.base_key].shape == current[m.base_key].shape
        assert new[m.base_key].dtype == torch.float32
        errors["identity"] = max(errors["identity"], _rel(got, want))
        mean_weights[m.base_key] = want.to(torch.float32)
    # Each adapted layer's output is linear in its weight: the global layer's
    # output is the weighted mean of the client layers' outputs.
    g = torch.Generator().manual_seed(9)
    inputs = {m.name: torch.randn(5, m.d_in, generator=g) for m in modules}

    def outputs(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        view.load(state)
        named = dict(view.model.named_modules())
        with torch.no_grad():
            return {name: named[name](x).to(F64) for name, x in inputs.items()}

    per_client = [outputs(c) for c in clients]
    global_out = outputs(new)
    for m in modules:
        mean = sum(
            float(w) * o[m.name] for w, o in zip(WEIGHTS, per_client, strict=True)
        )
        assert isinstance(mean, torch.Tensor)
        err = float((global_out[m.name] - mean).abs().max() / mean.abs().max())
        errors["layer"] = max(errors["layer"], err)
    # The whole model: the global logits are those of the model whose adapted
    # weights are the mean effective weights (adapter switched off).
    view.load(new)
    got_logits = _logits(kind, view.model)
    view.load({**new, **no_adapter, **mean_weights})
    want_logits = _logits(kind, view.model)
    errors["logits"] = float(
        (got_logits - want_logits).abs().max() / want_logits.abs().max()
    )
    return errors


def _node_receives(
    strategy: FactoredDownlink,
    current: Mapping[str, torch.Tensor],
    projections: Any = None,
) -> dict[str, torch.Tensor]:
    """A node holding version 0 applies the round's encoded changes."""
    keys = strategy.base_keys()
    state = RecordDict()
    receive_base(
        {k: current[k] for k in keys},
        RecordDict(),
        ConfigRecord({protocol.BASE_VERSION: 0}),
        state,
        keys,
    )
    ledger = strategy.ledger
    steps = [(s.version, s.deltas) for s in ledger.steps if s.deltas is not None]
    assert [v for v, _ in steps] == [1], "every layer's change went factored"
    assert ledger.checks is not None
    content = RecordDict({protocol.BASE_DELTA: encode_steps(steps)})
    config = ConfigRecord(
        {protocol.BASE_VERSION: ledger.version, protocol.BASE_CHECK: ledger.checks}
    )
    received = receive_base({}, content, config, state, keys, projections)
    assert received is not None and received[1] == 1
    return received[0]


# ------------------------------------------------------------------ adapters
def test_apply_lora_on_gpt2_sets_fan_in_fan_out_and_declares_stored_shapes() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = _lora("gpt2")
    assert not [w for w in caught if "fan_in_fan_out" in str(w.message)]
    assert model.peft_config["default"].fan_in_fan_out is True
    layout = lora_layout(model)
    params = dict(model.named_parameters())
    assert len(layout.modules) == 6  # c_attn, attn.c_proj, mlp.c_proj per block
    for m in layout.modules:
        assert m.fan_in_fan_out
        assert layout.shapes(Role.BASE)[m.base_key] == (m.d_in, m.d_out)
        assert tuple(params[m.base_key].shape) == (m.d_in, m.d_out)
        assert layout.shapes(Role.LORA_A)[m.a_key] == (2, m.d_in)
        assert layout.shapes(Role.LORA_B)[m.b_key] == (m.d_out, 2)
    assert {(m.d_out, m.d_in) for m in layout.modules} == {
        (96, 32),
        (32, 32),
        (32, 128),
    }
    assert AdapterLayout.from_dict(layout.to_dict()) == layout


def test_linear_and_mixed_layouts_record_each_layers_orientation() -> None:
    linear = lora_layout(_lora("linear"))
    assert not any(m.fan_in_fan_out for m in linear.modules)
    assert [linear.shapes(Role.BASE)[m.base_key] for m in linear.modules] == [
        (40, 24),
        (24, 40),
    ]
    mixed = lora_layout(_lora("mixed"))
    assert [(m.name.rsplit(".", 1)[-1], m.fan_in_fan_out) for m in mixed.modules] == [
        ("conv", True),
        ("fc", False),
    ]


def test_vera_on_gpt2_declares_conv1d_layers() -> None:
    view = _vera("gpt2")
    config: Any = view.model.peft_config["default"]  # type: ignore[index]
    assert config.fan_in_fan_out is True
    params = dict(view.model.named_parameters())
    for m in view.layout.modules:  # type: ignore[attr-defined]
        assert m.fan_in_fan_out
        assert tuple(params[m.base_key].shape) == (m.d_in, m.d_out)
        assert view.layout.shapes(Role.BASE)[m.base_key] == (m.d_in, m.d_out)
    assert tuple(view.projection_a.shape) == (4, 128)
    assert tuple(view.projection_b.shape) == (96, 4)


def test_a_layer_that_is_not_linear_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedModelError, match="Embedding"):
        apply_lora(
            _gpt2(),
            LoraSettings(rank=2, alpha=4.0, target_modules=("wte",)),
            head_modules=(),
        )


def test_sorf_vera_refuses_conv1d_targets_by_name() -> None:
    with pytest.raises(UnsupportedModelError, match="Conv1D"):
        apply_sorf_vera(
            _Mixed(), SorfVeraSettings(rank=4, target_modules=("conv", "fc"))
        )


def test_check_layout_refuses_a_square_layer_stored_the_other_way() -> None:
    def layout(flag: bool) -> AdapterLayout:
        module = LoraModule("l", "l.A", "l.B", "l.W", 2.0, 8, 8, 2, flag)
        return AdapterLayout(modules=(module,))

    check_layout(layout(True), layout(False), (Role.LORA_A, Role.LORA_B), what="m")
    with pytest.raises(ShapeMismatchError, match="fan_in_fan_out"):
        check_layout(layout(True), layout(False), (Role.BASE,), what="the model")


# ------------------------------------------------------------------ kernels
def test_folds_transposed_match_dense_on_both_residual_paths() -> None:
    g = torch.Generator().manual_seed(0)
    d_out, d_in, r, k = 7, 5, 2, 4
    bs = [torch.randn(d_out, r, generator=g, dtype=F64) for _ in range(k)]
    as_ = [torch.randn(r, d_in, generator=g, dtype=F64) for _ in range(k)]
    w = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=F64) / 10
    residual = sum(wi * b @ a for wi, b, a in zip(w, bs, as_, strict=True)) - (
        sum(wi * b for wi, b in zip(w, bs, strict=True))
        @ sum(wi * a for wi, a in zip(w, as_, strict=True))
    )
    assert isinstance(residual, torch.Tensor)
    w0 = torch.randn(d_out, d_in, generator=g, dtype=F64)
    w0_t = w0.T.contiguous()
    stacked = stacked_residual(bs, as_, w)
    streamed = StreamedResidual(bs, as_, w)
    folded = stacked.fold(w0_t, 0.5, transposed=True)
    torch.testing.assert_close(folded, w0_t + 0.5 * residual.T, rtol=0, atol=1e-12)
    folded = streamed.fold(w0_t, 0.5, transposed=True)
    assert folded.is_contiguous()
    torch.testing.assert_close(folded, w0_t + 0.5 * residual.T, rtol=0, atol=1e-12)
    assert streamed.gap_norms().pair[0] == pytest.approx(
        float(torch.linalg.norm(residual)), rel=1e-12
    )
    torch.testing.assert_close(stacked.fold(w0, 0.5), w0 + 0.5 * residual)
    with pytest.raises(ShapeMismatchError, match="transposed"):
        stacked.fold(w0, 0.5, transposed=True)
    with pytest.raises(ShapeMismatchError, match="transposed"):
        StreamedResidual(bs, as_, w).fold(w0, 0.5, transposed=True)


def test_transposed_vera_delta_survives_the_wire_and_the_ledger() -> None:
    g = torch.Generator().manual_seed(1)
    d_out, d_in, r = 12, 9, 3
    a = torch.randn(r, d_in, generator=g)
    b = torch.randn(d_out, r, generator=g)
    lbs = [torch.randn(d_out, generator=g) for _ in range(3)]
    lds = [torch.randn(r, generator=g) for _ in range(3)]
    delta = vera_delta(lbs, lds, WEIGHTS, 1.0, d_in, transposed=True)
    assert delta is not None and delta.kind == VERA and delta.transposed
    w0_t = torch.randn(d_in, d_out, generator=g)  # a Conv1D's (d_in, d_out)
    applied = delta.apply(w0_t, lambda o, i: (a[:, :i], b[:o]))
    dense = fold_vera_residual(w0_t, lbs, lds, a, b, WEIGHTS, transposed=True)
    assert _rel(applied.to(F64), dense.to(F64)) < 1e-6
    record = encode_steps([(1, {"w": delta})])
    assert sorted(record) == ["1:vera-t:w:left", "1:vera-t:w:right"]
    decoded = decode_steps(record)[1]["w"]
    assert decoded.transposed and decoded.kind == VERA
    ledger = BaseLedger(["w"])
    ledger.sync({"w": w0_t})
    ledger.publish({"w": delta}, {"w": applied})
    again = BaseLedger(["w"])
    again.load_state_dict(ledger.state_dict())
    step = again.steps[0].deltas
    assert step is not None and step["w"].transposed
    # A plain change keeps its old key and is not transposed.
    plain = BaseDelta(LOWRANK, torch.ones(d_in, 1), torch.ones(1, d_out))
    assert sorted(encode_steps([(2, {"w": plain})])) == [
        "2:lowrank:w:left",
        "2:lowrank:w:right",
    ]


# ------------------------------------------------------------------ a round
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("downlink", ["factored", "dense"])
def test_fedex_lora_round_is_exact_for_conv1d_and_linear(
    kind: str, downlink: str
) -> None:
    model = _lora(kind)
    view = adapted(model)
    strategy = FedExLoRA.for_model(model, fedex_downlink=downlink)
    current = record_to_state(strategy.initial_arrays(model))
    updates = _updates(strategy, current, scale=0.3)
    new, report = strategy.aggregate_updates(1, updates, current)
    layout = strategy.layout
    no_adapter = {m.b_key: torch.zeros_like(new[m.b_key]) for m in layout.modules}
    errors = _check_round(
        kind, view, _lora_effective, current, updates, new, no_adapter
    )
    assert errors["identity"] < 1e-6, errors
    assert errors["layer"] < 1e-5, errors
    assert errors["logits"] < 1e-5, errors
    assert report.metrics["frobenius-gap"] > 1e-2  # the residual is not trivial
    if downlink == "factored":
        received = _node_receives(strategy, current)
        for m in layout.modules:
            assert torch.equal(received[m.base_key], new[m.base_key])
            delta = strategy.ledger.steps[-1].deltas[m.base_key]  # type: ignore[index]
            assert delta.kind == LOWRANK and not delta.transposed
            # A Conv1D layer's change travels as the swapped pair (right^T, left^T).
            rows = m.d_in if m.fan_in_fan_out else m.d_out
            assert delta.left.shape[0] == rows


def test_fedex_lora_on_conv1d_would_be_wrong_untransposed() -> None:
    """The test above discriminates: the square c_proj layers fail untransposed."""
    model = _lora("gpt2")
    strategy = FedExLoRA.for_model(model)
    current = record_to_state(strategy.initial_arrays(model))
    updates = _updates(strategy, current, scale=0.3)
    new, _ = strategy.aggregate_updates(1, updates, current)
    square = [m for m in strategy.layout.modules if m.d_in == m.d_out]
    assert square
    for m in square:
        linear_view = LoraModule(**{**vars(m), "fan_in_fan_out": False})
        want = sum(
            float(w) * _lora_effective(linear_view, {**current, **u.arrays})
            for w, u in zip(WEIGHTS, updates, strict=True)
        )
        assert isinstance(want, torch.Tensor)
        assert _rel(_lora_effective(linear_view, new), want) > 1e-2


@pytest.mark.parametrize("kind", ["gpt2", "mixed"])
def test_flora_round_folds_the_transposed_sum_for_conv1d(kind: str) -> None:
    model = _lora(kind)
    view = adapted(model)
    initial = view.state((Role.LORA_A, Role.LORA_B))
    strategy = FLoRA.for_model(model)
    current = record_to_state(strategy.initial_arrays(model))
    start = {**current, **view.state((Role.LORA_A, Role.LORA_B, Role.HEAD))}
    updates = _updates(strategy, start, scale=0.3)
    new, _ = strategy.aggregate_updates(1, updates, current)
    assert not set(initial) & set(new)  # A and B never travel down
    new_global = {**initial, **new}  # every node starts from its fresh adapter
    no_adapter = {
        m.b_key: torch.zeros_like(initial[m.b_key]) for m in strategy.layout.modules
    }
    errors = _check_round(
        kind, view, _lora_effective, current, updates, new_global, no_adapter
    )
    assert errors["identity"] < 1e-6, errors
    assert errors["layer"] < 1e-5, errors
    assert errors["logits"] < 1e-5, errors
    received = _node_receives(strategy, current)
    for m in strategy.layout.modules:
        assert torch.equal(received[m.base_key], new[m.base_key])


@pytest.mark.parametrize("kind", KINDS)
def test_vera_fedex_round_is_exact_for_conv1d_and_linear(kind: str) -> None:
    view = _vera(kind)
    strategy = VeraFedEx.for_model(view)
    current = record_to_state(strategy.initial_arrays(view))
    updates = _updates(strategy, current, scale=0.5)
    new, _ = strategy.aggregate_updates(1, updates, current)
    modules = strategy.layout.modules  # type: ignore[attr-defined]
    no_adapter = {
        m.lambda_b_key: torch.zeros_like(new[m.lambda_b_key]) for m in modules
    }
    errors = _check_round(
        kind, view, _vera_effective(view), current, updates, new, no_adapter
    )
    assert errors["identity"] < 1e-6, errors
    assert errors["layer"] < 1e-5, errors
    assert errors["logits"] < 1e-5, errors
    a, b = view.projection_a, view.projection_b
    received = _node_receives(
        strategy, current, lambda d_out, d_in: (a[:, :d_in], b[:d_out])
    )
    for m in modules:
        assert torch.equal(received[m.base_key], new[m.base_key])
        delta = strategy.ledger.steps[-1].deltas[m.base_key]  # type: ignore[index]
        assert delta.kind == VERA and delta.transposed == m.fan_in_fan_out
