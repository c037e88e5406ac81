"""FOT kernels: projected aggregation (FedProject) and basis expansion (GPSE).

For a projected layer ``l`` with weight of shape ``(out, *rest)`` let
``d = prod(rest)`` (``in`` for a dense layer, ``C_in * kh * kw`` for a conv)
and ``U`` of shape ``(d, k)`` an orthonormal basis of the input directions that
earlier tasks use. Notation follows the paper [1]_.

* **Activations** ``A`` of shape ``(d, n)``: a dense layer's inputs as columns
  (features x samples); a conv layer's input patches unfolded with the layer's
  kernel size, stride, padding and dilation (one column per sample and output
  position), in the order of ``weight.reshape(out, -1)``, so that
  ``W.reshape(out, -1) @ A`` is the layer's pre-activation.
* **Residual** ``R = A - U (Uᵀ A)`` and its **energy fraction**
  ``r = ||R||_F² / ||A||_F²``.
* **Sketch** ``Y = R G`` with ``G`` of shape ``(n, m)``, i.i.d. ``N(0, 1/m)``,
  drawn by the client and never sent. Sums of sketches from clients with
  independent ``G_i`` satisfy ``E[(Σ Y_i)(Σ Y_i)ᵀ] = Σ R_i R_iᵀ``: the server's
  sum estimates the stacked residual's left singular space and energies, and
  equals it exactly in span when ``m`` is at least the stacked rank.
* **Energy rule** (GPM [2]_): with the weighted fraction ``r̄`` and the target
  ``ε``, ``ε' = (r̄ - (1 - ε)) / r̄``; keep the smallest ``k`` with
  ``Σ_{j<=k} σ_j² / Σ_j σ_j² >= ε'`` (``k = 0`` when ``ε' <= 0``). Since
  ``1 - r̄`` is the energy already in ``span(U)``, this is GPM's criterion
  ``(||A||² - ||R||² + Σ_{j<=k} σ_j²) / ||A||² >= ε``.
* **Expansion** ``U <- qr([U, Û_k])`` (signs fixed so the old columns are kept).
* **Projection** of an aggregated update ``g`` (``(out, *rest)``):
  ``g - (g_2 U) Uᵀ`` with ``g_2 = g.reshape(out, d)``, i.e. on the input side,
  without ever forming the ``d x d`` projector.

References
----------
.. [1] Bakman, Yaldiz, Ezzeldin, Avestimehr, "Federated Orthogonal Training:
   Mitigating Global Catastrophic Forgetting in Continual Federated Learning",
   ICLR 2024.
.. [2] Saha, Garg, Roy, "Gradient Projection Memory for Continual Learning",
   ICLR 2021.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedlr.errors import ShapeMismatchError

__all__ = [
    "ResidualSketch",
    "conv_activations",
    "dense_activations",
    "energy_rank",
    "expand_basis",
    "orthonormal_extend",
    "project_update",
    "projection_residual_norm",
    "residualise",
    "sketch_residual",
    "tightened_threshold",
    "weighted_residual_fraction",
]


def _pair(value: int | Sequence[int], name: str) -> tuple[int, int]:
    if isinstance(value, int):
        return value, value
    pair = tuple(int(v) for v in value)
    if len(pair) != 2:
        raise ValueError(f"{name} must be an int or a pair, got {value!r}")
    return pair[0], pair[1]


def conv_activations(
    x: torch.Tensor,
    kernel_size: int | Sequence[int],
    *,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
) -> torch.Tensor:
    """Unfolded input patches of a 2-D convolution, as columns.

    Parameters
    ----------
    x : (N, C_in, H, W) tensor
        The conv layer's input.
    kernel_size, stride, padding, dilation : int or pair
        The layer's settings (``nn.Conv2d`` attributes; padding must be
        numeric, zero padding).

    Returns
    -------
    (C_in * kh * kw, N * L) tensor
        ``L`` output positions per sample; row order matches
        ``weight.reshape(out, -1)``, columns are sample-major.

    Raises
    ------
    ShapeMismatchError
        If ``x`` is not 4-D.
    """
    if x.dim() != 4:
        raise ShapeMismatchError(
            f"conv activations need an (N, C, H, W) input, got shape {tuple(x.shape)}"
        )
    cols = F.unfold(
        x,
        kernel_size=_pair(kernel_size, "kernel_size"),
        dilation=_pair(dilation, "dilation"),
        padding=_pair(padding, "padding"),
        stride=_pair(stride, "stride"),
    )  # (N, d, L)
    return cols.permute(1, 0, 2).reshape(cols.shape[1], -1)


def dense_activations(x: torch.Tensor) -> torch.Tensor:
    """A dense layer's inputs as columns.

    Parameters
    ----------
    x : (N, ..., d) tensor
        The layer's input; leading dimensions are all samples.

    Returns
    -------
    (d, N') tensor
        ``N'`` = product of the leading dimensions.
    """
    if x.dim() < 2:
        raise ShapeMismatchError(
            f"dense activations need an (N, d) input, got shape {tuple(x.shape)}"
        )
    return x.reshape(-1, x.shape[-1]).T


def _check_basis(basis: torch.Tensor | None, d: int, what: str) -> None:
    if basis is None:
        return
    if basis.dim() != 2 or basis.shape[0] != d:
        raise ShapeMismatchError(
            f"basis of shape {tuple(basis.shape)} does not fit {what} of row "
            f"dimension {d}; expected ({d}, k)"
        )


def residualise(a: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
    """``R = A - U (Uᵀ A)``: what ``span(U)`` does not explain.

    Parameters
    ----------
    a : (d, n) tensor
    basis : (d, k) tensor with orthonormal columns, or None (``k = 0``)

    Returns
    -------
    (d, n) tensor
    """
    if a.dim() != 2:
        raise ShapeMismatchError(f"activations must be 2-D, got {tuple(a.shape)}")
    _check_basis(basis, a.shape[0], "activations")
    if basis is None or basis.shape[1] == 0:
        return a.clone()
    u = basis.to(a.dtype)
    return a - u @ (u.T @ a)


def sketch_residual(
    residual: torch.Tensor, num_columns: int, generator: torch.Generator
) -> torch.Tensor:
    """``Y = R G`` with ``G`` of shape ``(n, m)``, entries ``N(0, 1/m)``.

    Parameters
    ----------
    residual : (d, n) tensor
    num_columns : int
        Sketch width ``m``, >= 1.
    generator : torch.Generator
        The client's own; ``G`` is drawn from it and discarded.

    Returns
    -------
    (d, m) tensor
    """
    if num_columns < 1:
        raise ValueError(f"sketch width must be >= 1, got {num_columns}")
    g = torch.randn(
        residual.shape[1],
        num_columns,
        generator=generator,
        dtype=residual.dtype,
        device=residual.device,
    )
    return residual @ g / num_columns**0.5


@dataclass
class ResidualSketch:
    """Streaming ``Y = R G``, ``||R||²`` and ``||A||²`` over batches of columns.

    Feeding the activations of a layer batch by batch gives the same
    distribution as one sketch of the whole ``(d, n)`` matrix (each batch's
    block of ``G`` is fresh), without holding ``A`` in memory.

    Parameters
    ----------
    basis : (d, k) tensor or None
        The layer's current basis.
    num_columns : int
        Sketch width ``m``.
    generator : torch.Generator
        Client-local source of ``G``.
    """

    basis: torch.Tensor | None
    num_columns: int
    generator: torch.Generator
    sketch: torch.Tensor | None = None
    residual_energy: float = 0.0
    total_energy: float = 0.0

    def add(self, a: torch.Tensor) -> None:
        """Add a ``(d, n_b)`` block of activation columns (float64 inside)."""
        a64 = a.detach().to(torch.float64)
        r = residualise(a64, self.basis)
        y = sketch_residual(r, self.num_columns, self.generator)
        self.sketch = y if self.sketch is None else self.sketch + y
        self.residual_energy += float(r.square().sum())
        self.total_energy += float(a64.square().sum())

    @property
    def fraction(self) -> float:
        """``r = ||R||_F² / ||A||_F²`` (0 when no energy was seen)."""
        if self.total_energy <= 0.0:
            return 0.0
        return min(1.0, self.residual_energy / self.total_energy)


def weighted_residual_fraction(
    fractions: Sequence[float], counts: Sequence[float]
) -> float:
    """``r̄ = Σ_i b_i r_i / Σ_i b_i``.

    Parameters
    ----------
    fractions : (C,) sequence of float in [0, 1]
    counts : (C,) sequence of float > 0
        Samples ``b_i`` behind each client's activations.
    """
    if len(fractions) != len(counts) or not fractions:
        raise ShapeMismatchError(
            f"{len(fractions)} residual fractions but {len(counts)} sample counts"
        )
    total = float(sum(counts))
    if total <= 0:
        raise ValueError(f"sample counts must sum to > 0, got {list(counts)}")
    return sum(float(r) * float(b) for r, b in zip(fractions, counts, strict=True)) / (
        total
    )


def tightened_threshold(residual_fraction: float, eps: float) -> float:
    """``ε' = (r̄ - (1 - ε)) / r̄``, the share of the residual energy to keep.

    Returns ``-inf`` when ``r̄ = 0`` (nothing left to explain).
    """
    if not 0.0 <= eps <= 1.0:
        raise ValueError(f"energy threshold must be in [0, 1], got {eps}")
    if residual_fraction <= 0.0:
        return float("-inf")
    return (residual_fraction - (1.0 - eps)) / residual_fraction


def energy_rank(singular_values: torch.Tensor, threshold: float) -> int:
    """Smallest ``k`` with ``Σ_{j<=k} σ_j² / Σ_j σ_j² >= threshold``.

    Parameters
    ----------
    singular_values : (p,) tensor, non-increasing, >= 0
    threshold : float
        ``<= 0`` gives 0; values above 1 are treated as 1.

    Returns
    -------
    int in [0, p]
        0 also when every singular value is zero.
    """
    if singular_values.dim() != 1:
        raise ShapeMismatchError(
            f"singular values must be 1-D, got {tuple(singular_values.shape)}"
        )
    energy = singular_values.to(torch.float64).square()
    total = float(energy.sum())
    if threshold <= 0.0 or total <= 0.0 or energy.numel() == 0:
        return 0
    ratio = torch.cumsum(energy, 0) / total
    # tolerance: a planted spectrum whose ratio hits the threshold exactly
    tol = 64 * torch.finfo(torch.float64).eps
    reached = ratio >= min(threshold, 1.0) - tol
    return int(torch.nonzero(reached)[0, 0]) + 1


def orthonormal_extend(
    basis: torch.Tensor | None, directions: torch.Tensor
) -> torch.Tensor:
    """Append ``directions`` to ``basis`` and re-orthonormalise by QR.

    Signs are fixed (``diag(R) >= 0``), so an orthonormal ``basis`` keeps its
    columns (up to rounding).

    Parameters
    ----------
    basis : (d, k) tensor or None
    directions : (d, j) tensor

    Returns
    -------
    (d, k + j) tensor with orthonormal columns (float64)

    Raises
    ------
    ShapeMismatchError
        If the row dimensions differ or ``k + j > d``.
    """
    d = directions.shape[0]
    _check_basis(basis, d, "the new directions")
    parts = [directions.to(torch.float64)]
    if basis is not None and basis.shape[1] > 0:
        parts.insert(0, basis.to(torch.float64))
    stacked = torch.cat(parts, dim=1)
    if stacked.shape[1] > d:
        raise ShapeMismatchError(
            f"cannot hold {stacked.shape[1]} orthonormal columns in dimension {d}"
        )
    q, r = torch.linalg.qr(stacked)
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1.0
    return q * signs


def expand_basis(
    basis: torch.Tensor | None,
    sketch_sum: torch.Tensor,
    residual_fraction: float,
    eps: float,
) -> tuple[torch.Tensor | None, int]:
    """GPSE on the server: extend ``U`` by the energy rule on the summed sketch.

    Steps: (1) ``ε' = (r̄ - (1 - ε)) / r̄``; (2) SVD of ``Y = Σ_i Y_i``;
    (3) ``k`` = :func:`energy_rank` of its singular values at ``ε'``, capped by
    the room left (``d - k_old``) and the numerical rank of ``Y``;
    (4) ``U <- qr([U, Û_k])``.

    Parameters
    ----------
    basis : (d, k_old) tensor or None
    sketch_sum : (d, m) tensor
        The sum of the clients' sketches.
    residual_fraction : float
        ``r̄``, see :func:`weighted_residual_fraction`.
    eps : float
        Energy threshold ``ε`` in [0, 1].

    Returns
    -------
    basis : (d, k_old + k) float64 tensor, or the old basis (None) when k = 0
    k : int
        Number of directions added.
    """
    if sketch_sum.dim() != 2:
        raise ShapeMismatchError(
            f"summed sketch must be 2-D (d, m), got {tuple(sketch_sum.shape)}"
        )
    d = sketch_sum.shape[0]
    _check_basis(basis, d, "the summed sketch")
    threshold = tightened_threshold(residual_fraction, eps)
    y = sketch_sum.to(torch.float64)
    if basis is not None and basis.shape[1] > 0:
        y = residualise(y, basis.to(torch.float64))  # rounding guard
    u_hat, s, _ = torch.linalg.svd(y, full_matrices=False)
    k = energy_rank(s, threshold)
    room = d - (0 if basis is None else basis.shape[1])
    rank_tol = s[0] * max(y.shape) * torch.finfo(torch.float64).eps if s.numel() else 0
    numerical_rank = int((s > rank_tol).sum()) if s.numel() else 0
    k = min(k, room, numerical_rank)
    if k == 0:
        return basis, 0
    return orthonormal_extend(basis, u_hat[:, :k]), k


def project_update(g: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
    """``g - (g_2 U) Uᵀ`` with ``g_2 = g.reshape(out, d)``: the update off ``span(U)``.

    Parameters
    ----------
    g : (out, *rest) tensor
        An aggregated weight update (dense ``(out, in)`` or conv
        ``(out, C_in, kh, kw)``).
    basis : (d, k) tensor or None, d = prod(rest)

    Returns
    -------
    tensor of ``g``'s shape and dtype
    """
    if g.dim() < 2:
        raise ShapeMismatchError(
            f"projected updates must be at least 2-D, got {tuple(g.shape)}"
        )
    g2 = g.reshape(g.shape[0], -1)
    _check_basis(basis, g2.shape[1], f"an update of shape {tuple(g.shape)}")
    if basis is None or basis.shape[1] == 0:
        return g.clone()
    work = torch.float64 if g.dtype == torch.float64 else torch.float32
    u = basis.to(work)
    g2w = g2.to(work)
    out = g2w - (g2w @ u) @ u.T
    return out.reshape(g.shape).to(g.dtype)


def projection_residual_norm(g: torch.Tensor, basis: torch.Tensor | None) -> float:
    """``||g_2 U||_F``: the part of an update inside ``span(U)`` (0 if none)."""
    if basis is None or basis.shape[1] == 0:
        return 0.0
    g2 = g.reshape(g.shape[0], -1).to(torch.float64)
    return float(torch.linalg.norm(g2 @ basis.to(torch.float64)))
