"""Sign choice of the SORF-VeRA refit's singular pairs (fedlr.linalg.sorf_refit).

Singular pairs ``(u_j, v_j)`` are defined up to a common sign, and the refit
of ``b`` and ``d`` depends on it. The references here are dense and float64:
every one of the ``2^r`` patterns is refit from the dense SVD of the dense
update (the dense helpers of ``test_sorf_refit``), and the refit with the
chosen pattern is compared with that dense refit for the same pattern.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from fedlr.linalg import (
    build_lambda_d_rot,
    factored_svd,
    fix_signs,
    polar_factor,
    polar_target,
    refit_layer,
    sorf_left,
    sorf_signs,
)
from fedlr.linalg.sorf import SorfSigns
from fedlr.linalg.sorf_pair_signs import (
    PairSignGap,
    SignChoice,
    SignSearch,
    admissible_patterns,
    choose_pair_signs,
    pair_sign_gap,
)
from fedlr.linalg.sorf_refit import LayerRefit
from tests.unit.test_sorf_refit import (
    _case,
    dense_b_design,
    dense_gamma,
    dense_polar,
    dense_s,
)

F64 = torch.float64
EPS = torch.finfo(F64).eps

# (d_out, d_in, r, seed): powers of two (S orthogonal, closed-form fit of b)
# and not (CGLS, CG projections), d_in above and below d_out.
CASES = [
    (8, 11, 4, 0),
    (16, 20, 5, 1),
    (24, 30, 6, 2),
    (24, 17, 7, 3),
    (12, 40, 6, 4),
    (32, 9, 6, 5),
    (40, 40, 8, 6),
    (18, 25, 5, 7),
]


# ------------------------------------------------------------ dense references
class DenseRefits:
    """The dense refit of one layer for any sign pattern of its singular pairs."""

    def __init__(
        self,
        lam: torch.Tensor,
        b_real: torch.Tensor,
        b_imag: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        signs: SorfSigns,
    ) -> None:
        self.r = a.shape[0]
        self.a, self.b = a.to(F64), b.to(F64)
        s = dense_s(signs)
        gamma = dense_gamma(b_real.to(F64), b_imag.to(F64))
        self.update = s @ gamma @ self.b @ lam.to(F64) @ self.a
        u, sv, vh = torch.linalg.svd(self.update, full_matrices=False)
        self.u, self.vh = fix_signs(u[:, : self.r], vh[: self.r])
        self.sv = sv[: self.r]
        self.design = dense_b_design(s, self.b)
        self.norm = float(torch.linalg.matrix_norm(self.update))

    def relative_gap_of_spectrum(self) -> float:
        sv = self.sv
        return float((torch.cat([sv[:-1] - sv[1:], sv[-1:]]) / sv[0]).min())

    def refit(self, eps: torch.Tensor) -> dict[str, Any]:
        """Refit with ``(u_j, v_j)`` flipped by ``eps``, then the parity rule."""
        eps = eps.to(F64).clone()
        vh = eps[:, None] * self.vh
        o, dvals = dense_polar(vh @ torch.linalg.pinv(self.a))
        if float(torch.linalg.det(o)) < 0:  # today's rule: flip the last pair
            eps[-1] = -eps[-1]
            vh[-1], o[-1] = -vh[-1], -o[-1]
        target = (self.u * eps) * self.sv
        coef = torch.linalg.lstsq(
            self.design, target.flatten(), driver="gelsd"
        ).solution
        fitted = (self.design @ coef).reshape(target.shape)
        lam_new = dvals.mean() * o
        return {
            "eps": eps,
            "fitted": fitted,
            "lambda": lam_new,
            "gap": float(
                torch.linalg.matrix_norm(fitted @ lam_new @ self.a - self.update)
            ),
            "b_residual": float(
                torch.linalg.matrix_norm(fitted - target)
                / torch.linalg.matrix_norm(target)
            ),
            "d_residual": float(
                torch.linalg.matrix_norm(lam_new @ self.a - vh)
                / torch.linalg.matrix_norm(vh)
            ),
        }

    def all_gaps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every one of the ``2^r`` patterns and its dense refit gap."""
        patterns = torch.tensor(
            list(itertools.product((1.0, -1.0), repeat=self.r)), dtype=F64
        )
        gaps = torch.tensor([self.refit(e)["gap"] for e in patterns], dtype=F64)
        return patterns, gaps


def _layer(d_out: int, d_in: int, r: int, seed: int) -> tuple[Any, ...]:
    lam, b_real, b_imag, a, b = _case(d_out, d_in, r, seed)
    return lam, b_real, b_imag, a, b, sorf_signs(d_out, seed + 1)


def _model_inputs(layer: tuple[Any, ...]) -> tuple[Any, ...]:
    lam, b_real, b_imag, a, b, signs = layer
    svd = factored_svd(
        sorf_left(signs.to(F64), b_real, b_imag, b.to(F64)),
        lam.to(F64) @ a.to(F64),
        rank=a.shape[0],
    )
    polar = polar_factor(polar_target(a, svd.vh))
    return svd, polar, a, b, signs


def _eps(fit: LayerRefit) -> torch.Tensor:
    assert fit.pair_signs is not None
    return fit.pair_signs


def _model(choice: SignChoice | None) -> PairSignGap:
    assert choice is not None and choice.model is not None
    return choice.model


def _tol(dense: DenseRefits) -> float:
    """Absolute tolerance on gaps: rounding amplified by the spectral gap."""
    rel = dense.relative_gap_of_spectrum()
    cond_a = float(torch.linalg.cond(dense.a))
    return 200 * EPS * max(dense.update.shape) * cond_a / rel * dense.norm


# ------------------------------------------------------------------- the model
@pytest.mark.parametrize("case", CASES)
def test_model_is_the_refit_gap_of_every_pattern(case: tuple[int, ...]) -> None:
    layer = _layer(*case)
    dense = DenseRefits(*layer)
    assert dense.relative_gap_of_spectrum() > 1e-3
    model = pair_sign_gap(*_model_inputs(layer), search=SignSearch.exact())
    assert model.exact
    patterns, gaps = dense.all_gaps()
    # the model is defined on admissible patterns; the refit maps the others
    # to admissible ones by flipping the last pair
    admissible = torch.stack([dense.refit(e)["eps"] for e in patterns])
    assert bool((admissible.prod(1) == model.parity).all())
    torch.testing.assert_close(
        model.gap(admissible), gaps, rtol=0, atol=_tol(dense) + 1e-7 * dense.norm
    )


def test_admissible_patterns_are_all_patterns_of_one_parity() -> None:
    for r, parity in ((1, 1.0), (1, -1.0), (4, 1.0), (5, -1.0)):
        patterns = admissible_patterns(r, parity)
        assert patterns.shape == (2 ** (r - 1), r)
        assert bool((patterns.prod(1) == parity).all())
        assert len({tuple(p.tolist()) for p in patterns}) == 2 ** (r - 1)
        assert patterns[0, :-1].eq(1).all() and patterns[0, -1] == parity


# --------------------------------------------------------------- the search
@pytest.mark.parametrize("case", CASES)
def test_exhaustive_choice_is_the_brute_force_minimum(case: tuple[int, ...]) -> None:
    layer = _layer(*case)
    dense = DenseRefits(*layer)
    _, gaps = dense.all_gaps()
    tol = _tol(dense)
    fit = refit_layer(*layer, sign_search="gap", search=SignSearch.exact())
    assert fit.sign_choice is not None and fit.sign_choice.exhaustive
    assert fit.sign_choice.patterns == 2 ** (case[2] - 1)
    assert fit.gap == pytest.approx(float(gaps.min()), abs=tol)
    assert fit.sign_choice.gap == pytest.approx(fit.gap, abs=tol + 1e-7 * dense.norm)
    # the default (float32, Jacobi) model picks a pattern at least as good as
    # today's rule on these layers
    peak = refit_layer(*layer)
    fast = refit_layer(*layer, sign_search="gap")
    assert fast.gap <= peak.gap + tol
    assert float(gaps.min()) - tol <= fast.gap


@pytest.mark.parametrize("case", CASES)
def test_refit_on_the_chosen_signs_matches_the_dense_refit_of_that_pattern(
    case: tuple[int, ...],
) -> None:
    layer = _layer(*case)
    _, _, _, a, b, signs = layer
    dense = DenseRefits(*layer)
    fit = refit_layer(*layer, sign_search="gap", search=SignSearch.exact())
    ref = dense.refit(_eps(fit))
    assert torch.equal(ref["eps"], _eps(fit))  # admissible: no flip left
    tol = _tol(dense)
    assert fit.gap == pytest.approx(ref["gap"], abs=tol)
    assert fit.b_residual == pytest.approx(ref["b_residual"], abs=tol / dense.norm)
    assert fit.d_residual == pytest.approx(ref["d_residual"], abs=tol / dense.norm)
    built = build_lambda_d_rot(fit.d_scale, fit.d_angles, a.shape[0])
    scale = float(dense.sv[0])
    torch.testing.assert_close(
        built, ref["lambda"], rtol=0, atol=tol / dense.norm * scale
    )
    fitted = sorf_left(signs, fit.b_real, fit.b_imag, b)
    torch.testing.assert_close(fitted, ref["fitted"], rtol=0, atol=tol)


@pytest.mark.parametrize("case", CASES)
def test_flips_leave_the_update_unchanged(case: tuple[int, ...]) -> None:
    layer = _layer(*case)
    svd, polar, a, b, signs = _model_inputs(layer)
    choice = choose_pair_signs(svd, polar, a, b, signs, search=SignSearch.exact())
    eps = choice.signs
    assert bool((eps.abs() == 1).all()) and float(eps.prod()) == _model(choice).parity
    before = (svd.u * svd.s) @ svd.vh
    after = (svd.u * eps * svd.s) @ (eps[:, None] * svd.vh)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    # the rotation convention holds: the flipped polar factor has det +1
    flipped = polar_factor(polar_target(a, eps[:, None] * svd.vh))
    assert float(torch.linalg.det(flipped.o)) > 0


GREEDY_CASES = [
    (24, 30, 9, 10),
    (40, 33, 10, 11),
    (64, 50, 12, 12),
    (96, 80, 16, 13),
    (100, 64, 16, 14),
    (128, 128, 16, 15),
]


@pytest.mark.parametrize("case", GREEDY_CASES)
@pytest.mark.parametrize("exact", [True, False])
def test_greedy_is_never_worse_than_the_peak_rule(
    case: tuple[int, ...], exact: bool
) -> None:
    layer = _layer(*case)
    r = case[2]
    settings = SignSearch.exact if exact else SignSearch
    search = settings(exhaustive_rank=4)
    peak = refit_layer(*layer)
    fit = refit_layer(*layer, sign_search="gap", search=search)
    choice = fit.sign_choice
    assert choice is not None and not choice.exhaustive
    assert choice.gap <= choice.peak_gap
    assert fit.gap <= peak.gap * (1 + 1e-9)
    # the descent flips pairs of pairs: the pattern stays admissible
    assert float(_eps(fit).prod()) == _model(choice).parity
    if r <= 10:  # against the exhaustive minimum of the same model
        best = refit_layer(*layer, sign_search="gap", search=settings())
        assert best.sign_choice is not None and best.sign_choice.exhaustive
        assert best.gap <= fit.gap * (1 + 1e-9)
    if exact:  # the model is the refit gap
        assert choice.gap == pytest.approx(fit.gap, rel=1e-7)
        assert choice.peak_gap == pytest.approx(peak.gap, rel=1e-7)


def test_search_is_deterministic() -> None:
    layer = _layer(96, 80, 16, 13)
    first = refit_layer(*layer, sign_search="gap", search=SignSearch(starts=6))
    second = refit_layer(*layer, sign_search="gap", search=SignSearch(starts=6))
    assert torch.equal(_eps(first), _eps(second))
    assert torch.equal(first.b_real, second.b_real)
    assert first.gap == second.gap


# ------------------------------------------------------------ the peak rule
@pytest.mark.parametrize("case", CASES[:4])
def test_peak_rule_is_the_former_refit(case: tuple[int, ...]) -> None:
    layer = _layer(*case)
    dense = DenseRefits(*layer)
    plain = refit_layer(*layer)
    peak = refit_layer(*layer, sign_search="peak")
    assert plain.sign_choice is None and peak.sign_choice is None
    for name in ("b_real", "b_imag", "d_scale", "d_angles", "pair_signs"):
        assert torch.equal(getattr(plain, name), getattr(peak, name))
    ones = torch.ones(case[2], dtype=F64)
    ref = dense.refit(ones)
    assert torch.equal(_eps(peak), ref["eps"])
    assert peak.gap == pytest.approx(ref["gap"], abs=_tol(dense))


def test_explicit_pair_signs_follow_the_parity_rule() -> None:
    layer = _layer(24, 30, 6, 2)
    dense = DenseRefits(*layer)
    for eps in (torch.ones(6), torch.tensor([1.0, -1, 1, 1, -1, 1])):
        fit = refit_layer(*layer, pair_signs=eps)
        ref = dense.refit(eps)
        assert torch.equal(_eps(fit), ref["eps"])
        assert fit.gap == pytest.approx(ref["gap"], abs=_tol(dense))


def test_a_zero_update_needs_no_signs() -> None:
    lam, b_real, b_imag, a, b, signs = _layer(16, 12, 4, 3)
    fit = refit_layer(
        torch.zeros_like(lam), b_real, b_imag, a, b, signs, sign_search="gap"
    )
    assert fit.pair_signs is None and fit.gap == 0.0


def test_rank_one_has_one_admissible_pattern() -> None:
    layer = _layer(16, 12, 1, 3)
    fit = refit_layer(*layer, sign_search="gap")
    assert fit.sign_choice is not None and fit.sign_choice.patterns == 0
    assert torch.equal(_eps(fit), _eps(refit_layer(*layer)))


# ------------------------------------------------------------------ validation
def test_rejects_unknown_rules_and_bad_settings() -> None:
    layer = _layer(8, 6, 2, 0)
    with pytest.raises(ValueError, match="sign_search must be one of"):
        refit_layer(*layer, sign_search="largest")
    with pytest.raises(ValueError, match="sign rule must be one of"):
        choose_pair_signs(*_model_inputs(layer), rule="largest")
    with pytest.raises(ValueError, match="pair_signs must be"):
        refit_layer(*layer, pair_signs=torch.tensor([1.0, 0.5]))
    with pytest.raises(ValueError, match="pair_signs must be"):
        refit_layer(*layer, pair_signs=torch.ones(3))
    for bad in (
        {"exhaustive_rank": 0},
        {"starts": 0},
        {"rtol": 0.0},
        {"max_iter": -1},
        {"dtype": torch.float16},
    ):
        with pytest.raises(ValueError):
            SignSearch(**bad)


def test_strategy_option_is_validated_and_used() -> None:
    from fedlr.adapters.sorf_vera import SorfVeraLayout, SorfVeraModule
    from fedlr.strategies import SorfVeRA

    r = 2
    layout = SorfVeraLayout(
        modules=(SorfVeraModule("x", "x.br", "x.bi", "x.m", "x.t", "x.W", 8, 6, r),),
        rank=r,
        projection_seed=9,
    )
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(r, 6, generator=g), torch.randn(8, r, generator=g)
    assert SorfVeRA(layout=layout, projection_a=a, projection_b=b).sign_search == "gap"
    peak = SorfVeRA(layout=layout, projection_a=a, projection_b=b, sign_search="peak")
    assert peak.sign_search == "peak"
    with pytest.raises(ValueError, match="sign_search"):
        SorfVeRA(layout=layout, projection_a=a, projection_b=b, sign_search="max")
