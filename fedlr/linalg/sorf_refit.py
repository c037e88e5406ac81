"""SORF-VeRA server refit of ``b`` and ``d`` from the averaged rotations.

A SORF-VeRA layer's update is ``Delta W = S Gamma(b) B Lambda_d A`` with
``Lambda_d = m G(theta)`` (see :mod:`fedlr.linalg.sorf`). Clients train ``m``
and ``theta`` with ``b`` frozen; the server

1. averages the built matrices ``Lambda_bar = sum_i w_i m_i G(theta_i)``
   (:func:`mean_lambda_d_rot`; not the angles, ``G`` is nonlinear in
   ``theta``): with ``b`` shared, ``S Gamma(b) B Lambda_bar A`` is exactly the
   weighted mean of the client updates;
2. takes its rank-``r`` truncated SVD ``U_r Sigma_r V_r^T`` in factored form,
   left ``S Gamma(b) B`` (:func:`sorf_left`, by FWHT) and right
   ``Lambda_bar A``: no ``d_out x d_in`` matrix;
3. refits ``d`` (:func:`~fedlr.linalg.sorf.fit_d` on the polar factor of
   ``V_r^T pinv(A)``) and ``b`` (:func:`~fedlr.linalg.sorf.fit_b`, the
   minimum-norm least squares on ``||S Gamma(b) B - U_r Sigma_r||_F`` by
   FWHT: closed form when ``d_out`` is a power of two, CGLS otherwise). The
   signs of the singular pairs are chosen so that the polar factor is a
   rotation (``det = +1``), which ``G(theta)`` can represent.

Singular pairs are defined up to sign, and the refit is not sign-invariant;
:mod:`fedlr.linalg.sorf_pair_signs` chooses the pattern with the smallest refit
gap (``sign_search="gap"``) or keeps the fixed rule of
:func:`~fedlr.linalg.svd.fix_signs` (``"peak"``).

:func:`refit_layer` does steps 2-3 for one layer. It takes the layer's SORF
signs from the caller and computes the polar factor once: flipping pairs by
``D`` negates rows of ``V_r^T pinv(A)`` and the same rows of its polar factor
(as :meth:`~fedlr.linalg.sorf.PolarFactor.negate_last_row` does for the
last), with the same singular values. Cost per layer: ``O((d_out + d_in) r^2)`` for the
factored SVD and the polar factor, and ``O(k r n log n)`` for ``b`` (``k``
CGLS iterations, about 30 at ``r = 16``; ``n`` the padded ``d_out``); no
``d_out x d_out`` or ``d_out x d_in`` matrix. The sign search adds
``O((1 + 2 k') r^2 n log n + r^4 d_out)`` for the model (``k'`` CG
iterations, 0 when ``d_out`` is a power of two) and ``O(r^4)`` per pattern
evaluated.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fedlr.errors import ShapeMismatchError
from fedlr.linalg.lowrank import factored_frobenius_norm, normalise_weights
from fedlr.linalg.sorf import (
    BFit,
    PolarFactor,
    SorfSigns,
    build_lambda_d_rot,
    fit_b,
    fit_d,
    gamma_apply,
    polar_factor,
    polar_target,
    sorf_apply,
)
from fedlr.linalg.sorf_pair_signs import (
    SIGN_RULES,
    SignChoice,
    SignSearch,
    choose_pair_signs,
)
from fedlr.linalg.svd import TruncatedSVD, factored_svd

__all__ = ["LayerRefit", "mean_lambda_d_rot", "refit_layer", "sorf_left"]

F64 = torch.float64

BSolver = Callable[[SorfSigns, torch.Tensor, torch.Tensor], BFit]


@dataclass(frozen=True)
class LayerRefit:
    """New ``b``, ``d`` of one layer and the refit's errors.

    Attributes
    ----------
    b_real, b_imag : (d_out/2,) torch.Tensor
    d_scale : (1,) torch.Tensor
    d_angles : (r (r-1)/2,) torch.Tensor
    b_residual, d_residual : float
        Relative residuals of :func:`~fedlr.linalg.sorf.fit_b` and
        :func:`~fedlr.linalg.sorf.fit_d`.
    gap, target_norm : float
        ``||Delta W_new - Delta W||_F`` and ``||Delta W||_F``.
    pair_signs : (r,) torch.Tensor or None
        ``eps``, float64 entries ``+-1``: the refit used ``U_r diag(eps)`` and
        ``diag(eps) V_r^T``, with ``U_r, V_r`` as
        :func:`~fedlr.linalg.svd.factored_svd` returns them (signs of
        :func:`~fedlr.linalg.svd.fix_signs`); ``None`` for a zero update.
    sign_choice : SignChoice or None
        The search's record when ``sign_search="gap"`` chose ``eps``.
    """

    b_real: torch.Tensor
    b_imag: torch.Tensor
    d_scale: torch.Tensor
    d_angles: torch.Tensor
    b_residual: float
    d_residual: float
    gap: float
    target_norm: float
    pair_signs: torch.Tensor | None = None
    sign_choice: SignChoice | None = None

    @classmethod
    def unchanged(
        cls, b_real: torch.Tensor, b_imag: torch.Tensor, r: int, target_norm: float
    ) -> LayerRefit:
        """A zero update's refit: ``b`` kept, ``m = 0``, the gap the target's norm."""
        dtype = b_real.dtype
        return cls(
            b_real=b_real.clone(),
            b_imag=b_imag.clone(),
            d_scale=torch.zeros(1, dtype=dtype),
            d_angles=torch.zeros(r * (r - 1) // 2, dtype=dtype),
            b_residual=0.0,
            d_residual=0.0,
            gap=target_norm,
            target_norm=target_norm,
        )


def sorf_left(
    signs: SorfSigns,
    b_real: torch.Tensor,
    b_imag: torch.Tensor,
    b_matrix: torch.Tensor,
) -> torch.Tensor:
    """``S Gamma(b) B`` by FWHT, in float64.

    Parameters
    ----------
    signs : SorfSigns
        ``S`` of size ``d_out``.
    b_real, b_imag : (d_out/2,) torch.Tensor
        ``b``.
    b_matrix : (d_out, r) torch.Tensor
        The frozen ``B``.

    Returns
    -------
    (d_out, r) torch.Tensor, float64
    """
    cols = gamma_apply(b_real.to(F64), b_imag.to(F64), b_matrix.to(F64).T)
    return sorf_apply(signs.to(F64), cols).T


def mean_lambda_d_rot(
    scales: Sequence[torch.Tensor],
    angles: Sequence[torch.Tensor],
    weights: Sequence[float] | torch.Tensor,
    r: int,
) -> torch.Tensor:
    """``Lambda_bar = sum_i w_i m_i G(theta_i)``, the mean of the built matrices.

    Parameters
    ----------
    scales : k tensors of shape () or (1,)
        The clients' ``m_i``.
    angles : k tensors of shape (r (r-1)/2,)
        The clients' ``theta_i``.
    weights : (k,) sequence of float
        Normalised internally (e.g. num-examples).
    r : int

    Returns
    -------
    (r, r) torch.Tensor, float64
    """
    if len(scales) != len(angles) or not scales:
        raise ShapeMismatchError(
            f"{len(scales)} scales but {len(angles)} angle vectors (need k >= 1 each)"
        )
    w = normalise_weights(weights, len(scales))
    total = torch.zeros(r, r, dtype=F64, device=angles[0].device)
    for wi, scale, theta in zip(w.tolist(), scales, angles, strict=True):
        total += wi * build_lambda_d_rot(scale.to(F64), theta.to(F64), r)
    return total


def _check_refit(
    lambda_bar: torch.Tensor,
    a_matrix: torch.Tensor,
    b_matrix: torch.Tensor,
    signs: SorfSigns,
    sign_search: str,
    pair_signs: torch.Tensor | None,
) -> None:
    """Refuse :func:`refit_layer`'s arguments when they disagree."""
    r = int(a_matrix.shape[0])
    d_out = int(b_matrix.shape[0])
    if (
        a_matrix.ndim != 2
        or b_matrix.ndim != 2
        or b_matrix.shape[1] != r
        or lambda_bar.shape != (r, r)
        or signs.d != d_out
    ):
        raise ShapeMismatchError(
            f"SORF refit shapes disagree: Lambda_bar {tuple(lambda_bar.shape)}, A "
            f"{tuple(a_matrix.shape)}, B {tuple(b_matrix.shape)}, S of size "
            f"{signs.d}; expected (r, r), (r, d_in), (d_out, r), d_out"
        )
    if sign_search not in SIGN_RULES:
        raise ValueError(
            f"sign_search must be one of {SIGN_RULES}, got {sign_search!r}"
        )
    if pair_signs is not None and (
        pair_signs.shape != (r,) or not bool((pair_signs.abs() == 1).all())
    ):
        raise ValueError(
            f"pair_signs must be ({r},) entries +-1, got shape "
            f"{tuple(pair_signs.shape)}"
        )


def _pair_signs(
    svd: TruncatedSVD,
    polar: PolarFactor,
    a_matrix: torch.Tensor,
    b64: torch.Tensor,
    s64: SorfSigns,
    sign_search: str,
    search: SignSearch | None,
    pair_signs: torch.Tensor | None,
) -> tuple[torch.Tensor, SignChoice | None]:
    """The pairs' signs ``eps`` that make ``D O`` a rotation (the rule's
    choice, or ``pair_signs`` with its last pair flipped for a reflection),
    and the gap rule's :class:`SignChoice` (``None`` under the peak rule)."""
    choice: SignChoice | None = None
    if pair_signs is None:
        choice = choose_pair_signs(
            svd, polar, a_matrix, b64, s64, rule=sign_search, search=search
        )
        eps = choice.signs.to(svd.u.device)
        if sign_search == "peak":
            choice = None
    else:
        eps = pair_signs.to(device=svd.u.device, dtype=F64).clone()
        if float(eps.prod()) * float(torch.linalg.det(polar.o)) < 0:
            eps[-1] = -eps[-1]
    return eps, choice


def refit_layer(
    lambda_bar: torch.Tensor,
    b_real: torch.Tensor,
    b_imag: torch.Tensor,
    a_matrix: torch.Tensor,
    b_matrix: torch.Tensor,
    signs: SorfSigns,
    *,
    b_solver: BSolver = fit_b,
    sign_search: str = "peak",
    search: SignSearch | None = None,
    pair_signs: torch.Tensor | None = None,
) -> LayerRefit:
    """Truncated SVD of ``S Gamma(b) B Lambda_bar A`` and the refit of ``b``, ``d``.

    Parameters
    ----------
    lambda_bar : (r, r) torch.Tensor
        The averaged ``Lambda_d`` (:func:`mean_lambda_d_rot`).
    b_real, b_imag : (d_out/2,) torch.Tensor
        The current ``b``.
    a_matrix : (r, d_in) torch.Tensor
        The frozen ``A``, sliced to the layer's ``d_in``; ``r <= d_in``.
    b_matrix : (d_out, r) torch.Tensor
        The frozen ``B``, sliced to the layer's ``d_out``; ``r <= d_out``.
    signs : SorfSigns
        The layer's ``S`` (size ``d_out``).
    b_solver : callable, optional
        ``(signs, B, T) -> BFit``, the least-squares fit of ``b``;
        :func:`~fedlr.linalg.sorf.fit_b` unless a benchmark or test passes the
        dense reference.
    sign_search : {"peak", "gap"}
        How the signs of the singular pairs are chosen
        (:func:`choose_pair_signs`): ``"peak"`` (default here, the reference
        rule of the tests) or ``"gap"`` (the smallest modelled refit gap; the
        strategy's default).
    search : SignSearch, optional
        Settings of ``"gap"``.
    pair_signs : (r,) torch.Tensor, optional
        An explicit ``eps`` (entries ``+-1``, relative to the signs of
        :func:`~fedlr.linalg.svd.factored_svd`) instead of ``sign_search``;
        the last pair is flipped when ``eps`` would make the polar factor a
        reflection, as the peak rule does.

    Returns
    -------
    LayerRefit
        Tensors in ``b_real``'s dtype; computed in float64. A zero update keeps
        ``b`` and gives ``m = 0``.

    Raises
    ------
    ShapeMismatchError
        If the shapes disagree.
    ValueError
        For an unknown ``sign_search`` or ``pair_signs`` entries other than
        ``+-1``.
    """
    _check_refit(lambda_bar, a_matrix, b_matrix, signs, sign_search, pair_signs)
    r = int(a_matrix.shape[0])
    dtype = b_real.dtype
    s64 = signs.to(F64)
    b64 = b_matrix.to(F64)
    # 1. Truncated SVD of the averaged update in factored form.
    left = sorf_left(s64, b_real, b_imag, b64)
    right = lambda_bar.to(F64) @ a_matrix.to(F64)
    svd = factored_svd(left, right, rank=r)
    target_norm = math.sqrt(svd.total_energy)
    if svd.rank < r or float(svd.s[0]) == 0.0:
        return LayerRefit.unchanged(b_real, b_imag, r, target_norm)
    # 2. Polar factor of V_r^T pinv(A), once: flipping the pairs by
    #    D = diag(eps) gives the polar factor D O with the same singular
    #    values. eps makes D O a rotation (the peak rule flips the last pair
    #    of a reflection; the gap rule searches the admissible patterns).
    polar = polar_factor(polar_target(a_matrix, svd.vh))
    eps, choice = _pair_signs(
        svd, polar, a_matrix, b64, s64, sign_search, search, pair_signs
    )
    u, vh = svd.u * eps, svd.vh * eps[:, None]
    polar = PolarFactor(o=eps[:, None] * polar.o, singular_values=polar.singular_values)
    # 3. Refit d from the polar factor, b by least squares.
    d_fit = fit_d(a_matrix, vh, polar=polar)
    b_fit = b_solver(s64, b64, u * svd.s)
    # 4. Gap between the refit update and the target, from stacked factors.
    new_right = build_lambda_d_rot(d_fit.scale, d_fit.angles, r) @ a_matrix.to(F64)
    gap = factored_frobenius_norm(
        torch.cat([b_fit.fitted, -u * svd.s], 1), torch.cat([new_right, vh], 0)
    )
    return LayerRefit(
        b_real=b_fit.b_real.to(dtype),
        b_imag=b_fit.b_imag.to(dtype),
        d_scale=d_fit.scale.reshape(1).to(dtype),
        d_angles=d_fit.angles.to(dtype),
        b_residual=b_fit.residual,
        d_residual=d_fit.residual,
        gap=gap,
        target_norm=target_norm,
        pair_signs=eps,
        sign_choice=choice,
    )
