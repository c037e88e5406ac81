"""FedRot-LoRA: the Procrustes alignment (kernel) and the client feature.

In float64, against dense references: scipy's ``orthogonal_procrustes`` (an
independent solver of the same problem) and the objective itself; the
aligned average recovers the common product exactly when clients' factors
differ only by rotations (the paper's motivating case), where the plain
average does not. The feature runs through the public client helpers
(``apply_round``, ``ClientRound.reply``) on the plug-in app's peft model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from scipy.linalg import orthogonal_procrustes

from fedlr import apply_round
from fedlr.adapters import Role, parameters_by_key
from fedlr.errors import ProtocolError
from fedlr.flower.records import record_to_state
from fedlr.strategies.fedrot_lora import (
    FEDROT_ALIGN,
    FEDROT_STRENGTH,
    FedRotLoRA,
    align_factors,
    procrustes_rotation,
)
from fedlr.wire import protocol
from tests.plugin_app.task import build_model, load_data
from tests.strategies.test_plugin import _context, _message

F64 = torch.float64
EPS = torch.finfo(F64).eps


def _orthogonal(r: int, g: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(r, r, generator=g, dtype=F64))
    return q


def _objective(
    rotation: torch.Tensor, factor: torch.Tensor, ref: torch.Tensor, role: Role
) -> float:
    moved = rotation.T @ factor if role is Role.LORA_A else factor @ rotation
    return float(torch.linalg.matrix_norm(moved - ref))


# ------------------------------------------------------------------- kernel
@pytest.mark.parametrize("role", [Role.LORA_A, Role.LORA_B])
@pytest.mark.parametrize("r", [1, 3, 8])
def test_procrustes_rotation_is_the_optimum_of_a_dense_solver(role, r):
    g = torch.Generator().manual_seed(11 + r)
    shape = (r, 40) if role is Role.LORA_A else (30, r)
    factor = torch.randn(shape, generator=g, dtype=F64)
    ref = torch.randn(shape, generator=g, dtype=F64)
    rotation = procrustes_rotation(factor, ref, role=role)
    torch.testing.assert_close(rotation.T @ rotation, torch.eye(r, dtype=F64))
    # scipy: argmin_R ||X R - Y||_F over orthogonal R, written as X R ~ Y
    x, y = (factor.T, ref.T) if role is Role.LORA_A else (factor, ref)
    dense, _ = orthogonal_procrustes(x.numpy(), y.numpy())
    np.testing.assert_allclose(rotation.numpy(), dense, atol=1e3 * EPS * r)
    best = _objective(rotation, factor, ref, role)
    # no orthogonal matrix does better: random ones, and small moves R exp(K)
    for _ in range(200):
        assert best <= _objective(_orthogonal(r, g), factor, ref, role) + 1e-12
    for _ in range(50):
        skew = 1e-3 * torch.randn(r, r, generator=g, dtype=F64)
        moved = rotation @ torch.linalg.matrix_exp(skew - skew.T)
        assert best <= _objective(moved, factor, ref, role) + 1e-12


@pytest.mark.parametrize("role", [Role.LORA_A, Role.LORA_B])
def test_aligned_average_recovers_the_common_product_of_rotated_clients(role):
    """Clients hold (B Q_i, Q_i^T A): one update in different coordinates. Each
    lands on (B P, P^T A) whatever the reference, so any weighted mean of the
    aligned factors has the product B A; the plain mean does not."""
    g = torch.Generator().manual_seed(5)
    r, d_out, d_in = 4, 12, 9
    b = torch.randn(d_out, r, generator=g, dtype=F64)
    a = torch.randn(r, d_in, generator=g, dtype=F64)
    ref_shape = (r, d_in) if role is Role.LORA_A else (d_out, r)
    reference = torch.randn(ref_shape, generator=g, dtype=F64)
    clients = []
    for _ in range(4):
        q = _orthogonal(r, g)
        clients.append((q.T @ a, b @ q))
    w = torch.tensor([5.0, 17.0, 40.0, 3.0], dtype=F64)
    w = w / w.sum()
    aligned = [align_factors(ai, bi, reference, role=role) for ai, bi in clients]
    a_bar = sum(wi * ai for wi, (ai, _) in zip(w, aligned, strict=True))
    b_bar = sum(wi * bi for wi, (_, bi) in zip(w, aligned, strict=True))
    want = b @ a
    err = float((b_bar @ a_bar - want).abs().max())
    assert err <= 1e3 * EPS * float(want.abs().max())
    # every client's own product is kept
    for (ai, bi), (aj, bj) in zip(clients, aligned, strict=True):
        torch.testing.assert_close(bj @ aj, bi @ ai)
    # not vacuous: without the alignment the mean loses the product
    plain_a = sum(wi * ai for wi, (ai, _) in zip(w, clients, strict=True))
    plain_b = sum(wi * bi for wi, (_, bi) in zip(w, clients, strict=True))
    assert float((plain_b @ plain_a - want).abs().max()) > 0.1 * float(want.abs().max())


def test_soft_strength_is_orthogonal_between_identity_and_the_rotation():
    g = torch.Generator().manual_seed(8)
    r = 5
    factor = torch.randn(r, 20, generator=g, dtype=F64)
    ref = torch.randn(r, 20, generator=g, dtype=F64)
    full = procrustes_rotation(factor, ref, role=Role.LORA_A)
    if float(torch.linalg.det(full)) < 0:  # the soft path starts from a rotation
        u, _, vh = torch.linalg.svd(factor @ ref.T)
        u[:, -1] = -u[:, -1]
        full = u @ vh
    eye = torch.eye(r, dtype=F64)
    previous = 0.0
    for strength in (1e-6, 0.25, 0.5, 0.75, 0.999999):
        soft = procrustes_rotation(factor, ref, role=Role.LORA_A, strength=strength)
        torch.testing.assert_close(soft.T @ soft, eye)
        assert float(torch.linalg.det(soft)) > 0
        # the polar factor of (1 - l) I + l R*, checked against its definition
        u, _, vh = torch.linalg.svd((1 - strength) * eye + strength * full)
        torch.testing.assert_close(soft, u @ vh)
        distance = float(torch.linalg.matrix_norm(soft - eye))
        assert distance >= previous - 1e-9  # monotone from I towards R*
        previous = distance
    tiny = procrustes_rotation(factor, ref, role=Role.LORA_A, strength=1e-6)
    assert float(torch.linalg.matrix_norm(tiny - eye)) < 1e-4


def test_kernel_refuses_shapes_roles_and_strengths_it_cannot_use():
    a = torch.zeros(3, 4)
    with pytest.raises(ValueError, match=r"\(3, 4\).*\(4, 3\)"):
        procrustes_rotation(a, a.T, role=Role.LORA_A)
    with pytest.raises(ValueError, match="lora_A or lora_B"):
        procrustes_rotation(a, a, role=Role.HEAD)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        procrustes_rotation(a, a, role=Role.LORA_A, strength=0.0)


# ------------------------------------------------------------------- server
def test_server_alternates_the_reference_from_round_two():
    model = build_model("fedrot-lora")
    strategy = FedRotLoRA.for_model(model, fedrot_strength=0.5)
    assert FEDROT_ALIGN not in strategy.round_config(1)
    roles = [strategy.round_config(t)[FEDROT_ALIGN] for t in (2, 3, 4, 5)]
    assert roles == ["lora_A", "lora_B", "lora_A", "lora_B"]
    assert strategy.round_config(2)[FEDROT_STRENGTH] == 0.5
    only_b = FedRotLoRA.for_model(model, fedrot_reference="lora_B")
    assert [only_b.round_config(t)[FEDROT_ALIGN] for t in (2, 3)] == ["lora_B"] * 2


# ------------------------------------------------------------------- client
def _instruction(strategy: FedRotLoRA, model, server_round: int, seed: int):
    """A train instruction of ``server_round`` whose arrays are the initial
    ones moved by a seeded perturbation (a non-zero global ``B``)."""
    g = torch.Generator().manual_seed(seed)
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
    return _message(content, 1000), arrays


@pytest.mark.parametrize(("server_round", "role"), [(2, Role.LORA_A), (3, Role.LORA_B)])
def test_client_replies_its_trained_factors_rotated_onto_the_received_ones(
    server_round, role
):
    model = build_model("fedrot-lora")
    strategy = FedRotLoRA.for_model(model)
    message, sent = _instruction(strategy, model, server_round, seed=server_round)
    job = apply_round(model, message, _context())
    assert [type(f).__name__ for f in job.features] == ["RotationAlignment"]
    x, y = load_data(0)
    for _ in range(5):
        for p in job.parameters():
            p.grad = None
        torch.nn.functional.cross_entropy(job.model(x), y).backward()
        with torch.no_grad():
            for p in job.parameters():
                p.sub_(0.1 * p.grad)
    params = parameters_by_key(model, strategy.layout)
    answer = job.reply(num_examples=len(y))
    got = record_to_state(answer.content.array_records[protocol.ARRAYS])
    assert set(got) == set(strategy.layout.keys(*strategy.train_roles))
    for m in strategy.layout.modules:
        a = params[m.a_key].detach().double()
        b = params[m.b_key].detach().double()
        ref = sent[m.a_key if role is Role.LORA_A else m.b_key].double()
        x_, y_ = (a.T, ref.T) if role is Role.LORA_A else (b, ref)
        rotation = torch.from_numpy(orthogonal_procrustes(x_.numpy(), y_.numpy())[0])
        tol = {"rtol": 1e-5, "atol": 1e-6}
        torch.testing.assert_close(got[m.a_key].double(), rotation.T @ a, **tol)
        torch.testing.assert_close(got[m.b_key].double(), b @ rotation, **tol)
        # the update the client trained is the one it sends
        torch.testing.assert_close(
            got[m.b_key].double() @ got[m.a_key].double(), b @ a, **tol
        )
        # and it is closer to the reference than before (not vacuous)
        before = _objective(
            torch.eye(m.rank, dtype=F64), a if role is Role.LORA_A else b, ref, role
        )
        after = _objective(rotation, a if role is Role.LORA_A else b, ref, role)
        assert after < before
    for key in strategy.layout.keys(Role.HEAD):
        torch.testing.assert_close(got[key], params[key].detach())


def test_round_one_aligns_nothing_and_a_bad_role_is_refused():
    model = build_model("fedrot-lora")
    strategy = FedRotLoRA.for_model(model)
    message, _ = _instruction(strategy, model, 1, seed=1)
    assert apply_round(model, message, _context()).features == ()
    bad, _ = _instruction(strategy, model, 2, seed=2)
    bad.content[protocol.CONFIG][FEDROT_ALIGN] = "head"
    with pytest.raises(ProtocolError, match="fedrot-align"):
        apply_round(model, bad, _context())
