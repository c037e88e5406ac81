"""SORF-VeRA: the signs of the refit's singular pairs.

Singular pairs are defined up to sign, and the SORF-VeRA refit
(:func:`fedlr.linalg.sorf_refit.refit_layer`) is not sign-invariant:
flipping ``(u_j, v_j)`` leaves ``U_r Sigma_r V_r^T`` unchanged but changes
the least-squares ``b`` (one complex ``b_j`` per row pair is shared by all
``r`` columns of ``U_r Sigma_r``) and so the refit gap. With ``D = diag(eps)``,
``eps in {+-1}^r``, the polar factor of ``D V_r^T pinv(A)`` is ``D O`` with
the same singular values, so the new right factor is ``D W`` with the
sign-free ``W = m O A``; ``b`` is linear in the target ``U_r Sigma_r D``, so
its fitted product is ``sum_k eps_k F_k`` with ``F_k`` the projection of
``sigma_k u_k e_k^T`` onto the range of the fit. The refit gap is then a
quartic in ``eps`` (:class:`PairSignGap`):

    gap(eps)^2 = || sum_{k,l} eps_k eps_l F_k[:, l] w_l^T - U_r Sigma_r V_r^T ||_F^2,

a quadratic form in the ``r (r-1) / 2`` products ``eps_k eps_l`` (k < l),
whose coefficients come from the ``r`` projections (one batched
preconditioned CG, exact in closed form when ``d_out`` is a power of two)
and one ``r^2 x r^2`` Gram matrix. :func:`choose_pair_signs` minimises it over
the ``2^(r-1)`` patterns with ``det(D O) = +1``: all of them up to a rank
bound, by steepest descent over pair flips above it; ``sign_search="peak"``
keeps the fixed rule of :func:`~fedlr.linalg.svd.fix_signs`. Cost:
``O((1 + 2 k') r^2 n log n + r^4 d_out)`` for the model (``k'`` CG
iterations, 0 when ``d_out`` is a power of two) and ``O(r^4)`` per pattern
evaluated.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from fedlr.errors import ShapeMismatchError
from fedlr.linalg.sorf import (
    PolarFactor,
    SorfSigns,
    sorf_apply,
    sorf_apply_t,
)
from fedlr.linalg.svd import TruncatedSVD

__all__ = [
    "SIGN_RULES",
    "PairSignGap",
    "SignChoice",
    "SignSearch",
    "admissible_patterns",
    "choose_pair_signs",
    "pair_sign_gap",
]

F64 = torch.float64


SIGN_RULES = ("peak", "gap")


@dataclass(frozen=True)
class SignSearch:
    """Settings of the search of :func:`choose_pair_signs` (``rule="gap"``).

    Attributes
    ----------
    exhaustive_rank : int
        Evaluate all ``2^(r-1)`` admissible patterns when ``r`` is at most
        this (``2^(r-1) (r(r-1)/2)^2`` multiply-adds: 9e6 at ``r = 12``);
        steepest descent over pair flips above it.
    starts : int
        Starts of the descent: today's pattern (the ``"peak"`` rule) and
        ``starts - 1`` random admissible patterns drawn from ``seed``.
    seed : int
        Seed of the random starts (a fresh generator per call: deterministic).
    rtol : float
        The ``r`` projections ``F_k`` are solved by Jacobi-preconditioned CG
        until every relative residual is at most ``rtol`` (no iteration when
        ``d_out`` is a power of two: the preconditioner is then exact).
    max_iter : int
        Cap on those CG iterations (``0``, the default: the Jacobi step only,
        exact when ``d_out`` is a power of two and a model otherwise; it
        costs one SORF transform of ``r^2`` vectors, each iteration two more).
    dtype : torch.dtype
        Precision of the projections and their Gram matrix (float32 by
        default: the model only ranks patterns, and the refit that follows
        is float64); :meth:`exact` for a float64 model solved to ``1e-10``.
    """

    exhaustive_rank: int = 12
    starts: int = 4
    seed: int = 0
    rtol: float = 1e-2
    max_iter: int = 0
    dtype: torch.dtype = torch.float32

    @classmethod
    def exact(cls, **overrides: Any) -> SignSearch:
        """Settings whose model is the refit gap to rounding: float64, CG to 1e-10."""
        settings: dict[str, Any] = {
            "rtol": 1e-10,
            "max_iter": 500,
            "dtype": torch.float64,
        }
        settings.update(overrides)
        return cls(**settings)

    def __post_init__(self) -> None:
        if not 1 <= self.exhaustive_rank <= 20:
            raise ValueError(
                f"exhaustive_rank must be in [1, 20] (2^(r-1) patterns), got "
                f"{self.exhaustive_rank}"
            )
        if self.starts < 1:
            raise ValueError(f"starts must be >= 1, got {self.starts}")
        if not (self.rtol > 0 and math.isfinite(self.rtol)):
            raise ValueError(f"rtol must be positive and finite, got {self.rtol}")
        if self.max_iter < 0:
            raise ValueError(f"max_iter must be >= 0, got {self.max_iter}")
        if self.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype must be float32 or float64, got {self.dtype}")


@dataclass(frozen=True)
class PairSignGap:
    """The refit gap as a function of the pair signs ``eps`` (a quartic).

    With ``y = (eps_k eps_l)_{k<l}`` (``p = r (r-1) / 2`` products, row-major
    order of :func:`torch.triu_indices`),
    ``gap(eps)^2 = y^T Q y + 2 c^T y + t``.

    Attributes
    ----------
    quad : (p, p) torch.Tensor, float64
        ``Q``.
    lin : (p,) torch.Tensor, float64
        ``c``.
    const : float
        ``t``.
    parity : float
        ``det`` of the polar factor at ``eps = 1``: the admissible patterns
        (``det(D O) = +1``, a rotation) have ``prod(eps) = parity``.
    target_norm : float
        ``||U_r Sigma_r V_r^T||_F``.
    iterations : int
        CG iterations of the projections (0: closed form or Jacobi only).
    exact : bool
        Whether the model is the refit gap to float64 rounding: computed in
        float64 and the projections met ``rtol`` (always when ``d_out`` is a
        power of two); otherwise a model that ranks the patterns.
    """

    quad: torch.Tensor
    lin: torch.Tensor
    const: float
    parity: float
    target_norm: float
    iterations: int
    exact: bool

    @property
    def rank(self) -> int:
        """``r``."""
        p = int(self.lin.numel())
        return (1 + math.isqrt(1 + 8 * p)) // 2

    def squared(self, eps: torch.Tensor) -> torch.Tensor:
        """``gap^2`` of each row of ``eps`` ((P, r), entries ``+-1``): (P,).

        Not clamped: rounding can give a tiny negative value at a zero gap.
        """
        r = self.rank
        if eps.ndim != 2 or eps.shape[1] != r:
            raise ShapeMismatchError(
                f"expected sign patterns of shape (P, {r}), got {tuple(eps.shape)}"
            )
        first, second = torch.triu_indices(r, r, 1, device=self.quad.device)
        e = eps.to(device=self.quad.device, dtype=F64)
        y = e[:, first] * e[:, second]
        return ((y @ self.quad) * y).sum(1) + 2.0 * (y @ self.lin) + self.const

    def gap(self, eps: torch.Tensor) -> torch.Tensor:
        """``||Delta W_new(eps) - Delta W||_F`` for each row of ``eps``: (P,)."""
        return self.squared(eps).clamp_min(0.0).sqrt()


@dataclass(frozen=True)
class SignChoice:
    """Result of :func:`choose_pair_signs`.

    Attributes
    ----------
    signs : (r,) torch.Tensor, float64
        The chosen admissible ``eps``.
    gap, peak_gap : float
        Modelled gaps of ``eps`` and of the ``"peak"`` pattern (equal under
        ``rule="peak"``, where no model is built: then both are ``nan``).
    patterns : int
        Patterns evaluated.
    exhaustive : bool
        Whether every admissible pattern was evaluated.
    model : PairSignGap or None
    """

    signs: torch.Tensor
    gap: float
    peak_gap: float
    patterns: int
    exhaustive: bool
    model: PairSignGap | None = field(default=None, repr=False)


def _design_apply(
    signs: SorfSigns, b_even: torch.Tensor, b_odd: torch.Tensor, x: torch.Tensor
) -> torch.Tensor:
    """``J x_k = S Gamma(x_k) B`` for a batch: x (k, d) -> (k, r, d) rows.

    Row ``l`` of entry ``k`` is column ``l`` of ``S Gamma(a_k + i c_k) B``
    with ``x_k = (a_k, c_k)``; ``b_even, b_odd`` (r, d/2) are the even and odd
    rows of ``B`` transposed.
    """
    m = x.shape[-1] // 2
    a, c = x[:, None, :m], x[:, None, m:]
    w_even = a * b_even - c * b_odd
    w_odd = c * b_even + a * b_odd
    return sorf_apply(signs, torch.stack((w_even, w_odd), -1).flatten(-2))


def _design_apply_t(
    signs: SorfSigns, b_even: torch.Tensor, b_odd: torch.Tensor, z: torch.Tensor
) -> torch.Tensor:
    """``J^T z_k`` for a batch: z (k, r, d) rows -> (k, d) ``(a, c)``."""
    y = sorf_apply_t(signs, z)
    y_even, y_odd = y[..., 0::2], y[..., 1::2]
    a = (y_even * b_even + y_odd * b_odd).sum(-2)
    c = (y_odd * b_even - y_even * b_odd).sum(-2)
    return torch.cat([a, c], -1)


def _column_projections(
    signs: SorfSigns, b_matrix: torch.Tensor, columns: torch.Tensor, search: SignSearch
) -> tuple[torch.Tensor, int, bool]:
    """``F_k = J pinv(J) (t_k e_k^T)`` for each column ``t_k`` of ``columns``.

    ``J: (a, c) -> S Gamma(a + ic) B`` is the design of
    :func:`~fedlr.linalg.sorf.fit_b`; the ``r`` least-squares problems share
    ``J^T J = sum_l Gamma_l^T S^T S Gamma_l``, whose block diagonal is
    ``diag(rho^2, rho^2)`` (:meth:`~fedlr.linalg.sorf._BDesign.pair_energy`).

    1. ``h_k = J^T (t_k e_k^T)``: one SORF transform of the ``r`` columns.
    2. Jacobi step ``x_k = h_k / rho^2``: the solution when ``S`` is
       orthogonal (``d`` a power of two).
    3. Otherwise CG on ``J^T J x_k = h_k`` preconditioned by
       ``diag(rho^2)``, all ``k`` at once (each iteration: ``J`` and ``J^T``
       on ``r^2`` vectors), until ``||h_k - J^T J x_k|| <= rtol ||h_k||``
       for every ``k`` or ``max_iter``. The fitted products ``J x_k`` are
       unique also when ``J`` is rank deficient (``h_k`` lies in the range of
       ``J^T J``); ``J x_k`` is accumulated from the ``J p`` of the
       iterations, no extra transform.

    Parameters
    ----------
    signs : SorfSigns
        Size ``d``, in ``columns``' dtype.
    b_matrix : (d, r) torch.Tensor
    columns : (d, r) torch.Tensor
        ``U_r Sigma_r``; float32 or float64, the dtype of the computation.

    Returns
    -------
    projections : (r, r, d) torch.Tensor
        ``[k, l] = F_k[:, l]``.
    iterations : int
    converged : bool
    """
    bt = b_matrix.T
    b_even, b_odd = bt[:, 0::2].contiguous(), bt[:, 1::2].contiguous()
    # 1. h_k = J^T (t_k e_k^T): only row k of the k-th target is nonzero.
    y = sorf_apply_t(signs, columns.T)  # (r, d): S^T t_k
    y_even, y_odd = y[:, 0::2], y[:, 1::2]
    h = torch.cat([y_even * b_even + y_odd * b_odd, y_odd * b_even - y_even * b_odd], 1)
    # 2. Jacobi step.
    rho_sq = (b_even.square() + b_odd.square()).sum(0)
    cutoff = float(rho_sq.max()) * signs.d * torch.finfo(columns.dtype).eps
    inv = torch.where(rho_sq > cutoff, 1.0 / rho_sq.clamp_min(cutoff), 0.0)
    inv = torch.cat([inv, inv])
    x = h * inv
    fitted = _design_apply(signs, b_even, b_odd, x)
    if signs.d == signs.n:
        return fitted, 0, True
    if search.max_iter == 0:
        return fitted, 0, False
    # 3. Batched preconditioned CG.
    h_norm = torch.linalg.vector_norm(h, dim=1)
    live = h_norm > 0

    def met(resid: torch.Tensor) -> bool:
        ratio = torch.linalg.vector_norm(resid[live], dim=1) / h_norm[live]
        return bool((ratio <= search.rtol).all())

    tiny = torch.finfo(columns.dtype).tiny
    resid = h - _design_apply_t(signs, b_even, b_odd, fitted)
    z = resid * inv
    direction = z.clone()
    rz = (resid * z).sum(1)
    iterations = 0
    while iterations < search.max_iter and not met(resid):
        iterations += 1
        jp = _design_apply(signs, b_even, b_odd, direction)
        q = _design_apply_t(signs, b_even, b_odd, jp)
        pq = (direction * q).sum(1)
        alpha = torch.where(pq > 0, rz / pq.clamp_min(tiny), 0.0)
        fitted = fitted + alpha[:, None, None] * jp
        resid = resid - alpha[:, None] * q
        z = resid * inv
        rz_new = (resid * z).sum(1)
        beta = torch.where(rz > 0, rz_new / rz.clamp_min(tiny), 0.0)
        direction = z + beta[:, None] * direction
        rz = rz_new
    converged = met(resid)
    return fitted, iterations, converged


def pair_sign_gap(
    svd: TruncatedSVD,
    polar: PolarFactor,
    a_matrix: torch.Tensor,
    b_matrix: torch.Tensor,
    signs: SorfSigns,
    *,
    search: SignSearch | None = None,
) -> PairSignGap:
    """The refit gap of :func:`refit_layer` as a quartic in the pair signs.

    With ``D = diag(eps)`` the refit uses ``U_r D`` and ``D V_r^T``; for an
    admissible ``eps`` (``det(D O) = +1``) the new right factor is
    ``m D O A = D W`` and the fitted left factor ``sum_k eps_k F_k``
    (:func:`_column_projections`), so

        Delta W_new = sum_{k,l} eps_k eps_l F_k[:, l] w_l^T,

    and ``||Delta W_new - U_r Sigma_r V_r^T||_F^2`` expands into

    1. ``sum z_{kl} z_{k'l'} <F_k[:, l], F_k'[:, l']> <w_l, w_l'>`` with
       ``z = vec(eps eps^T)``: one ``r^2 x r^2`` Gram matrix of the
       projections (``O(r^4 d_out)``);
    2. ``-2 sum z_{kl} (U_r^T F_k[:, l]) . (Sigma_r V_r^T w_l)``;
    3. ``+ sum sigma_j^2``;

    folded onto the ``r (r-1) / 2`` products ``eps_k eps_l`` (``k < l``;
    ``z_{kk} = 1``).

    Parameters
    ----------
    svd : TruncatedSVD
        Rank-``r`` SVD of the averaged update (float64), signs as
        :func:`~fedlr.linalg.svd.factored_svd` returns them (``eps = 1``).
    polar : PolarFactor
        ``polar_factor(polar_target(a_matrix, svd.vh))`` (float64).
    a_matrix : (r, d_in) torch.Tensor
    b_matrix : (d_out, r) torch.Tensor
    signs : SorfSigns
        The layer's ``S``.
    search : SignSearch, optional
        ``rtol`` and ``max_iter`` of the projections.

    Returns
    -------
    PairSignGap
    """
    search = SignSearch() if search is None else search
    r = int(svd.s.numel())
    if svd.u.shape[1] != r or svd.vh.shape != a_matrix.shape or polar.o.shape != (r, r):
        raise ShapeMismatchError(
            f"sign model shapes disagree: U {tuple(svd.u.shape)}, V^T "
            f"{tuple(svd.vh.shape)}, A {tuple(a_matrix.shape)}, polar factor "
            f"{tuple(polar.o.shape)}"
        )
    dt = search.dtype
    u, s, vh = svd.u.to(F64), svd.s.to(F64), svd.vh.to(F64)
    w = polar.singular_values.to(F64).mean() * (polar.o.to(F64) @ a_matrix.to(F64))
    proj, iterations, converged = _column_projections(
        signs.to(dt, u.device),
        b_matrix.to(device=u.device, dtype=dt),
        (u * s).to(dt),
        search,
    )
    # 1-3 on the full z = vec(eps eps^T), index k * r + l.
    flat = proj.reshape(r * r, -1)
    col = torch.arange(r, device=u.device).repeat(r)  # l of index k * r + l
    gram_w = w @ w.T
    psi = (flat @ flat.T).to(F64) * gram_w[col][:, col]
    q = s[:, None] * (vh @ w.T)  # (i, l): sigma_i v_i . w_l
    cross = torch.einsum("kli,il->kl", (proj @ u.to(dt)).to(F64), q).reshape(-1)
    const = float(s.square().sum())
    # Fold z = P y + vec(I): y_(k<l) sits at (k, l) and (l, k).
    first, second = torch.triu_indices(r, r, 1, device=u.device)
    fold = torch.zeros(r * r, first.numel(), dtype=F64, device=u.device)
    idx = torch.arange(first.numel(), device=u.device)
    fold[first * r + second, idx] = 1.0
    fold[second * r + first, idx] = 1.0
    diag = torch.zeros(r * r, dtype=F64, device=u.device)
    diag[torch.arange(r, device=u.device) * (r + 1)] = 1.0
    psi_fold = psi @ fold
    return PairSignGap(
        quad=fold.T @ psi_fold,
        lin=diag @ psi_fold - fold.T @ cross,
        const=float(diag @ psi @ diag) - 2.0 * float(cross @ diag) + const,
        parity=1.0 if float(torch.linalg.det(polar.o)) >= 0 else -1.0,
        target_norm=math.sqrt(const),
        iterations=iterations,
        exact=converged and dt == F64,
    )


def admissible_patterns(r: int, parity: float) -> torch.Tensor:
    """All ``2^(r-1)`` sign patterns with ``prod(eps) = parity``, (2^(r-1), r).

    Row 0 is the ``"peak"`` pattern ``(1, ..., 1, parity)``; ``eps`` and
    ``-eps`` are both listed when ``r`` is even (the gap is even in ``eps``).
    """
    free = torch.tensor(
        list(itertools.product((1.0, -1.0), repeat=r - 1)), dtype=F64
    ).reshape(2 ** (r - 1), r - 1)
    last = parity * free.prod(1, keepdim=True)
    return torch.cat([free, last], 1)


def _peak_pattern(r: int, parity: float) -> torch.Tensor:
    eps = torch.ones(r, dtype=F64)
    eps[-1] = parity
    return eps


def _descend(
    model: PairSignGap,
    start: torch.Tensor,
    moves: torch.Tensor,
    flips: torch.Tensor,
    tol: float,
) -> tuple[torch.Tensor, float, int]:
    """Steepest descent over pair flips from ``start``: (eps, gap^2, evaluated).

    Works on the products ``y = (eps_k eps_l)_{k<l}``: move ``m`` (``moves[m]``
    on ``eps``) multiplies ``y`` by ``flips[m]``, so each step is one
    ``(moves, p) x (p, p)`` product.
    """
    eps = start.to(model.quad.device)
    first, second = torch.triu_indices(eps.numel(), eps.numel(), 1, device=eps.device)
    y = eps[first] * eps[second]
    value = float(model.squared(eps[None])[0])
    evaluated = 1
    for _ in range(4 * eps.numel() ** 2):  # a safety cap; each step decreases
        ys = flips * y
        values = ((ys @ model.quad) * ys).sum(1) + 2.0 * (ys @ model.lin)
        values = values + model.const
        evaluated += ys.shape[0]
        best = int(values.argmin())
        if float(values[best]) >= value - tol:
            break
        eps, y, value = moves[best] * eps, ys[best], float(values[best])
    return eps, value, evaluated


def _greedy(
    model: PairSignGap, peak: torch.Tensor, search: SignSearch, tol: float
) -> tuple[torch.Tensor, float, int]:
    """Best end point of the descents from the peak and the seeded starts."""
    r = peak.numel()
    parity = float(peak.prod())
    device = model.quad.device
    first, second = torch.triu_indices(r, r, 1, device=device)
    moves = torch.ones(first.numel(), r, dtype=F64, device=device)
    rows = torch.arange(first.numel(), device=device)
    moves[rows, first] = -1.0
    moves[rows, second] = -1.0
    flips = moves[:, first] * moves[:, second]  # (moves, p): the sign of each y
    gen = torch.Generator().manual_seed(int(search.seed))
    starts = [peak]
    for _ in range(search.starts - 1):
        eps = (torch.randint(0, 2, (r,), generator=gen) * 2 - 1).to(F64)
        eps[-1] = parity * float(eps[:-1].prod())
        starts.append(eps)
    best, best_value, evaluated = peak, math.inf, 0
    for start in starts:
        end, value, n = _descend(model, start, moves, flips, tol)
        evaluated += n
        if value < best_value:
            best, best_value = end.cpu(), value
    return best, best_value, evaluated


def choose_pair_signs(
    svd: TruncatedSVD,
    polar: PolarFactor,
    a_matrix: torch.Tensor,
    b_matrix: torch.Tensor,
    signs: SorfSigns,
    *,
    rule: str = "gap",
    search: SignSearch | None = None,
) -> SignChoice:
    """Signs ``eps`` of the singular pairs for :func:`refit_layer`.

    ``rule="peak"``: today's rule, ``eps = (1, ..., 1, det O)`` (the pairs of
    :func:`~fedlr.linalg.svd.fix_signs`, the last one flipped when the polar
    factor is a reflection). ``rule="gap"``: the admissible ``eps`` with the
    smallest modelled refit gap (:func:`pair_sign_gap`):

    1. ``r <= search.exhaustive_rank``: all ``2^(r-1)`` admissible patterns
       (:func:`admissible_patterns`);
    2. otherwise steepest descent: from each start (the peak pattern, then
       ``starts - 1`` random admissible ones from ``seed``), flip the pair of
       pairs ``(k, k')`` (flipping two keeps ``det(D O) = +1``) that lowers the
       gap most, while it does; keep the best end point.

    A pattern replaces the peak one only when its modelled ``gap^2`` is lower
    by more than ``64 eps ||Delta W||_F^2`` (rounding of the quartic), so the
    result is never worse than the peak rule on the model, and ties keep
    today's signs.

    Parameters
    ----------
    svd, polar, a_matrix, b_matrix, signs
        See :func:`pair_sign_gap`.
    rule : {"gap", "peak"}
    search : SignSearch, optional

    Returns
    -------
    SignChoice

    Raises
    ------
    ValueError
        For an unknown ``rule``.
    """
    if rule not in SIGN_RULES:
        raise ValueError(f"sign rule must be one of {SIGN_RULES}, got {rule!r}")
    r = int(svd.s.numel())
    parity = 1.0 if float(torch.linalg.det(polar.o)) >= 0 else -1.0
    peak = _peak_pattern(r, parity)
    if rule == "peak" or r == 1:
        nan = float("nan")
        return SignChoice(
            signs=peak, gap=nan, peak_gap=nan, patterns=0, exhaustive=True
        )
    search = SignSearch() if search is None else search
    model = pair_sign_gap(svd, polar, a_matrix, b_matrix, signs, search=search)
    tol = 64 * torch.finfo(search.dtype).eps * model.target_norm**2
    peak_sq = float(model.squared(peak[None])[0])
    exhaustive = r <= search.exhaustive_rank
    if exhaustive:
        patterns = admissible_patterns(r, parity)
        values = model.squared(patterns)
        best = int(values.argmin())
        eps, value, evaluated = patterns[best], float(values[best]), len(patterns)
    else:
        eps, value, evaluated = _greedy(model, peak, search, tol)
    if value >= peak_sq - tol:
        eps, value = peak, peak_sq
    return SignChoice(
        signs=eps.clone(),
        gap=math.sqrt(max(value, 0.0)),
        peak_gap=math.sqrt(max(peak_sq, 0.0)),
        patterns=evaluated,
        exhaustive=exhaustive,
        model=model,
    )
