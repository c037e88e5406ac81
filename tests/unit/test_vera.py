"""VeRA residual kernel, peft VeRA adapter and SORF-VeRA module vs dense formulas."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peft.tuners.vera import VeraLayer

from fedlr.adapters import Role
from fedlr.adapters.sorf_vera import (
    SorfVeraLinear,
    SorfVeraSettings,
    build_sorf_vera_model,
    layer_of,
    layer_signs,
)
from fedlr.adapters.vera import VeraSettings, build_vera_model, check_projection
from fedlr.errors import ProjectionMismatchError, ShapeMismatchError
from fedlr.linalg import factored_frobenius_norm
from fedlr.linalg.sorf import build_lambda_d_rot, sorf_signs
from fedlr.linalg.vera import (
    fold_vera_residual,
    vera_factors,
    vera_gap_norms,
    vera_residual_factors,
)
from fedlr.models import build_text_classifier

F64 = torch.float64


def dense_vera(lb, ld, a, b):
    return torch.diag(lb) @ b @ torch.diag(ld) @ a


@given(
    d_out=st.integers(1, 12),
    d_in=st.integers(1, 12),
    r=st.integers(1, 6),
    k=st.integers(1, 5),
    seed=st.integers(0, 999),
)
@settings(max_examples=50, deadline=None)
def test_vera_residual_factors_equal_dense(d_out, d_in, r, k, seed):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(r, d_in, generator=gen, dtype=F64)
    b = torch.randn(d_out, r, generator=gen, dtype=F64)
    lbs = [torch.randn(d_out, generator=gen, dtype=F64) for _ in range(k)]
    lds = [torch.randn(r, generator=gen, dtype=F64) for _ in range(k)]
    w = torch.rand(k, generator=gen, dtype=F64) + 0.1
    wn = w / w.sum()
    mean = sum(
        wi * dense_vera(lb, ld, a, b) for wi, lb, ld in zip(wn, lbs, lds, strict=True)
    )
    lb_bar = sum(wi * lb for wi, lb in zip(wn, lbs, strict=True))
    ld_bar = sum(wi * ld for wi, ld in zip(wn, lds, strict=True))
    expected = mean - dense_vera(lb_bar, ld_bar, a, b)
    left, right = vera_residual_factors(lbs, lds, a, b, w)
    assert left.shape == (d_out, (k + 1) * r) and right.shape == ((k + 1) * r, d_in)
    scale = 1e-12 * (1 + float(expected.abs().max())) * max(d_out, d_in, r * k)
    assert torch.allclose(left @ right, expected, atol=scale)
    assert factored_frobenius_norm(left, right) == pytest.approx(
        float(torch.linalg.matrix_norm(expected)), abs=1e-10
    )
    # The gap report's norms, linear in k, from the d_out x r matrices
    gap, mean_norm = vera_gap_norms(lbs, lds, a, b, w)
    assert gap == pytest.approx(float(torch.linalg.matrix_norm(expected)), abs=1e-10)
    assert mean_norm == pytest.approx(
        float(torch.linalg.matrix_norm(mean)), rel=1e-10, abs=1e-10
    )


@pytest.mark.parametrize("step", [1.0, 0.5])
def test_fold_vera_residual_is_exact(step):
    gen = torch.Generator().manual_seed(1)
    d_out, d_in, r, k = 7, 5, 3, 4
    a = torch.randn(r, d_in, generator=gen, dtype=F64)
    b = torch.randn(d_out, r, generator=gen, dtype=F64)
    w0 = torch.randn(d_out, d_in, generator=gen, dtype=F64)
    lbs = [torch.randn(d_out, generator=gen, dtype=F64) for _ in range(k)]
    lds = [torch.randn(r, generator=gen, dtype=F64) for _ in range(k)]
    weights = [1.0, 2.0, 3.0, 4.0]
    new = fold_vera_residual(w0, lbs, lds, a, b, weights, scaling=2.0, step=step)
    wn = [x / 10 for x in weights]
    lb_bar = sum(wi * lb for wi, lb in zip(wn, lbs, strict=True))
    ld_bar = sum(wi * ld for wi, ld in zip(wn, lds, strict=True))
    mean = sum(
        wi * dense_vera(lb, ld, a, b) for wi, lb, ld in zip(wn, lbs, lds, strict=True)
    )
    avg = dense_vera(lb_bar, ld_bar, a, b)
    expected = w0 + 2.0 * step * (mean - avg)
    assert torch.allclose(new, expected, atol=1e-12)
    if step == 1.0:  # exactness: W0_new + s avg == W0 + s mean
        assert torch.allclose(new + 2.0 * avg, w0 + 2.0 * mean, atol=1e-12)


def test_vera_factors_reject_bad_shapes():
    with pytest.raises(ShapeMismatchError, match="VeRA shapes"):
        vera_factors(
            torch.zeros(4), torch.zeros(3), torch.zeros(3, 5), torch.zeros(4, 2)
        )


# ------------------------------------------------------------------ peft VeRA
def _tiny(seed: int = 7) -> torch.nn.Module:
    return build_text_classifier("tiny-bert", 2, seed)


def test_peft_vera_layout_and_delta_match_our_formula():
    vm = build_vera_model(_tiny(), VeraSettings(rank=8, projection_seed=3))
    layout = vm.layout
    assert len(layout.modules) == 4  # query, value in 2 layers
    assert set(layout.shapes(Role.VERA_LAMBDA_B).values()) == {(32,)}
    assert set(layout.shapes(Role.VERA_LAMBDA_D).values()) == {(8,)}
    assert vm.projection_a.shape == (8, 32) and vm.projection_b.shape == (32, 8)
    gen = torch.Generator().manual_seed(0)
    state = {
        k: torch.randn(s, generator=gen)
        for k, s in layout.shapes(Role.VERA_LAMBDA_B, Role.VERA_LAMBDA_D).items()
    }
    vm.load(state)
    for m in layout.modules:
        peft_layer = vm.model.get_submodule(m.name)
        assert isinstance(peft_layer, VeraLayer)
        delta = peft_layer.get_delta_weight("default").double()
        ours = m.scaling * dense_vera(
            state[m.lambda_b_key].double(),
            state[m.lambda_d_key].double(),
            vm.projection_a[:, : m.d_in].double(),
            vm.projection_b[: m.d_out].double(),
        )
        assert torch.allclose(delta, ours, atol=1e-5)


def test_vera_projections_are_seeded():
    a = build_vera_model(_tiny(), VeraSettings(rank=4, projection_seed=1))
    b = build_vera_model(_tiny(), VeraSettings(rank=4, projection_seed=1))
    c = build_vera_model(_tiny(), VeraSettings(rank=4, projection_seed=2))
    assert torch.equal(a.projection_a, b.projection_a)
    assert torch.equal(a.projection_b, b.projection_b)
    assert not torch.equal(a.projection_a, c.projection_a)


def test_vera_train_only_and_load_restore_pristine_base():
    vm = build_vera_model(_tiny(), VeraSettings(rank=4, projection_seed=1))
    vm.train_only([Role.VERA_LAMBDA_B, Role.HEAD])
    trainable = [p for p in vm.model.parameters() if p.requires_grad]
    expected = len(vm.layout.keys(Role.VERA_LAMBDA_B, Role.HEAD))
    assert len(trainable) == expected
    base_key = vm.layout.modules[0].base_key
    moved = {base_key: vm.pristine_base[base_key] + 1.0}
    vm.load(moved)
    assert torch.equal(vm.state([Role.BASE])[base_key], moved[base_key])
    vm.load({})
    assert torch.equal(vm.state([Role.BASE])[base_key], vm.pristine_base[base_key])
    with pytest.raises(ShapeMismatchError):
        vm.load({base_key: torch.zeros(3)})
    with pytest.raises(KeyError):
        vm.load({"no.such.key": torch.zeros(3)})


def test_projection_mismatch_is_a_named_error():
    check_projection(3, 8, 3, 8)
    with pytest.raises(ProjectionMismatchError, match="projection-seed 3 and rank 8"):
        check_projection(4, 8, 3, 8)
    with pytest.raises(ProjectionMismatchError, match="rank 16"):
        check_projection(3, 16, 3, 8)


# ------------------------------------------------------------------ SORF-VeRA
def _sorf_layer(d_out: int, d_in: int, r: int, seed: int = 0) -> SorfVeraLinear:
    gen = torch.Generator().manual_seed(seed)
    base = torch.nn.Linear(d_in, d_out).double()
    a = torch.randn(r, d_in + 3, generator=gen, dtype=F64)
    b = torch.randn(d_out + 2, r, generator=gen, dtype=F64)
    layer = SorfVeraLinear(base, a, b, sorf_signs(d_out, seed, dtype=F64)).double()
    with torch.no_grad():
        layer.b_real.copy_(torch.randn(d_out // 2, generator=gen, dtype=F64))
        layer.b_imag.copy_(torch.randn(d_out // 2, generator=gen, dtype=F64))
        layer.d_scale.fill_(0.8)
        layer.d_angles.copy_(torch.randn(r * (r - 1) // 2, generator=gen, dtype=F64))
    return layer


def _dense_gamma(a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    g = torch.zeros(2 * a.numel(), 2 * a.numel(), dtype=a.dtype)
    for j in range(a.numel()):
        g[2 * j : 2 * j + 2, 2 * j : 2 * j + 2] = torch.stack(
            [torch.stack([a[j], -c[j]]), torch.stack([c[j], a[j]])]
        )
    return g


@pytest.mark.parametrize(("d_out", "d_in", "r"), [(8, 5, 3), (12, 10, 4), (32, 16, 6)])
def test_sorf_vera_forward_equals_dense(d_out, d_in, r):
    layer = _sorf_layer(d_out, d_in, r)
    s = layer.signs.dense()
    lam = build_lambda_d_rot(layer.d_scale.detach(), layer.d_angles.detach(), r)
    delta = (
        s
        @ _dense_gamma(layer.b_real.detach(), layer.b_imag.detach())
        @ layer.proj_b
        @ lam
        @ layer.proj_a
    )
    assert delta.shape == (d_out, d_in)
    x = torch.randn(4, 3, d_in, dtype=F64)
    expected = layer.base_layer(x) + x @ delta.T
    assert torch.allclose(layer(x), expected, atol=1e-10)
    assert torch.allclose(layer.delta_weight(), delta, atol=1e-10)


def test_sorf_vera_gradients_reach_only_d_and_head():
    model = build_text_classifier("tiny-bert", 2, 7)
    vm = build_sorf_vera_model(
        model, SorfVeraSettings(rank=5, projection_seed=1, d_scale_initial=0.3)
    )
    names = {n for n, p in vm.model.named_parameters() if p.requires_grad}
    assert names == set(
        vm.layout.keys(Role.SORF_D_SCALE, Role.SORF_D_ANGLES, Role.HEAD)
    )
    ids = torch.randint(0, 1000, (3, 9))
    out = vm.model(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        labels=torch.tensor([0, 1, 0]),
    )
    out.loss.backward()
    for name, p in vm.model.named_parameters():
        if name in names:
            assert p.grad is not None and float(p.grad.abs().sum()) > 0, name
        else:
            assert p.grad is None, name


def test_sorf_vera_starts_at_the_pretrained_model_and_shares_signs():
    model = build_text_classifier("tiny-bert", 2, 7)
    reference = build_text_classifier("tiny-bert", 2, 7)
    vm = build_sorf_vera_model(model, SorfVeraSettings(rank=4, projection_seed=2))
    ids = torch.randint(0, 1000, (2, 6))
    mask = torch.ones_like(ids)
    model.eval(), reference.eval()
    assert torch.allclose(
        model(input_ids=ids, attention_mask=mask).logits,
        reference(input_ids=ids, attention_mask=mask).logits,
        atol=1e-6,
    )
    first = layer_of(vm.model, vm.layout.modules[0])
    assert torch.equal(first.sign_1, layer_signs(32, 2).d1)
    assert torch.equal(first.proj_a, vm.projection_a[:, :32])
    assert len(vm.layout.keys(Role.SORF_D_ANGLES)) == 4


def test_sorf_vera_rejects_odd_out_features():
    with pytest.raises(ShapeMismatchError, match="even"):
        SorfVeraLinear(
            torch.nn.Linear(4, 5),
            torch.zeros(2, 4),
            torch.zeros(5, 2),
            sorf_signs(5, 0),
        )
