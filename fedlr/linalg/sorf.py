"""SORF-VeRA kernels: Walsh-Hadamard transforms, complex 2x2 blocks, Givens.

SORF-VeRA writes a layer's update as

    Delta_W = S Gamma(b) B Lambda_d A,

with frozen random ``A`` (r, d_in) and ``B`` (d_out, r) shared by every client,

* ``S = (D1 H D2 H D3)[:d, :d]``: structured orthogonal random features, ``H``
  the normalised Walsh-Hadamard matrix of size ``n`` (the next power of two
  ``>= d = d_out``) and ``D1, D2, D3`` diagonal sign matrices from a shared
  seed. ``S`` is applied with a fast Walsh-Hadamard transform (zero padding to
  ``n``, truncation back to ``d``), ``O(n log n)`` per vector (Hadamard blocks
  of at most 64 applied as small GEMMs); no ``n x n``
  matrix is formed.
* ``Gamma(b) = blkdiag(Phi(b_1), ..., Phi(b_{d/2}))`` with
  ``Phi(a + ic) = [[a, -c], [c, a]]``: a complex number as a 2x2
  rotation-scaling block, applied by even/odd slicing.
* ``Lambda_d = m G(theta)``: a scale times a product of ``r (r-1) / 2`` Givens
  rotations of adjacent planes in the stage order of :func:`givens_plan`
  (a complete parametrisation of the rotations; ``2r - 3`` batched stages).

The server refits ``b`` and ``(m, theta)`` from the truncated SVD of the
aggregated update: :func:`fit_b` solves the least-squares problem
``min_b ||S Gamma(b) B - T||_F`` for its minimum-norm solution (the truncated
``S`` is singular for most ``d`` that are not powers of two) with ``S``
applied by FWHT: in closed form when ``d`` is a power of two, by conjugate
gradients (CGLS) otherwise, no ``d x d`` matrix; :func:`fit_d` takes the polar
factor of ``V_r^T pinv(A)`` and decomposes it into Givens angles.

Every function acts on the last dimension of its input as on column vectors:
``sorf_apply(signs, v)`` returns ``S v`` for each row ``v`` of a batch.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from fedlr.errors import ShapeMismatchError

__all__ = [
    "BFit",
    "DFit",
    "GivensPlan",
    "PolarFactor",
    "SorfSigns",
    "build_lambda_d_rot",
    "decompose_orthogonal",
    "fit_b",
    "fit_d",
    "fwht",
    "gamma_apply",
    "gamma_apply_t",
    "givens_pair_indices",
    "givens_plan",
    "next_power_of_two",
    "polar_factor",
    "polar_target",
    "sorf_apply",
    "sorf_apply_t",
    "sorf_signs",
]


def next_power_of_two(d: int) -> int:
    """Smallest power of two ``n >= d`` (``d >= 1``)."""
    if d < 1:
        raise ValueError(f"dimension must be >= 1, got {d}")
    return 1 << (d - 1).bit_length()


_MAX_BLOCK_BITS = 5  # Hadamard blocks of at most 32 applied as small GEMMs
_HADAMARD_BLOCKS: dict[tuple[int, torch.dtype, str], torch.Tensor] = {}


def _hadamard_block(m: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Unnormalised Sylvester Hadamard matrix of size ``m`` (cached)."""
    key = (m, dtype, str(device))
    if key not in _HADAMARD_BLOCKS:
        h = torch.ones(1, 1, dtype=dtype, device=device)
        while h.shape[0] < m:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        _HADAMARD_BLOCKS[key] = h
    return _HADAMARD_BLOCKS[key]


def _block_sizes(n: int) -> list[int]:
    """``n = m_1 m_2 ... m_q``: as few and as even blocks of at most 32 as can be.

    Smaller blocks come first (outermost), so that the first GEMM, on the
    innermost axis, has the widest inner dimension.
    """
    k = n.bit_length() - 1
    q = max(1, -(-k // _MAX_BLOCK_BITS))
    base, extra = divmod(k, q)
    return [1 << (base + (1 if i >= q - extra else 0)) for i in range(q)]


def _fwht_rows(y: torch.Tensor) -> torch.Tensor:
    """Unnormalised transform of each row of ``y`` (rows, n).

    ``H_n = H_{m_1} (x) ... (x) H_{m_q}``: with the row reshaped to a
    ``(m_1, ..., m_q)`` array, ``H_n y`` applies ``H_{m_i}`` along axis ``i``.
    The innermost axis is one GEMM from the right; every other axis is a
    batched ``H_m @ Z`` with ``Z`` viewed as ``(-1, m, after)``: no transposed
    copies. ``O(n log n)`` work.
    """
    rows, n = y.shape
    sizes = _block_sizes(n)
    last = sizes[-1]
    z = y.reshape(-1, last) @ _hadamard_block(last, y.dtype, y.device)
    after = last
    for m in reversed(sizes[:-1]):
        z = _hadamard_block(m, y.dtype, y.device) @ z.reshape(-1, m, after)
        after *= m
    return z.reshape(rows, n)


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Normalised fast Walsh-Hadamard transform along the last dimension.

    Parameters
    ----------
    x : (..., n) torch.Tensor
        ``n`` a power of two.

    Returns
    -------
    (..., n) torch.Tensor
        ``H x`` with ``H`` the Sylvester-ordered Hadamard matrix divided by
        ``sqrt(n)`` (symmetric and orthogonal, ``H H^T = I``). The transform
        uses the Kronecker structure ``H_n = H_{m_1} (x) ... (x) H_{m_q}`` with
        blocks of at most 32: ``O(n log n)`` work per vector in a few small GEMMs,
        never an ``n x n`` matrix; differentiable.
    """
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ShapeMismatchError(f"FWHT needs a power-of-two length, got {n}")
    batch = x.shape[:-1]
    y = _fwht_rows(x.reshape(-1, n))
    return y.reshape(*batch, n) / math.sqrt(n)


@dataclass(frozen=True)
class SorfSigns:
    """The diagonal sign vectors of ``S = (D1 H D2 H D3)[:d, :d]``.

    Attributes
    ----------
    d1, d2, d3 : (n,) torch.Tensor
        Entries in ``{-1, +1}``.
    d : int
        The truncated size (``d_out``).
    """

    d1: torch.Tensor
    d2: torch.Tensor
    d3: torch.Tensor
    d: int

    @property
    def n(self) -> int:
        """Padded size (a power of two)."""
        return int(self.d1.numel())

    def to(self, dtype: torch.dtype, device: torch.device | None = None) -> SorfSigns:
        """The same signs in ``dtype`` on ``device``."""
        return SorfSigns(
            d1=self.d1.to(device=device, dtype=dtype),
            d2=self.d2.to(device=device, dtype=dtype),
            d3=self.d3.to(device=device, dtype=dtype),
            d=self.d,
        )

    def dense(self) -> torch.Tensor:
        """``S`` as a dense (d, d) matrix, for tests and references only."""
        eye = torch.eye(self.d, dtype=self.d1.dtype, device=self.d1.device)
        return sorf_apply(self, eye).T


def sorf_signs(d: int, seed: int, *, dtype: torch.dtype = torch.float32) -> SorfSigns:
    """Draw the three sign vectors of ``S`` from ``seed`` (same on every node).

    Parameters
    ----------
    d : int
        Output size ``d_out``; ``n = next_power_of_two(d)``.
    seed : int
    dtype : torch.dtype

    Returns
    -------
    SorfSigns
    """
    n = next_power_of_two(d)
    gen = torch.Generator().manual_seed(int(seed))
    signs = [
        (torch.randint(0, 2, (n,), generator=gen) * 2 - 1).to(dtype) for _ in range(3)
    ]
    return SorfSigns(d1=signs[0], d2=signs[1], d3=signs[2], d=d)


def _check_last(x: torch.Tensor, d: int, what: str) -> None:
    if x.shape[-1] != d:
        raise ShapeMismatchError(
            f"{what} expects last dimension {d}, got shape {tuple(x.shape)}"
        )


def _pad(x: torch.Tensor, n: int) -> torch.Tensor:
    d = x.shape[-1]
    return x if d == n else torch.nn.functional.pad(x, (0, n - d))


def _sign_hadamard_chain(
    x: torch.Tensor,
    first: torch.Tensor,
    middle: torch.Tensor,
    last: torch.Tensor,
    d: int,
) -> torch.Tensor:
    """``(D_last H D_middle H D_first)[:d, :d] x`` along the last dimension.

    Both normalisations ``1/sqrt(n)`` are folded into one scaling of
    ``D_last``: one pass over the data fewer per transform.
    """
    n = first.numel()
    batch = x.shape[:-1]
    y = (_pad(x, n) * first).reshape(-1, n)
    y = _fwht_rows(_fwht_rows(y) * middle) * (last / n)
    return y.reshape(*batch, n)[..., :d]


def sorf_apply(signs: SorfSigns, x: torch.Tensor) -> torch.Tensor:
    """``S x`` along the last dimension, ``S = (D1 H D2 H D3)[:d, :d]``.

    Parameters
    ----------
    signs : SorfSigns
    x : (..., d) torch.Tensor

    Returns
    -------
    (..., d) torch.Tensor
        Zero-pad to ``n``, ``D3``, FWHT, ``D2``, FWHT, ``D1``, keep the first
        ``d`` entries.
    """
    _check_last(x, signs.d, "sorf_apply")
    s = signs.to(x.dtype, x.device)
    return _sign_hadamard_chain(x, s.d3, s.d2, s.d1, s.d)


def sorf_apply_t(signs: SorfSigns, x: torch.Tensor) -> torch.Tensor:
    """``S^T x`` along the last dimension (``S^T = (D3 H D2 H D1)[:d, :d]``).

    Parameters
    ----------
    signs : SorfSigns
    x : (..., d) torch.Tensor

    Returns
    -------
    (..., d) torch.Tensor
    """
    _check_last(x, signs.d, "sorf_apply_t")
    s = signs.to(x.dtype, x.device)
    return _sign_hadamard_chain(x, s.d1, s.d2, s.d3, s.d)


def _check_gamma(b_real: torch.Tensor, b_imag: torch.Tensor, x: torch.Tensor) -> None:
    if b_real.ndim != 1 or b_real.shape != b_imag.shape:
        raise ShapeMismatchError(
            f"b_real {tuple(b_real.shape)} and b_imag {tuple(b_imag.shape)} must be "
            "equal 1-D shapes"
        )
    _check_last(x, 2 * b_real.numel(), "Gamma(b)")


def gamma_apply(
    b_real: torch.Tensor, b_imag: torch.Tensor, x: torch.Tensor
) -> torch.Tensor:
    """``Gamma(b) x`` along the last dimension by even/odd slicing.

    Parameters
    ----------
    b_real, b_imag : (m,) torch.Tensor
        ``a_j`` and ``c_j`` of the complex entries ``b_j = a_j + i c_j``.
    x : (..., 2m) torch.Tensor

    Returns
    -------
    (..., 2m) torch.Tensor
        ``w_{2j} = a_j x_{2j} - c_j x_{2j+1}``,
        ``w_{2j+1} = c_j x_{2j} + a_j x_{2j+1}``.
    """
    _check_gamma(b_real, b_imag, x)
    even, odd = x[..., 0::2], x[..., 1::2]
    w_even = b_real * even - b_imag * odd
    w_odd = b_imag * even + b_real * odd
    return torch.stack((w_even, w_odd), dim=-1).flatten(-2)


def gamma_apply_t(
    b_real: torch.Tensor, b_imag: torch.Tensor, x: torch.Tensor
) -> torch.Tensor:
    """``Gamma(b)^T x`` along the last dimension (the conjugate blocks).

    Parameters
    ----------
    b_real, b_imag : (m,) torch.Tensor
    x : (..., 2m) torch.Tensor

    Returns
    -------
    (..., 2m) torch.Tensor
    """
    return gamma_apply(b_real, -b_imag, x)


@dataclass(frozen=True)
class GivensPlan:
    """The fixed sequence of planes of ``G(theta)`` for rank ``r``.

    Rotation ``k`` acts on the adjacent coordinates ``(p_k, q_k) = (i - 1, i)``
    and is the one that zeroes entry ``(i, col_k)`` in a Givens QR
    elimination; ``stage_k = (r - 1 - i) + 2 col_k`` (Sameh-Kuck order). The
    rotations of one stage act on disjoint planes, so they commute and are
    applied together: ``2r - 3`` stages instead of ``r (r-1) / 2`` sequential
    steps. Rotations are numbered stage by stage.

    Attributes
    ----------
    p, q, col, stage : (r (r-1) / 2,) torch.Tensor of int64
    stages : int
    """

    p: torch.Tensor
    q: torch.Tensor
    col: torch.Tensor
    stage: torch.Tensor
    stages: int


_GIVENS_PLANS: dict[int, GivensPlan] = {}


def givens_plan(r: int) -> GivensPlan:
    """The :class:`GivensPlan` of rank ``r`` (cached)."""
    if r < 1:
        raise ValueError(f"rank must be >= 1, got {r}")
    if r not in _GIVENS_PLANS:
        rotations = sorted(
            ((r - 1 - i) + 2 * j, j, i) for j in range(r - 1) for i in range(j + 1, r)
        )
        as_tensor = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        _GIVENS_PLANS[r] = GivensPlan(
            p=as_tensor([i - 1 for _, _, i in rotations]),
            q=as_tensor([i for _, _, i in rotations]),
            col=as_tensor([j for _, j, _ in rotations]),
            stage=as_tensor([t for t, _, _ in rotations]),
            stages=max(2 * r - 3, 0),
        )
    return _GIVENS_PLANS[r]


def givens_pair_indices(r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The planes ``(p_k, q_k)`` of the ``r (r-1) / 2`` rotations, in order.

    Adjacent pairs ``q_k = p_k + 1`` in Sameh-Kuck stage order (see
    :class:`GivensPlan`); the plane ``(i - 1, i)`` occurs ``i`` times.

    Returns
    -------
    p, q : (r (r-1) / 2,) torch.Tensor of int64
    """
    plan = givens_plan(r)
    return plan.p, plan.q


def build_lambda_d_rot(
    scale: torch.Tensor, angles: torch.Tensor, r: int
) -> torch.Tensor:
    """``Lambda_d = m G(theta)`` with ``G = R_1 R_2 ... R_N`` (Givens rotations).

    ``R_k`` rotates the plane ``(p, q)`` of rotation ``k`` of
    :func:`givens_plan` by ``theta_k``:
    ``R[p, p] = R[q, q] = cos``, ``R[p, q] = -sin``, ``R[q, p] = sin``.
    The rotations of a stage commute, so each stage is one (r, r) matrix,
    written by four scatters for all stages at once, and the ``2r - 3`` stage
    matrices are multiplied as a balanced tree of batched products: a few
    dozen tensor operations per call whatever ``r``, not ``r (r-1) / 2``
    sequential ones (this matters for autograd in every training step).

    Parameters
    ----------
    scale : () or (1,) torch.Tensor
        The uniform magnitude ``m``.
    angles : (r (r-1) / 2,) torch.Tensor
    r : int

    Returns
    -------
    (r, r) torch.Tensor
        Differentiable in ``scale`` and ``angles``.
    """
    n_pairs = r * (r - 1) // 2
    if angles.shape != (n_pairs,):
        raise ShapeMismatchError(
            f"rank {r} needs {n_pairs} Givens angles, got shape {tuple(angles.shape)}"
        )
    if scale.numel() != 1:
        raise ShapeMismatchError(f"scale must be a scalar, got {tuple(scale.shape)}")
    eye = torch.eye(r, dtype=angles.dtype, device=angles.device)
    if n_pairs == 0:
        return scale.reshape(()) * eye
    plan = givens_plan(r)
    t, p, q = (x.to(angles.device) for x in (plan.stage, plan.p, plan.q))
    cos, sin = torch.cos(angles), torch.sin(angles)
    # One identity per stage, its rotated 2x2 blocks written over it.
    stages = eye.expand(plan.stages, r, r)
    stages = stages.index_put((t, p, p), cos).index_put((t, q, q), cos)
    stages = stages.index_put((t, p, q), -sin).index_put((t, q, p), sin)
    while stages.shape[0] > 1:
        if stages.shape[0] % 2:
            stages = torch.cat([stages, eye[None]], 0)
        stages = stages[0::2] @ stages[1::2]  # keeps the order R_1 R_2 ...
    return scale.reshape(()) * stages[0]


def decompose_orthogonal(o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Givens angles and residual signs with ``O = G(theta) diag(signs)``.

    Givens QR elimination in the order of :func:`givens_plan`: rotation ``k``
    (``R_k^T`` on rows ``p, q = i - 1, i``) zeroes ``O[i, col_k]`` and leaves
    ``O[i - 1, col_k] >= 0``; a stage's rotations touch disjoint rows and are
    applied together. What remains is ``diag(1, ..., 1, det O)``.

    Parameters
    ----------
    o : (r, r) torch.Tensor
        Orthogonal (computed in float64).

    Returns
    -------
    angles : (r (r-1) / 2,) torch.Tensor
        In ``o``'s dtype.
    signs : (r,) torch.Tensor
        Entries ``+-1``; all ``+1`` except the last, which is ``det O``.
    """
    if o.ndim != 2 or o.shape[0] != o.shape[1]:
        raise ShapeMismatchError(f"expected a square matrix, got {tuple(o.shape)}")
    r = int(o.shape[0])
    m = o.detach().to(device="cpu", dtype=torch.float64).clone()
    plan = givens_plan(r)
    angles = torch.empty(plan.p.numel(), dtype=torch.float64)
    for stage in range(plan.stages):
        k = (plan.stage == stage).nonzero().flatten()
        p, q, col = plan.p[k], plan.q[k], plan.col[k]
        theta = torch.atan2(m[q, col], m[p, col])
        c, s = torch.cos(theta)[:, None], torch.sin(theta)[:, None]
        row_p, row_q = m[p].clone(), m[q].clone()
        m[p] = c * row_p + s * row_q
        m[q] = c * row_q - s * row_p
        angles[k] = theta
    signs = torch.where(torch.diagonal(m) < 0, -1.0, 1.0).to(torch.float64)
    return angles.to(device=o.device, dtype=o.dtype), signs.to(o)


# ------------------------------------------------------------------ refit of b
@dataclass(frozen=True)
class BFit:
    """Result of :func:`fit_b`.

    Attributes
    ----------
    b_real, b_imag : (d/2,) torch.Tensor
    residual : float
        ``||S Gamma(b) B - T||_F / ||T||_F`` (0 for a zero target).
    fitted : (d, r) torch.Tensor, float64
        ``S Gamma(b) B`` at the fitted ``b`` (the product the residual
        measures), for callers that need it again.
    iterations : int
        Conjugate-gradient iterations (0 when ``d`` is a power of two: closed
        form).
    normal_residual : float
        ``||J^T (T - S Gamma(b) B)|| / ||J^T T||`` with ``J`` the design
        matrix of the unknowns ``(a, c)``: the relative residual of the normal
        equations (0 for a zero right-hand side).
    """

    b_real: torch.Tensor
    b_imag: torch.Tensor
    residual: float
    fitted: torch.Tensor
    iterations: int = 0
    normal_residual: float = 0.0


_LOG = logging.getLogger("fedlr")
_CG_RTOL = 64 * torch.finfo(torch.float64).eps
_CG_PATIENCE = 50  # least iterations without a new smallest normal residual


def _check_b_shapes(d: int, b_matrix: torch.Tensor, target: torch.Tensor) -> None:
    if d % 2:
        raise ShapeMismatchError(f"Gamma(b) needs an even d_out, got {d}")
    if b_matrix.ndim != 2 or b_matrix.shape[0] != d or target.shape != b_matrix.shape:
        raise ShapeMismatchError(
            f"B {tuple(b_matrix.shape)} and T {tuple(target.shape)} must both be "
            f"({d}, r)"
        )


@dataclass(frozen=True)
class _BDesign:
    """The design operator ``J: (a, c) -> S Gamma(a + ic) B`` and its transpose.

    Everything in float64, rows as columns: ``J`` maps the ``d`` unknowns to
    an (r, d) array whose row ``l`` is column ``l`` of ``S Gamma(b) B``. One
    application of ``J`` or ``J^T`` is one SORF transform of ``r`` vectors,
    ``O(r n log n)``.
    """

    signs: SorfSigns
    b_t: torch.Tensor  # (r, d), B^T
    b_even: torch.Tensor  # (r, d/2), rows 2j of B
    b_odd: torch.Tensor  # (r, d/2), rows 2j+1 of B

    @classmethod
    def build(cls, signs: SorfSigns, b_matrix: torch.Tensor) -> _BDesign:
        b_t = b_matrix.T.contiguous()
        return cls(
            signs=signs,
            b_t=b_t,
            b_even=b_t[:, 0::2].contiguous(),
            b_odd=b_t[:, 1::2].contiguous(),
        )

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``J x``, x = (a, c) of shape (d,): (r, d) rows of ``S Gamma(b) B``."""
        m = x.numel() // 2
        s = self.signs
        cols = gamma_apply(x[:m], x[m:], self.b_t)
        return _sign_hadamard_chain(cols, s.d3, s.d2, s.d1, s.d)

    def apply_t(self, z: torch.Tensor) -> torch.Tensor:
        """``J^T z`` for (r, d) rows ``z``: ``(a, c)`` of shape (d,).

        ``Y = S^T Z``; then ``a_j = sum_l (Y_2j B_2j + Y_2j+1 B_2j+1)`` and
        ``c_j = sum_l (Y_2j+1 B_2j - Y_2j B_2j+1)`` (the transpose of the
        2x2 blocks).
        """
        s = self.signs
        y = _sign_hadamard_chain(z, s.d1, s.d2, s.d3, s.d)
        y_even, y_odd = y[:, 0::2], y[:, 1::2]
        a = (y_even * self.b_even + y_odd * self.b_odd).sum(0)
        c = (y_odd * self.b_even - y_even * self.b_odd).sum(0)
        return torch.cat([a, c])

    def pair_energy(self) -> torch.Tensor:
        """``rho_j^2 = ||B_2j||^2 + ||B_2j+1||^2``, (d/2,).

        ``J^T J = diag(rho^2, rho^2)`` (over ``(a, c)``) when ``S`` is
        orthogonal: each 2x2 block ``[[B_2j, -B_2j+1], [B_2j+1, B_2j]]`` is
        ``rho_j`` times an isometry.
        """
        return (self.b_even.square() + self.b_odd.square()).sum(0)


def _cgls(
    design: _BDesign,
    target_rows: torch.Tensor,
    rhs: torch.Tensor,
    rtol: float,
    max_iter: int,
) -> tuple[torch.Tensor, int, bool]:
    """Minimum-norm least squares ``min ||J x - T||`` by CGLS from ``x = 0``.

    Conjugate gradients on the normal equations ``J^T J x = J^T T`` in the
    stable CGLS form (Hestenes-Stiefel; Bjorck, *Numerical Methods for Least
    Squares Problems*, 1996, sec. 7.4). Started from 0, every iterate lies in
    the Krylov space of ``J^T J`` on ``rhs = J^T T``, inside ``range(J^T) =
    null(J)^perp``: the limit is the minimum-norm solution ``pinv(J) T``
    also when ``J`` is rank deficient. No preconditioner: a diagonal one
    would converge to the minimum of a weighted norm instead.

    Stops when ``||J^T r_k|| <= rtol max(||J^T T||, ||J|| ||r_k||)`` (the
    second term is the test of LSQR, Paige and Saunders 1982, for an
    inconsistent problem; ``||J|| <= max_j rho_j`` since ``||S|| <= 1``); or
    after ``d`` iterations (at least ``_CG_PATIENCE``) without a new smallest
    ``||J^T r_k||`` (the normal residual of CG is not monotone, and stalls at
    its rounding floor); or after ``max_iter``. Returns the iterate with the
    smallest normal residual, the iterations run and whether the test was met.
    """
    d = design.b_t.shape[1]
    x = torch.zeros(d, dtype=target_rows.dtype, device=target_rows.device)
    resid = target_rows.clone()
    grad = rhs
    grad_sq = float(grad @ grad)
    grad0 = math.sqrt(grad_sq)
    if grad0 == 0.0:
        return x, 0, True
    norm_j = math.sqrt(float(design.pair_energy().max()))
    patience = max(_CG_PATIENCE, d)
    best, best_x, stale, converged = grad0, x.clone(), 0, False
    direction = grad.clone()
    k = 0
    while k < max_iter and not converged and stale < patience:
        k += 1
        q = design.apply(direction)
        q_sq = float((q * q).sum())
        if q_sq == 0.0:  # direction in null(J): nothing left to reduce
            break
        alpha = grad_sq / q_sq
        x.add_(direction, alpha=alpha)
        resid.sub_(q, alpha=alpha)
        grad = design.apply_t(resid)
        new_sq = float(grad @ grad)
        norm = math.sqrt(new_sq)
        if norm < best:
            best, stale = norm, 0
            best_x.copy_(x)
        else:
            stale += 1
        resid_norm = float(torch.linalg.vector_norm(resid))
        converged = norm <= rtol * max(grad0, norm_j * resid_norm)
        direction = grad + (new_sq / grad_sq) * direction
        grad_sq = new_sq
    return best_x, k, converged


def fit_b(
    signs: SorfSigns,
    b_matrix: torch.Tensor,
    target: torch.Tensor,
    *,
    rtol: float = _CG_RTOL,
    max_iter: int | None = None,
) -> BFit:
    """Minimum-norm least-squares ``b`` of ``min_b ||S Gamma(b) B - T||_F``.

    ``Gamma(b) B`` is linear in the ``d`` unknowns ``x = (a, c)``: write it
    ``J x`` with the design operator ``J`` (``d r x d``). Its column pair
    ``(a_j, c_j)`` touches rows ``2j, 2j+1`` of ``Gamma(b) B`` only, through
    ``[[B_2j, -B_2j+1], [B_2j+1, B_2j]]``, which is ``rho_j`` times an
    isometry (``rho_j^2 = ||B_2j||^2 + ||B_2j+1||^2``). ``J`` and ``J^T`` are
    applied by FWHT (``O(r n log n)`` each, no ``d x d`` matrix):

    1. ``d`` a power of two: ``S`` is orthogonal, so ``J^T J = diag(rho^2)``
       and ``x = J^T T / rho^2`` in closed form (pairs with
       ``rho_j^2 <= eps d max rho^2`` get 0, the minimum-norm choice).
    2. Otherwise the truncated ``S`` is often singular: CGLS from ``x = 0``
       (conjugate gradients on ``J^T J x = J^T T``), which converges to the
       minimum-norm solution ``pinv(J) T``, as :func:`_fit_b_dense` (the
       dense normal equations and an eigendecomposition) returns. Each
       iteration costs two SORF transforms of ``r`` vectors; the iterations
       grow with the condition number of ``J`` on its range (about 30 for
       ``r = 16`` and a random ``B``, a few hundred for ``r = 1``), at most
       ``max_iter``.

    Parameters
    ----------
    signs : SorfSigns
        ``S`` of size ``d``.
    b_matrix : (d, r) torch.Tensor
        The frozen ``B``.
    target : (d, r) torch.Tensor
        ``T = U_r diag(Sigma_r)``.
    rtol : float
        Stop when ``||J^T r|| <= rtol max(||J^T T||, ||J|| ||r||)`` with
        ``r = T - J x`` (see :func:`_cgls`); the default ``64 eps`` gives
        ``x`` to about ``cond(J)^2 rtol`` relative.
    max_iter : int, optional
        Iteration cap (default ``4 d + 100``). If it or the rounding floor
        stops the iteration above ``rtol``, a warning is logged and the
        iterate with the smallest normal residual is returned.

    Returns
    -------
    BFit
        In ``target``'s dtype; computed in float64.
    """
    d = signs.d
    _check_b_shapes(d, b_matrix, target)
    f64 = torch.float64
    s = signs.to(f64, target.device)
    design = _BDesign.build(s, b_matrix.to(device=target.device, dtype=f64))
    t_rows = target.to(f64).T.contiguous()  # (r, d)
    rhs = design.apply_t(t_rows)  # J^T T
    iterations = 0
    if d == s.n:
        # 1. S orthogonal: J^T J = diag(rho^2, rho^2), one transform.
        rho_sq = design.pair_energy()
        cutoff = float(rho_sq.max()) * d * torch.finfo(f64).eps
        inv = torch.where(rho_sq > cutoff, 1.0 / rho_sq.clamp_min(cutoff), 0.0)
        sol = rhs * torch.cat([inv, inv])
    else:
        # 2. CGLS from 0: the minimum-norm solution.
        cap = 4 * d + 100 if max_iter is None else max_iter
        sol, iterations, converged = _cgls(design, t_rows, rhs, rtol, cap)
        if not converged:
            _LOG.warning(
                "fit_b: CGLS stopped after %d iterations above rtol %.1e "
                "(d=%d, r=%d); returning the best iterate",
                iterations,
                rtol,
                d,
                t_rows.shape[0],
            )
    a, c = sol[: d // 2], sol[d // 2 :]
    fitted_rows = design.apply(sol)
    rhs_norm = float(torch.linalg.vector_norm(rhs))
    normal = float(torch.linalg.vector_norm(design.apply_t(t_rows - fitted_rows)))
    t_norm = float(torch.linalg.vector_norm(t_rows))
    err = float(torch.linalg.vector_norm(fitted_rows - t_rows))
    return BFit(
        b_real=a.to(target.dtype),
        b_imag=c.to(target.dtype),
        residual=err / t_norm if t_norm > 0 else 0.0,
        fitted=fitted_rows.T,
        iterations=iterations,
        normal_residual=normal / rhs_norm if rhs_norm > 0 else 0.0,
    )


def _pair_swap(x: torch.Tensor) -> torch.Tensor:
    """Rows ``2j`` and ``2j+1`` exchanged: ``(x_1, x_0, x_3, x_2, ...)``."""
    return x.reshape(-1, 2, *x.shape[1:]).flip(1).reshape(x.shape)


def _tie(
    g: torch.Tensor, rows: tuple[float, float], cols: tuple[float, float]
) -> torch.Tensor:
    """``P_r^T g P_c`` for ``P`` mapping ``x_j`` to entries ``2j, 2j+1`` with signs."""
    out = torch.zeros_like(g[0::2, 0::2])
    for e in (0, 1):
        for f in (0, 1):
            out = out + rows[e] * cols[f] * g[e::2, f::2]
    return out


def _fit_b_dense(
    signs: SorfSigns, b_matrix: torch.Tensor, target: torch.Tensor
) -> BFit:
    """Reference :func:`fit_b` on the dense ``d x d`` normal equations.

    For tests and benchmarks only: ``O(d^3)`` time and ``O(d^2)`` memory (the
    implementation :func:`fit_b` replaced). With ``K = S^T S`` (``d`` FWHT
    applications) the normal equations of ``u = (alpha, gamma)``,
    ``Gamma(b) B = diag(alpha) B + diag(gamma) B~`` (``B~``: rows swapped in
    pairs, ``alpha_2j = alpha_2j+1 = a_j``, ``gamma = (-c_j, c_j)``), are
    ``[[K o BB^T, K o BB~^T], [K o B~B^T, K o B~B~^T]] u = (rowsum(S^T T o B),
    rowsum(S^T T o B~))`` (``o`` entrywise), tied to ``(a, c)`` by even/odd
    slicing: a ``d x d`` symmetric system, solved by an eigendecomposition with
    cut-off ``eps * d * lambda_max`` (the minimum-norm solution when singular).
    """
    d = signs.d
    _check_b_shapes(d, b_matrix, target)
    f64 = torch.float64
    s = signs.to(f64, target.device)
    bm = b_matrix.to(f64)
    t = target.to(f64)
    eye = torch.eye(d, dtype=f64, device=t.device)
    s_dense_t = sorf_apply(s, eye)  # row k = (S e_k)^T, i.e. S^T as rows
    k_mat = s_dense_t @ s_dense_t.T  # K = S^T S, (d, d)
    b_sw = _pair_swap(bm)
    stt = sorf_apply_t(s, t.T).T  # S^T T, (d, r)
    # 1. Normal equations in u = (alpha, gamma), 2d unknowns.
    g_aa = k_mat * (bm @ bm.T)
    g_ag = k_mat * (bm @ b_sw.T)
    g_gg = k_mat * (b_sw @ b_sw.T)
    h_a = (stt * bm).sum(1)
    h_g = (stt * b_sw).sum(1)
    # 2. Tie alpha_{2j}=alpha_{2j+1}=a_j and gamma = (-c_j, c_j): u = P (a, c),
    #    P^T G P by even/odd slicing.
    tie_a, tie_c = (1.0, 1.0), (-1.0, 1.0)
    gram = torch.cat(
        [
            torch.cat([_tie(g_aa, tie_a, tie_a), _tie(g_ag, tie_a, tie_c)], 1),
            torch.cat([_tie(g_ag.T, tie_c, tie_a), _tie(g_gg, tie_c, tie_c)], 1),
        ],
        0,
    )
    rhs = torch.cat([h_a[0::2] + h_a[1::2], h_g[1::2] - h_g[0::2]])
    # 3. Minimum-norm solve of the symmetric PSD system.
    evals, evecs = torch.linalg.eigh(gram)
    cutoff = float(evals.abs().max()) * d * torch.finfo(f64).eps
    inv = torch.where(evals > cutoff, 1.0 / evals.clamp_min(cutoff), 0.0)
    sol = evecs @ (inv * (evecs.T @ rhs))
    a, c = sol[: d // 2], sol[d // 2 :]
    fitted = sorf_apply(s, gamma_apply(a, c, bm.T)).T
    t_norm = float(torch.linalg.matrix_norm(t))
    err = float(torch.linalg.matrix_norm(fitted - t))
    residual = err / t_norm if t_norm > 0 else 0.0
    return BFit(
        b_real=a.to(target.dtype),
        b_imag=c.to(target.dtype),
        residual=residual,
        fitted=fitted,
    )


# ------------------------------------------------------------------ refit of d
@dataclass(frozen=True)
class DFit:
    """Result of :func:`fit_d`.

    Attributes
    ----------
    scale : () torch.Tensor
        ``m``, the mean of the polar singular values.
    angles : (r (r-1) / 2,) torch.Tensor
    signs : (r,) torch.Tensor
        Residual sign diagonal of the polar factor (``O = G(theta) diag(signs)``).
    residual : float
        ``||m G(theta) diag(signs) A - V_r^T||_F / ||V_r^T||_F``.
    """

    scale: torch.Tensor
    angles: torch.Tensor
    signs: torch.Tensor
    residual: float


def polar_target(a_matrix: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:
    """``Lambda_target = V_r^T pinv(A)``, the (r, r) matrix with ``Lambda A = V_r^T``.

    Parameters
    ----------
    a_matrix : (r, d_in) torch.Tensor
    vh : (r, d_in) torch.Tensor

    Returns
    -------
    (r, r) torch.Tensor, float64
    """
    if a_matrix.shape != vh.shape or a_matrix.ndim != 2:
        raise ShapeMismatchError(
            f"A {tuple(a_matrix.shape)} and V_r^T {tuple(vh.shape)} must both be "
            "(r, d_in)"
        )
    a64 = a_matrix.to(torch.float64)
    return vh.to(torch.float64) @ torch.linalg.pinv(a64)


@dataclass(frozen=True)
class PolarFactor:
    """Polar decomposition ``M = O P`` of a square matrix, through its SVD.

    With ``M = U diag(D) V^T``, ``O = U V^T`` is the orthogonal matrix nearest
    to ``M`` in the Frobenius norm and ``P = V diag(D) V^T``.

    Attributes
    ----------
    o : (r, r) torch.Tensor
        The orthogonal factor ``O``.
    singular_values : (r,) torch.Tensor
        ``D``, descending (the eigenvalues of ``P``).
    """

    o: torch.Tensor
    singular_values: torch.Tensor

    def negate_last_row(self) -> PolarFactor:
        """The polar factor of ``diag(1, ..., 1, -1) M``, without a new SVD.

        ``diag(1, ..., 1, -1) M = (diag(1, ..., 1, -1) U) diag(D) V^T`` is an SVD,
        so ``O`` loses the sign of its last row and ``D`` stays.
        """
        o = self.o.clone()
        o[-1] = -o[-1]
        return PolarFactor(o=o, singular_values=self.singular_values)


def polar_factor(m: torch.Tensor) -> PolarFactor:
    """Orthogonal polar factor ``O = U V^T`` and singular values of ``M``.

    Parameters
    ----------
    m : (r, r) torch.Tensor

    Returns
    -------
    PolarFactor
        In ``m``'s dtype. ``O`` is unique when ``M`` is nonsingular.
    """
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ShapeMismatchError(f"expected a square matrix, got {tuple(m.shape)}")
    p, dvals, qh = torch.linalg.svd(m)
    return PolarFactor(o=p @ qh, singular_values=dvals)


def fit_d(
    a_matrix: torch.Tensor, vh: torch.Tensor, *, polar: PolarFactor | None = None
) -> DFit:
    """Scale and Givens angles of ``m G(theta) A ~ V_r^T``.

    1. ``Lambda_target = V_r^T pinv(A)``.
    2. Polar decomposition through the SVD ``P D Q^T = Lambda_target``: the
       nearest orthogonal matrix is ``O = P Q^T``.
    3. ``O = G(theta) diag(signs)`` by :func:`decompose_orthogonal`;
       ``m = mean(D)``.

    Parameters
    ----------
    a_matrix : (r, d_in) torch.Tensor
        The frozen ``A``.
    vh : (r, d_in) torch.Tensor
        ``V_r^T`` of the truncated SVD.
    polar : PolarFactor, optional
        ``polar_factor(polar_target(a_matrix, vh))`` when the caller already
        has it (steps 1-2 are then skipped); float64.

    Returns
    -------
    DFit
        In ``vh``'s dtype; computed in float64.
    """
    if polar is None:
        polar = polar_factor(polar_target(a_matrix, vh))
    elif polar.o.shape != (a_matrix.shape[0], a_matrix.shape[0]):
        raise ShapeMismatchError(
            f"polar factor {tuple(polar.o.shape)} does not fit A "
            f"{tuple(a_matrix.shape)}: expected (r, r)"
        )
    o = polar.o
    angles, signs = decompose_orthogonal(o)
    scale = polar.singular_values.mean()
    r = int(o.shape[0])
    rebuilt = build_lambda_d_rot(scale, angles, r) * signs  # columns times signs
    v64 = vh.to(torch.float64)
    err = float(torch.linalg.matrix_norm(rebuilt @ a_matrix.to(torch.float64) - v64))
    norm = float(torch.linalg.matrix_norm(v64))
    return DFit(
        scale=scale.to(vh.dtype),
        angles=angles.to(vh.dtype),
        signs=signs.to(vh.dtype),
        residual=err / norm if norm > 0 else 0.0,
    )
