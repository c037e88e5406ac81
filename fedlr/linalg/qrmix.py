"""QR-Mix kernels: FC cross-entropy Hessian, its top eigenpairs, the server solve.

The final fully connected layer maps features ``f`` (F,) to logits
``z = W f + b`` with ``W`` of shape (K, F) and ``b`` (K,). Its parameters are
flattened **bias first, then the weight row-major** into a vector of length
``P = K (F + 1)`` (:func:`fc_flatten`).

Hessian-vector product
    For the mean softmax cross-entropy over ``N`` samples, with softmax
    probabilities ``p_n`` (K,), the Hessian with respect to the logits is
    ``A_n = diag(p_n) - p_n p_nᵀ`` (independent of the labels), and for a
    direction ``v = (v_b, V_W)``

        H v = (1/N) Σ_n J_nᵀ A_n J_n v,   J_n v = V_W f_n + v_b =: u_n,
        A_n u_n = p_n ⊙ u_n − p_n (p_nᵀ u_n),
        (H v)_b = (1/N) Σ_n A_n u_n,   (H v)_W = (1/N) Σ_n (A_n u_n) f_nᵀ.

    :func:`fc_hessian_matvec` evaluates this for a batch of directions at once,
    in blocks of samples, without autograd. ``H`` is symmetric positive
    semi-definite (a sum of ``J_nᵀ A_n J_n`` with ``A_n`` PSD).

Top eigenpairs
    :func:`subspace_iteration` is randomised QR subspace iteration with
    Rayleigh–Ritz: ``Y = H Ω`` for a seeded Gaussian ``Ω`` of ``k + s``
    columns, ``q`` rounds of ``Q ← qr(H Q)``, then the eigenpairs of the small
    ``Qᵀ H Q``; the top ``k`` Ritz pairs are returned (Halko, Martinsson and
    Tropp, 2011, Alg. 4.4 and 5.3).

Server solve
    Client ``i`` (weight ``w_i``, Σ w_i = 1) sends ``V_i`` (P, k) orthonormal,
    ``Λ_i`` (k,) and its FC delta ``Δ_i`` (P,). With ``H̄ = Σ_i w_i V_i Λ_i V_iᵀ``
    and ``b = Σ_i w_i V_i Λ_i (V_iᵀ Δ_i)``, QR of the stacked bases
    ``[V_1 .. V_C] = Q R`` gives ``H̄ = Q K Qᵀ`` with ``K = R diag(w_i Λ_i) Rᵀ``
    (size ``Ck``). Then ``z = (K + τI)⁻¹ Qᵀ b`` and

    * ``fisher`` (default): ``γ (H̄ + τI)⁻¹ b = γ (Q z + (b − Q Qᵀ b) / τ)``, the
      curvature-weighted (Fisher) merge of the deltas, argmin of
      ``Σ_i w_i ‖θ − Δ_i‖²_{H_i} + τ ‖θ‖²``;
    * ``literal``: the source's ``γ (τ Q z + (b − Q Qᵀ b))``, which equals
      ``γ τ (H̄ + τI)⁻¹ b``: ``τ`` times the ``fisher`` step.

    Since ``b`` lies in ``span(Q)``, ``b − Q Qᵀ b`` vanishes up to round-off; it
    is kept so that both expressions hold exactly as written. Nothing of size
    ``P x P`` is formed: the solve is in the ``Ck``-dimensional basis.

References
----------
.. [1] N. Halko, P.-G. Martinsson, J. A. Tropp, "Finding structure with
   randomness", SIAM Review 53(2), 2011.
.. [2] M. Matena, C. Raffel, "Merging models with Fisher-weighted averaging",
   NeurIPS 2022.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fedlr.errors import ShapeMismatchError
from fedlr.linalg.lowrank import normalise_weights

__all__ = [
    "QRMIX_FORMS",
    "ClientEigen",
    "fc_flatten",
    "fc_hessian_eigenpairs",
    "fc_hessian_matvec",
    "fc_unflatten",
    "qrmix_update",
    "subspace_iteration",
]

QRMIX_FORMS = ("fisher", "literal")

Matvec = Callable[[torch.Tensor], torch.Tensor]


def fc_flatten(weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Flatten FC parameters, bias first: ``[b, vec_row(W)]``.

    Parameters
    ----------
    weight : (K, F) torch.Tensor
    bias : (K,) torch.Tensor

    Returns
    -------
    (K (F + 1),) torch.Tensor

    Raises
    ------
    ShapeMismatchError
        If the shapes do not fit together.
    """
    if weight.dim() != 2 or bias.shape != (weight.shape[0],):
        raise ShapeMismatchError(
            f"expected weight (K, F) and bias (K,), got {tuple(weight.shape)} and "
            f"{tuple(bias.shape)}"
        )
    return torch.cat([bias.reshape(-1), weight.reshape(-1)])


def fc_unflatten(
    vector: torch.Tensor, num_classes: int, num_features: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fc_flatten`.

    Parameters
    ----------
    vector : (K (F + 1),) or (K (F + 1), m) torch.Tensor
    num_classes, num_features : int
        ``K`` and ``F``.

    Returns
    -------
    weight : (K, F) or (K, F, m) torch.Tensor
    bias : (K,) or (K, m) torch.Tensor
    """
    k, f = num_classes, num_features
    if vector.shape[0] != k * (f + 1):
        raise ShapeMismatchError(
            f"vector of length {vector.shape[0]} does not hold K={k}, F={f} "
            f"(needs {k * (f + 1)})"
        )
    tail = tuple(vector.shape[1:])
    return vector[k:].reshape(k, f, *tail), vector[:k].reshape(k, *tail)


def fc_hessian_matvec(
    features: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    vectors: torch.Tensor,
    *,
    block_size: int = 2048,
) -> torch.Tensor:
    """Closed-form Hessian-vector products of the mean softmax cross-entropy.

    Parameters
    ----------
    features : (N, F) torch.Tensor
        Inputs of the FC layer.
    weight : (K, F) torch.Tensor
    bias : (K,) torch.Tensor
    vectors : (P,) or (P, m) torch.Tensor
        Directions in the :func:`fc_flatten` order, ``P = K (F + 1)``.
    block_size : int
        Samples per block (bounds memory at ``block_size * K * m``).

    Returns
    -------
    torch.Tensor
        ``H @ vectors``, same shape as ``vectors``, in the dtype of ``features``.

    Raises
    ------
    ShapeMismatchError
        If the shapes do not agree.
    """
    if features.dim() != 2 or features.shape[1] != weight.shape[1]:
        raise ShapeMismatchError(
            f"features {tuple(features.shape)} do not match weight "
            f"{tuple(weight.shape)} (need (N, F) with F = weight.shape[1])"
        )
    if features.shape[0] == 0:
        raise ShapeMismatchError("features hold no sample (N = 0)")
    squeeze = vectors.dim() == 1
    v = vectors.unsqueeze(1) if squeeze else vectors
    k, f = weight.shape
    dtype = features.dtype
    v_w, v_b = fc_unflatten(v.to(dtype), k, f)  # (K, F, m), (K, m)
    w, b = weight.to(dtype), bias.to(dtype)
    out_w = torch.zeros_like(v_w)
    out_b = torch.zeros_like(v_b)
    n = features.shape[0]
    for start in range(0, n, block_size):
        x = features[start : start + block_size]  # (n_b, F)
        p = torch.softmax(x @ w.T + b, dim=1)  # (n_b, K)
        u = torch.einsum("kfm,nf->nkm", v_w, x) + v_b  # J v, (n_b, K, m)
        pu = p.unsqueeze(2) * u
        s = pu - p.unsqueeze(2) * pu.sum(dim=1, keepdim=True)  # A_n u_n
        out_b += s.sum(dim=0)
        out_w += torch.einsum("nkm,nf->kfm", s, x)
    hv = torch.cat([out_b, out_w.reshape(k * f, -1)]) / n
    return hv.squeeze(1) if squeeze else hv


def subspace_iteration(
    matvec: Matvec,
    dim: int,
    k: int,
    *,
    oversample: int = 10,
    power_iters: int = 1,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` eigenpairs of a symmetric PSD operator by QR subspace iteration.

    Parameters
    ----------
    matvec : callable
        ``matvec(X)`` returns ``H @ X`` for ``X`` of shape (dim, l).
    dim : int
        Dimension ``P`` of the operator.
    k : int
        Number of eigenpairs, ``1 <= k <= dim``.
    oversample : int
        Extra probe columns ``s``; ``l = min(k + s, dim)`` columns in all.
    power_iters : int
        Power iterations ``q >= 0`` (each one ``l`` products with ``H``).
    seed : int
        Seeds the Gaussian start ``Ω``.
    dtype : torch.dtype
        Working precision.

    Returns
    -------
    eigenvalues : (k,) torch.Tensor
        Descending, clamped at 0 (the operator is PSD; negative Ritz values
        are round-off).
    eigenvectors : (dim, k) torch.Tensor
        Orthonormal columns.

    Raises
    ------
    ValueError
        On ``k`` outside ``[1, dim]`` or negative ``oversample``/``power_iters``.
    """
    if not 1 <= k <= dim:
        raise ValueError(f"k must be in [1, {dim}], got {k}")
    if oversample < 0 or power_iters < 0:
        raise ValueError(
            f"oversample and power_iters must be >= 0, got {oversample}, {power_iters}"
        )
    width = min(k + oversample, dim)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    omega = torch.randn(dim, width, generator=gen, dtype=dtype).to(device)
    # 1. range finder: Q spans H Ω, refined by power iterations with QR
    basis, _ = torch.linalg.qr(matvec(omega))
    for _ in range(power_iters):
        basis, _ = torch.linalg.qr(matvec(basis))
    # 2. Rayleigh-Ritz on the small (l x l) projection
    projected = basis.T @ matvec(basis)
    projected = 0.5 * (projected + projected.T)
    values, ritz = torch.linalg.eigh(projected)
    order = torch.argsort(values, descending=True)[:k]
    return values[order].clamp_min(0.0), basis @ ritz[:, order]


def fc_hessian_eigenpairs(
    features: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    k: int,
    *,
    oversample: int = 10,
    power_iters: int = 1,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` eigenpairs of the FC layer's cross-entropy Hessian.

    Parameters
    ----------
    features : (N, F) torch.Tensor
    weight : (K, F) torch.Tensor
    bias : (K,) torch.Tensor
    k, oversample, power_iters, seed
        See :func:`subspace_iteration`; ``k`` is capped at ``P = K (F + 1)``.
    dtype : torch.dtype
        Working precision.

    Returns
    -------
    eigenvalues : (k,) torch.Tensor
    eigenvectors : (P, k) torch.Tensor
        In the :func:`fc_flatten` order.
    """
    x = features.to(dtype)
    dim = weight.shape[0] * (weight.shape[1] + 1)
    return subspace_iteration(
        lambda v: fc_hessian_matvec(x, weight, bias, v),
        dim,
        min(k, dim),
        oversample=oversample,
        power_iters=power_iters,
        seed=seed,
        dtype=dtype,
        device=features.device,
    )


@dataclass(frozen=True)
class ClientEigen:
    """One client's QR-Mix payload.

    Attributes
    ----------
    vectors : (P, k) torch.Tensor
        Orthonormal eigenvectors ``V_i`` of its FC Hessian.
    values : (k,) torch.Tensor
        Eigenvalues ``Λ_i`` (>= 0).
    delta : (P,) torch.Tensor
        Its FC update ``Δ_i`` (local minus global), flattened.
    """

    vectors: torch.Tensor
    values: torch.Tensor
    delta: torch.Tensor


def qrmix_update(
    clients: Sequence[ClientEigen],
    weights: Sequence[float] | torch.Tensor,
    *,
    tau: float,
    gamma: float = 1.0,
    form: str = "fisher",
) -> torch.Tensor:
    """The QR-Mix server step for the FC layer (see the module docstring).

    Parameters
    ----------
    clients : sequence of ClientEigen
        ``C`` payloads with the same ``P`` (``k`` may differ per client).
    weights : (C,) sequence of float
        Client weights (e.g. num-examples), normalised to sum to one.
    tau : float
        Ridge ``τ > 0``.
    gamma : float
        Step scale ``γ``.
    form : {"fisher", "literal"}
        ``γ (H̄ + τI)⁻¹ b`` or the source's ``γ (τ Q z + b − Q Qᵀ b)``.

    Returns
    -------
    (P,) torch.Tensor
        The FC update, in float64.

    Raises
    ------
    ShapeMismatchError
        If payload shapes disagree.
    ValueError
        On no clients, ``tau <= 0`` or an unknown ``form``.
    """
    if not clients:
        raise ValueError("qrmix_update needs at least one client payload")
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    if form not in QRMIX_FORMS:
        raise ValueError(f"form must be one of {', '.join(QRMIX_FORMS)}, got {form!r}")
    dim = clients[0].delta.shape[0]
    for i, c in enumerate(clients):
        k = c.values.shape[0] if c.values.dim() == 1 else -1
        if c.vectors.shape != (dim, k) or c.delta.shape != (dim,):
            raise ShapeMismatchError(
                f"client {i}: vectors {tuple(c.vectors.shape)}, values "
                f"{tuple(c.values.shape)}, delta {tuple(c.delta.shape)}; expected "
                f"({dim}, k), (k,), ({dim},)"
            )
    w = normalise_weights(weights, len(clients))
    f64 = torch.float64
    stacked = torch.cat([c.vectors.to(f64) for c in clients], dim=1)  # (P, Ck)
    sigma = torch.cat([wi * c.values.to(f64) for wi, c in zip(w, clients, strict=True)])
    # 1. b = Σ_i w_i V_i Λ_i V_iᵀ Δ_i = [V_1..V_C] (Σ ⊙ [V_iᵀ Δ_i])
    coords = torch.cat([c.vectors.to(f64).T @ c.delta.to(f64) for c in clients])
    b = stacked @ (sigma * coords)
    # 2. Q R = [V_1 .. V_C];  K = R diag(Σ) Rᵀ, symmetrised
    q, r = torch.linalg.qr(stacked)
    kernel = (r * sigma) @ r.T
    kernel = 0.5 * (kernel + kernel.T)
    # 3. z = (K + τ I)⁻¹ Qᵀ b
    proj = q.T @ b
    eye = torch.eye(kernel.shape[0], dtype=f64, device=kernel.device)
    z = torch.linalg.solve(kernel + tau * eye, proj)
    residual = b - q @ proj
    if form == "fisher":
        return gamma * (q @ z + residual / tau)
    return gamma * (tau * (q @ z) + residual)
