"""FedLEASE: the allocation kernels and the expert-mixture client feature.

The clustering against scipy's average linkage and scikit-learn's
silhouette; the adaptive top-M gates against their definition; the client's
mixed forward pass against ``W0 x + s sum_e g_e(x) B_e A_e x`` written out
densely in float64 on a peft MLP, then a training round's reply.
"""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from peft import LoraConfig, get_peft_model
from scipy.cluster.hierarchy import fcluster, linkage
from scipy.spatial.distance import squareform
from sklearn.metrics import silhouette_score

from fedlr import apply_round
from fedlr.adapters import Role
from fedlr.flower.records import record_to_state
from fedlr.strategies.fedlease import (
    FEDLEASE_ROUTER,
    FedLease,
    average_linkage,
    b_distances,
    choose_experts,
    mixture_gates,
    silhouette,
)
from fedlr.wire import protocol
from tests.plugin_app.task import MLP, load_data
from tests.strategies.test_plugin import _context, _message

F64 = torch.float64
M = 3


def _same_partition(a: list[int], b: list[int]) -> bool:
    pairs = range(len(a))
    return all((a[i] == a[j]) == (b[i] == b[j]) for i in pairs for j in pairs)


# ------------------------------------------------------------------ kernels
def test_clustering_matches_scipy_and_sklearn():
    g = torch.Generator().manual_seed(5)
    centres = torch.randn(3, 6, 4, generator=g, dtype=F64)
    bs = [
        {
            "l1": centres[i % 3] + 0.3 * torch.randn(6, 4, generator=g, dtype=F64),
            "l2": torch.randn(5, 4, generator=g, dtype=F64),
        }
        for i in range(9)
    ]
    d = b_distances(bs)
    for i in range(9):
        for j in range(9):
            cos = [
                float(bs[i][k].flatten() @ bs[j][k].flatten())
                / float(bs[i][k].norm() * bs[j][k].norm())
                for k in ("l1", "l2")
            ]
            want = 0.0 if i == j else sum(1.0 - c for c in cos) / 2
            assert abs(float(d[i, j]) - want) < 1e-12
    tree = linkage(squareform(d.numpy(), checks=False), method="average")
    for k in range(2, 6):
        labels = average_linkage(d, k)
        assert _same_partition(labels, list(fcluster(tree, k, criterion="maxclust")))
        want = silhouette_score(d.numpy(), labels, metric="precomputed")
        assert abs(silhouette(d, labels) - float(want)) < 1e-12
    chosen = choose_experts(d, 4)
    assert max(chosen) + 1 == 3 and chosen[:3] == [0, 1, 2]  # the three centres
    assert choose_experts(d, 1) == [0] * 9  # M_max = 1
    same = b_distances([{"l1": torch.ones(2, 2)}] * 4)
    assert choose_experts(same, 4) == [0] * 4  # no structure: one expert
    assert choose_experts(d[:2, :2], 4) == [0, 0]  # no silhouette for n = 2


def test_gates_always_keep_the_own_expert():
    g = torch.Generator().manual_seed(1)
    logits = 3.0 * torch.randn(200, 2 * M - 1, generator=g)
    for own in range(M):
        gates = mixture_gates(logits, own, M)
        p = torch.softmax(logits.double(), dim=-1)
        for row in range(200):
            top = torch.topk(p[row], M).indices.tolist()
            want = torch.zeros(M, dtype=F64)
            total = float(p[row][top].sum())
            for s in top:
                want[s if s < M else own] += float(p[row][s]) / total
            torch.testing.assert_close(gates[row].double(), want, atol=1e-6, rtol=0)
        assert bool((gates[:, own] > 0).all())
        used = (gates > 0).sum(dim=1)
        assert int(used.min()) >= 1 and int(used.max()) <= M
        assert int(used.min()) < int(used.max())  # adaptive: not a fixed top-k
    with pytest.raises(ValueError, match="expected 5 router logits"):
        mixture_gates(logits[:, :4], 0, M)


# ------------------------------------------------------------------- client
def _model():
    torch.manual_seed(0)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["fc1", "fc2"], modules_to_save=["classifier"]
    )
    return get_peft_model(MLP(), config)


def _allocated(model) -> FedLease:
    """A FedLEASE server past its allocation: M random experts and routers."""
    strategy = FedLease.for_model(model, fedlease_warmup_rounds=1)
    g = torch.Generator().manual_seed(2)
    shapes = strategy.layout.shapes(Role.LORA_A, Role.LORA_B)
    strategy.experts = [
        {
            k: 0.3 * torch.randn(shapes[k], generator=g)
            for m in strategy.layout.modules
            for k in (m.a_key, m.b_key)
        }
        for _ in range(M)
    ]
    strategy.routers = [
        {
            m.name: torch.randn(2 * M - 1, m.d_in, generator=g)
            for m in strategy.layout.modules
        }
        for _ in range(M)
    ]
    strategy.assignment = {1000: 1}
    return strategy


def _instruction(strategy, model, kind: str = "train"):
    arrays = strategy.initial_arrays(model)
    config = strategy.begin_round(2, arrays, ConfigRecord({"lr": 0.1}))
    config[protocol.SERVER_ROUND] = 2
    content = RecordDict({protocol.ARRAYS: arrays, protocol.CONFIG: config})
    (message,) = strategy.instructions(
        2, [_message(content, 1000, kind)], arrays, train=kind == "train"
    )
    return message


@torch.no_grad()
def _dense(model, strategy, x: torch.Tensor, own: int) -> torch.Tensor:
    """Logits of ``W0 x + s sum_e g_e(x) B_e A_e x`` per layer, float64."""
    base = model.base_model.model
    h = x.double()
    for m in strategy.layout.modules:
        layer = getattr(base, m.name.split(".")[-1])
        s = float(layer.scaling["default"])
        router = strategy.routers[own][m.name].double()
        p = torch.softmax(h @ router.T, dim=-1)
        top, index = torch.topk(p, M, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True)
        out = h @ layer.base_layer.weight.double().T + layer.base_layer.bias.double()
        for e in range(M):
            slot_expert = [s_ if s_ < M else own for s_ in range(2 * M - 1)]
            mask = torch.tensor(slot_expert)[index] == e
            gate = (top * mask).sum(dim=-1, keepdim=True)
            a = strategy.experts[e][m.a_key].double()
            b = strategy.experts[e][m.b_key].double()
            out = out + s * gate * (h @ a.T @ b.T)
        h = torch.relu(out)
    head = base.classifier.modules_to_save["default"]
    return h @ head.weight.double().T + head.bias.double()


def test_client_mixes_the_experts_and_trains_its_own_and_the_router():
    model = _model()
    strategy = _allocated(model)
    context = _context()
    job = apply_round(model, _instruction(strategy, model), context)
    assert "ExpertMixture" in [type(f).__name__ for f in job.features]
    assert job.personal_loaded
    x, y = load_data(0)
    with torch.no_grad():
        got = job.model(x)
    want = _dense(model, strategy, x, own=1)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # not vacuous: the own expert alone differs
    alone = _allocated(model)
    alone.routers = [
        {k: torch.zeros_like(v) for k, v in r.items()} for r in strategy.routers
    ]
    assert float((_dense(model, alone, x, own=1) - want).abs().max()) > 1e-3

    optimizer = job.optimizer(torch.optim.SGD(job.parameters(), lr=0.1))
    for _ in range(3):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(job.model(x), y).backward()
        optimizer.step()
    answer = job.reply(num_examples=len(y))
    sent = record_to_state(answer.content[protocol.ARRAYS])
    routers = record_to_state(answer.content[FEDLEASE_ROUTER])
    for m in strategy.layout.modules:
        assert routers[m.name].shape == (2 * M - 1, m.d_in)
        assert float((routers[m.name] - strategy.routers[1][m.name]).abs().max()) > 0
        # the reply is the own expert (1), trained from where the server had it
        assert float((sent[m.b_key] - strategy.experts[1][m.b_key]).abs().max()) > 0
        assert float((sent[m.b_key] - strategy.experts[1][m.b_key]).abs().max()) < 1
    # no hooks left behind: the model is plain LoRA again
    base = model.base_model.model
    assert not base.fc1._forward_hooks and not base.fc2._forward_hooks

    # evaluation: the same mixture, no router asked back
    evaluation = _instruction(strategy, model, kind="evaluate")
    assert FEDLEASE_ROUTER not in evaluation.content.array_records
    assert evaluation.content.config_records[protocol.CONFIG]["fedlease-expert"] == 1
    assert isinstance(evaluation.content.array_records["fedlease-mixture"], ArrayRecord)
