"""RAVAN: the heads' kernels, the client's core training and the server's mean.

In float64 against the paper's equations written out densely: every adapted
layer computes ``W0 x + s_LoRA sum_h s_h B_h H_h A_h x`` with ``B_h`` the
seeded orthonormal bases, ``A_h`` the rows of the seeded initial ``A``, and
plain SGD on ``H_h``, ``s_h`` and the head (the client's only trained
parameters) is compared with the feature's steps through the public client
helpers on the plug-in MLP.
"""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from flwr.clientapp import ClientApp

from fedlr import apply_round
from fedlr.adapters import Role, parameters_by_key
from fedlr.errors import ConfigError, InstructionError, ProtocolError
from fedlr.flower import InProcessGrid
from fedlr.flower.records import record_to_state, state_to_record
from fedlr.strategies.ravan import (
    RAVAN_CORES,
    RAVAN_HEADS,
    RAVAN_SEED,
    Ravan,
    b_of,
    cores_of,
    head_bases,
)
from fedlr.wire import protocol
from tests.plugin_app.task import build_model, load_data
from tests.strategies.conftest import reply
from tests.strategies.test_plugin import _context, _message

F64 = torch.float64
HEADS, SEED, LR, STEPS = 2, 7, 0.05, 3


def _strategy(model) -> Ravan:
    strategy = Ravan.for_model(model, ravan_heads=HEADS, seed=SEED)
    strategy.bind_initial(record_to_state(ArrayRecord(_initial(model))))
    return strategy


def _initial(model) -> dict[str, torch.Tensor]:
    """The model's seeded initial A, B and head (what every node builds)."""
    return {
        k: v.detach().clone()
        for k, v in model.state_dict().items()
        if "lora_" in k or "modules_to_save" in k
    }


def _cores(strategy: Ravan, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = strategy.rank // HEADS
    return {
        m.name: 0.5 * torch.randn(HEADS, r, r, generator=g, dtype=F64)
        for m in strategy.layout.modules
    }


def _instruction(strategy: Ravan, model, b: dict[str, torch.Tensor]):
    initial = record_to_state(strategy.initial_arrays(model))
    arrays = {**initial, **{k: v.float() for k, v in b.items()}}
    config = strategy.begin_round(1, ArrayRecord(arrays), ConfigRecord({"lr": LR}))
    config[protocol.SERVER_ROUND] = 1
    content = RecordDict(
        {protocol.ARRAYS: ArrayRecord(arrays), protocol.CONFIG: config}
    )
    return _message(content, 1000), arrays


# ------------------------------------------------------------------ kernels
def test_bases_are_orthonormal_seeded_and_the_cores_round_trip():
    q = head_bases(3, "layer.0", 40, 8)
    torch.testing.assert_close(q.T @ q, torch.eye(8, dtype=F64), atol=1e-12, rtol=0)
    assert torch.equal(q, head_bases(3, "layer.0", 40, 8))  # same on every node
    assert not torch.allclose(q, head_bases(3, "layer.1", 40, 8))  # per layer
    assert not torch.allclose(q, head_bases(4, "layer.0", 40, 8))  # per seed
    g = torch.Generator().manual_seed(0)
    cores = torch.randn(4, 2, 2, generator=g, dtype=F64)
    b = b_of(cores, q)
    for h in range(4):  # block h of B is B_h C_h
        torch.testing.assert_close(
            b[:, 2 * h : 2 * h + 2], q[:, 2 * h : 2 * h + 2] @ cores[h]
        )
    torch.testing.assert_close(cores_of(b, q, 4), cores, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="do not fit in d_out=4"):
        head_bases(0, "x", 4, 8)


# ------------------------------------------------------------------- client
def _dense_logits(strategy, model, cores, scales, head, x):
    """``W0 x + b0 + s_LoRA sum_h s_h B_h H_h A_h x`` per layer, then the head."""
    base = model.base_model.model
    h = x.double()
    for m in strategy.layout.modules:
        layer = base.get_submodule(m.name.removeprefix("base_model.model."))
        r = m.rank // HEADS
        bases = head_bases(SEED, m.name, m.d_out, m.rank)
        a0 = strategy.initial_state[m.a_key].double()
        delta = sum(
            scales[m.name][k]
            * bases[:, k * r : (k + 1) * r]
            @ cores[m.name][k]
            @ a0[k * r : (k + 1) * r]
            for k in range(HEADS)
        )
        w = layer.base_layer.weight.double() + float(layer.scaling["default"]) * delta
        h = torch.relu(h @ w.T + layer.base_layer.bias.double())
    return h @ head["weight"].T + head["bias"]


def test_client_trains_the_cores_and_scalars_as_the_dense_model():
    model = build_model("ravan")
    strategy = _strategy(model)
    start = _cores(strategy, 1)
    b = {
        m.b_key: b_of(start[m.name], head_bases(SEED, m.name, m.d_out, m.rank))
        for m in strategy.layout.modules
    }
    message, _ = _instruction(strategy, model, b)
    assert message.content[protocol.CONFIG][RAVAN_HEADS] == HEADS
    assert message.content[protocol.CONFIG][RAVAN_SEED] == SEED
    job = apply_round(model, message, _context())
    assert [type(f).__name__ for f in job.features] == ["RavanHeads"]
    x, y = load_data(0)
    head_module = model.base_model.model.classifier.modules_to_save["default"]
    # the float64 reference: H_h = C_h (as received), s_h = 1, the head as sent
    cores = {k: v.clone().requires_grad_(True) for k, v in start.items()}
    scales = {k: torch.ones(HEADS, dtype=F64, requires_grad=True) for k in start}
    head = {
        "weight": head_module.weight.detach().double().requires_grad_(True),
        "bias": head_module.bias.detach().double().requires_grad_(True),
    }
    optimizer = job.optimizer(torch.optim.SGD(job.parameters(), lr=LR))
    for _ in range(STEPS):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(job.model(x), y).backward()
        optimizer.step()
        dense = torch.nn.functional.cross_entropy(
            _dense_logits(strategy, model, cores, scales, head, x), y
        )
        leaves = [*cores.values(), *scales.values(), *head.values()]
        grads = torch.autograd.grad(dense, leaves)
        with torch.no_grad():
            for leaf, grad in zip(leaves, grads, strict=True):
                leaf -= LR * grad
    answer = job.reply(num_examples=len(y))
    arrays = record_to_state(answer.content[protocol.ARRAYS])
    assert set(arrays) == set(strategy.layout.keys(Role.HEAD))  # no A, no B
    got = record_to_state(answer.content[RAVAN_CORES])
    for m in strategy.layout.modules:
        want = scales[m.name].detach()[:, None, None] * cores[m.name].detach()
        torch.testing.assert_close(got[m.name].double(), want, rtol=1e-5, atol=1e-6)
        assert float((want - start[m.name]).abs().max()) > 1e-3  # it trained
        # the model's B is the published form of the trained cores
        bases = head_bases(SEED, m.name, m.d_out, m.rank)
        lora_b = parameters_by_key(model, strategy.layout)[m.b_key]
        torch.testing.assert_close(
            lora_b.double(), b_of(want, bases), rtol=1e-5, atol=1e-6
        )
        # A never moved: the frozen A_h
        lora_a = parameters_by_key(model, strategy.layout)[m.a_key]
        assert torch.equal(lora_a.detach(), strategy.initial_state[m.a_key])
    torch.testing.assert_close(
        head_module.weight.double(), head["weight"].detach(), rtol=1e-5, atol=1e-6
    )


def test_client_refuses_a_b_off_the_heads_span():
    model = build_model("ravan")
    strategy = _strategy(model)
    g = torch.Generator().manual_seed(5)
    b = {
        m.b_key: torch.randn(m.d_out, m.rank, generator=g, dtype=F64)
        for m in strategy.layout.modules
    }
    message, _ = _instruction(strategy, model, b)
    with pytest.raises(
        (ProtocolError, InstructionError), match="span of its 2 RAVAN heads"
    ):
        apply_round(model, message, _context())


# ------------------------------------------------------------------- server
def test_server_publishes_the_mean_of_the_clients_heads_exactly():
    model = build_model("ravan")
    strategy = _strategy(model)
    assert strategy.reply_shapes() == strategy.layout.shapes(Role.HEAD)
    records = strategy.replies.records()[RAVAN_CORES]
    assert set(records.values()) == {(HEADS, 2, 2)}
    current = record_to_state(strategy.initial_arrays(model))
    grid = InProcessGrid(ClientApp(), num_nodes=3, run_config={})
    strategy.configure_train(1, ArrayRecord(current), ConfigRecord({"lr": LR}), grid)
    weights, replies, sent = (3, 5, 9), [], []
    for node, n in zip((1000, 1001, 1002), weights, strict=True):
        cores = _cores(strategy, node)
        head = {k: current[k] + 0.1 for k in strategy.layout.keys(Role.HEAD)}
        message = reply(node, head, {protocol.NUM_EXAMPLES: n})
        message.content[RAVAN_CORES] = state_to_record(
            {k: v.float() for k, v in cores.items()}
        )
        replies.append(message)
        sent.append(cores)
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is not None and metrics is not None and metrics["dropped"] == 0
    new = record_to_state(arrays)
    w = torch.tensor(weights, dtype=F64) / sum(weights)
    for m in strategy.layout.modules:
        bases = head_bases(SEED, m.name, m.d_out, m.rank)
        a0 = strategy.initial_state[m.a_key].double()
        clients = sum(
            wi * b_of(c[m.name].float().double(), bases) @ a0
            for wi, c in zip(w, sent, strict=True)
        )
        got = new[m.b_key].double() @ a0
        assert float((got - clients).abs().max()) < 1e-6 * float(clients.abs().max())
    assert metrics["relative-gap"] < 1e-5


def test_a_rank_that_does_not_split_into_the_heads_is_refused():
    with pytest.raises(ConfigError, match="does not split into 3 heads"):
        Ravan.for_model(build_model("ravan"), ravan_heads=3)
