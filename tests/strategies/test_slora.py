"""SLoRA: the warm-up's mask, its stage switch and the SVD initialisation.

Everything in float64: the server on float64 global arrays (replies are cast
to the global dtype), the client feature on the plug-in app's peft model
converted to float64.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.clientapp import ClientApp

from fedlr import apply_round
from fedlr.adapters import AdapterLayout, LoraModule, Role, parameters_by_key
from fedlr.flower import InProcessGrid
from fedlr.flower.records import record_to_state
from fedlr.strategies.slora import SLoRA, SparseWarmup, svd_init, warmup_mask
from tests.plugin_app.task import build_model, load_data
from tests.strategies.conftest import reply
from tests.strategies.test_plugin import _context, _instruction

F64 = torch.float64
LAYOUT = AdapterLayout(
    modules=(
        LoraModule("l0", "l0.A", "l0.B", "l0.W", 2.0, d_out=6, d_in=5, rank=2),
        LoraModule("l1", "l1.A", "l1.B", "l1.W", 0.5, d_out=4, d_in=7, rank=3),
    ),
    head_shapes={"head.w": (2, 5), "head.b": (2,)},
)
EXAMPLES = (10, 30, 60)
SHARES = torch.tensor(EXAMPLES, dtype=F64) / sum(EXAMPLES)
ALL = (Role.LORA_A, Role.LORA_B, Role.HEAD, Role.BASE)


def _random(seed: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*s, generator=g, dtype=F64) for k, s in shapes.items()}


def _round(strategy: SLoRA, server_round: int, state: dict) -> tuple[dict, dict, list]:
    """Instruct, reply (seeded, disagreeing, dense) and aggregate one round."""
    grid = InProcessGrid(ClientApp(), num_nodes=len(EXAMPLES), run_config={})
    messages = list(
        strategy.configure_train(
            server_round, ArrayRecord(dict(state)), ConfigRecord(), grid
        )
    )
    sent = [
        {
            k: state[k] + 0.3 * v
            for k, v in _random(100 * server_round + i, strategy.reply_shapes()).items()
        }
        for i in range(len(EXAMPLES))
    ]
    replies = [
        reply(1000 + i, arrays, {"num-examples": n})
        for i, (arrays, n) in enumerate(zip(sent, EXAMPLES, strict=True))
    ]
    arrays, metrics = strategy.aggregate_train(server_round, replies)
    assert arrays is not None and metrics is not None
    assert metrics["dropped"] == 0, strategy.round.dropped
    config = dict(messages[0].content["config"])
    return record_to_state(arrays), {**dict(metrics), "config": config}, sent


def _mean(sent: list[dict], key: str) -> torch.Tensor:
    return torch.tensordot(SHARES, torch.stack([s[key] for s in sent]), dims=1)


# --------------------------------------------------------------------- mask
def test_the_mask_has_exactly_k_entries_and_is_the_same_on_every_node():
    a = warmup_mask((40, 30), 0.05, 7, "layer.weight")
    assert a.dtype == torch.bool and a.shape == (40, 30)
    assert int(a.sum()) == round(0.05 * 1200)
    assert torch.equal(a, warmup_mask((40, 30), 0.05, 7, "layer.weight"))
    assert not torch.equal(a, warmup_mask((40, 30), 0.05, 8, "layer.weight"))
    assert not torch.equal(a, warmup_mask((40, 30), 0.05, 7, "other.weight"))
    assert bool(warmup_mask((3, 4), 1.0, 0, "k").all())
    assert int(warmup_mask((3, 4), 1e-9, 0, "k").sum()) == 1  # at least one


# -------------------------------------------------------------- the server
def test_warmup_switch_and_lora_stage_in_float64():
    strategy = SLoRA(layout=LAYOUT, seed=5, slora_warmup_rounds=2, slora_density=0.3)
    w0 = _random(0, LAYOUT.shapes(Role.BASE, Role.HEAD))
    state = {
        **w0,
        **_random(1, LAYOUT.shapes(Role.LORA_A)),
        **{k: torch.zeros(s, dtype=F64) for k, s in LAYOUT.shapes(Role.LORA_B).items()},
    }
    initial = dict(state)

    # round 1, stage 1: only the masked entries move, to the weighted mean
    new, metrics, sent = _round(strategy, 1, state)
    assert metrics["config"]["train-roles"] == "base,head"
    assert metrics["config"]["slora-density"] == 0.3
    assert metrics["config"]["slora-mask-seed"] == 5
    assert metrics["stage"] == 1.0
    for m in LAYOUT.modules:
        mask = strategy.masks[m.base_key]
        assert torch.equal(mask, warmup_mask((m.d_out, m.d_in), 0.3, 5, m.base_key))
        assert torch.equal(new[m.base_key][~mask], state[m.base_key][~mask])
        torch.testing.assert_close(
            new[m.base_key][mask], _mean(sent, m.base_key)[mask], rtol=0, atol=1e-14
        )
        assert torch.equal(new[m.a_key], state[m.a_key])  # A, B do not train
        assert torch.equal(new[m.b_key], state[m.b_key])
    for key in LAYOUT.keys(Role.HEAD):
        torch.testing.assert_close(new[key], _mean(sent, key), rtol=0, atol=1e-14)
    # the gap: the published W against the clients' dense mean (they did not
    # keep to the mask here): the entries outside M
    outside = sum(
        float((_mean(sent, k) - state[k])[~strategy.masks[k]].pow(2).sum())
        for k in LAYOUT.keys(Role.BASE)
    )
    assert abs(metrics["frobenius-gap"] - outside**0.5) <= 1e-12 * outside**0.5
    state = new

    # round 2, stage 1 then the switch: W <- W0, s B A = the best rank-r Delta
    new, metrics, sent = _round(strategy, 2, state)
    assert "svd-kept-energy" in metrics
    kept_sq = total_sq = 0.0
    for m in LAYOUT.modules:
        mask = strategy.masks[m.base_key]
        warm = torch.where(mask, _mean(sent, m.base_key), state[m.base_key])
        delta = warm - initial[m.base_key]
        assert torch.equal(delta[~mask], torch.zeros_like(delta[~mask]))
        assert torch.equal(new[m.base_key], initial[m.base_key])  # W0, bit for bit
        s = torch.linalg.svdvals(delta)
        product = m.scaling * new[m.b_key] @ new[m.a_key]
        # Eckart-Young: the residual is exactly the tail of the spectrum
        residual = float((delta - product).pow(2).sum())
        tail = float(s[m.rank :].pow(2).sum())
        assert abs(residual - tail) <= 1e-12 * float(s.pow(2).sum()), m.name
        assert torch.linalg.matrix_rank(product) == m.rank
        # balanced factors: B^T B = A A^T = diag(S_r / s)
        gram = torch.diag(s[: m.rank] / m.scaling)
        torch.testing.assert_close(
            new[m.b_key].T @ new[m.b_key], gram, atol=1e-12, rtol=0
        )
        torch.testing.assert_close(
            new[m.a_key] @ new[m.a_key].T, gram, atol=1e-12, rtol=0
        )
        kept_sq += float(s[: m.rank].pow(2).sum())
        total_sq += float(s.pow(2).sum())
    assert abs(metrics["svd-kept-energy"] - kept_sq / total_sq) < 1e-12
    gap_sq = sum(
        float(
            (
                new[m.base_key]
                + m.scaling * new[m.b_key] @ new[m.a_key]
                - _mean(sent, m.base_key)
            )
            .pow(2)
            .sum()
        )
        for m in LAYOUT.modules
    )
    assert abs(metrics["frobenius-gap"] - gap_sq**0.5) <= 1e-12 * gap_sq**0.5
    assert metrics["svd-kept-energy"] < 1.0  # the switch truncated something
    state = new

    # round 3, stage 2: FedAvg-LoRA of A, B and the head; W stays W0
    new, metrics, sent = _round(strategy, 3, state)
    assert metrics["config"]["train-roles"] == "lora_A,lora_B,head"
    assert "slora-density" not in metrics["config"]
    assert metrics["stage"] == 2.0 and metrics["frobenius-gap"] > 0
    for key in LAYOUT.keys(Role.LORA_A, Role.LORA_B, Role.HEAD):
        torch.testing.assert_close(new[key], _mean(sent, key), rtol=0, atol=1e-14)
    for key in LAYOUT.keys(Role.BASE):
        assert torch.equal(new[key], initial[key])


def test_svd_init_signs_and_a_rank_deficient_update():
    delta = torch.zeros(5, 4, dtype=F64)
    delta[1, 2] = -3.0  # rank 1, asked for rank 2
    b, a, kept = svd_init(delta, 2, 0.5)
    torch.testing.assert_close(0.5 * b @ a, delta, atol=1e-15, rtol=0)
    assert kept == 1.0
    assert float(b[:, 0].max()) > 0 and float(b[:, 0].abs().max()) == float(b[1, 0])


# --------------------------------------------------------------- the client
def test_the_node_trains_only_the_masked_entries_in_float64():
    model = build_model("slora").double()
    strategy = SLoRA.for_model(model, slora_density=0.2)
    message = _instruction(strategy, model)
    job = apply_round(model, message, _context())
    (feature,) = [f for f in job.features if isinstance(f, SparseWarmup)]
    for key, mask in strategy.masks.items():  # the node's masks are the server's
        assert torch.equal(feature.masks[key], mask)
    received = record_to_state(message.content["arrays"])
    params = parameters_by_key(model, strategy.layout)
    bases = strategy.layout.keys(Role.BASE)
    assert bases and all(params[k].requires_grad for k in bases)
    x, y = load_data(0)
    optimizer = torch.optim.AdamW(job.parameters(), lr=0.05, weight_decay=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x.double()), y).backward()
        raw = {k: params[k].grad.clone() for k in bases}
        job.after_backward()
        for k in bases:
            want = torch.where(strategy.masks[k], raw[k], torch.zeros_like(raw[k]))
            assert torch.equal(params[k].grad, want), k
        optimizer.step()
    # the weight decay moved entries outside the mask; the reply puts them back
    k0 = bases[0]
    outside = ~strategy.masks[k0]
    assert not torch.equal(params[k0].detach()[outside], received[k0][outside])
    sent = record_to_state(job.reply(num_examples=len(y)).content["arrays"])
    assert set(sent) == set(strategy.layout.keys(Role.BASE, Role.HEAD))
    for k in bases:
        mask = strategy.masks[k]
        assert sent[k].dtype == F64
        assert torch.equal(sent[k][~mask], received[k][~mask]), k
        assert torch.equal(sent[k][mask], params[k].detach()[mask]), k
        assert not torch.equal(sent[k][mask], received[k][mask]), k  # it trained
