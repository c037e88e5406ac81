"""Streamed kernels on many clients' factors: linear in ``k``, one buffer at a time.

A mean of products ``M = sum_i w_i B_i A_i`` (``B_i`` (d_out, r), ``A_i``
(r, d_in)) is never stacked whole here. :class:`ProductSum` walks the clients
in chunks of at most ``CostModel.chunk_bytes`` (``[w_i B_i]`` and ``[A_i]`` of
a few clients side by side, so each GEMM has an inner size of up to
``CostModel.max_chunk_rank``) and either

* accumulates ``M`` in place into one ``d_out x d_in`` buffer
  (:func:`dense_mean_of_products`: ``O(d_out d_in k r)`` flops, linear in
  ``k``), or
* applies ``M`` or ``M^T`` to a thin block of ``l`` columns
  (``O((d_out + d_in) k r l)`` flops, ``O((d_out + d_in) l)`` memory), the
  building block of the randomized range finder
  (:func:`fedlr.linalg.randomized_svd_of_mean`) and of the Frobenius-norm
  estimate :func:`estimate_frobenius_sq` (Hutch++).

FedEx's residual ``M - B_bar A_bar`` is streamed in its centred form

    sum_i w_i B_i A_i - B_bar A_bar = sum_i w_i (B_i - B_bar)(A_i - A_bar),

(expand the right side: the cross terms are ``-B_bar A_bar`` each and the
last ``+B_bar A_bar``, since ``sum_i w_i = 1``), which sums small terms
instead of cancelling large ones, so float32 accumulation stays accurate.

References
----------
.. [1] Meyer, Musco, Musco, Woodruff, "Hutch++: optimal stochastic trace
   estimation", SOSA 2021.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from fedlr.errors import ShapeMismatchError
from fedlr.linalg.cost import (
    DEFAULT_COST_MODEL,
    DENSE,
    FACTORED,
    CostModel,
    PathChoice,
)
from fedlr.linalg.hetero import check_hetero_factors
from fedlr.linalg.lowrank import (
    GapNorms,
    _fold_dtype,
    check_factors,
    factored_frobenius_norm,
    mean_of_products_factors,
    normalise_weights,
    weighted_mean,
    work_dtype,
)

__all__ = [
    "FrobeniusEstimate",
    "ProductSum",
    "StreamedResidual",
    "aggregate_gap",
    "dense_mean_of_products",
    "estimate_frobenius_sq",
]


class ProductSum:
    """``M = sum_i c_i (B_i - B_shift)(A_i - A_shift)`` as a streamed operator.

    The client factors are kept by reference and stacked a chunk at a time
    (in :attr:`dtype`). A multi-pass algorithm (range finder, Hutch++) keeps
    the stacked chunks between passes while they fit
    ``CostModel.cache_bytes`` (at most one copy of the factors) and
    re-stacks them each pass into one reused chunk buffer otherwise; one-pass
    uses (:meth:`accumulate`, :meth:`dense`) and the estimators free them when
    done (:meth:`release`).

    Parameters
    ----------
    bs : k tensors (d_out, r_i)
    as_ : k tensors (r_i, d_in)
    coefficients : (k,) sequence of float or torch.Tensor
        ``c_i``, used as given (normalise weights first; an aggregate is
        subtracted with ``c = -1``).
    b_shift : (d_out, r) torch.Tensor, optional
        Subtracted from every ``B_i`` (all ``r_i`` must then be ``r``).
    a_shift : (r, d_in) torch.Tensor, optional
        Subtracted from every ``A_i``.
    dtype : torch.dtype, optional
        Arithmetic dtype; default :func:`work_dtype` of the factors.
    cost : CostModel, optional
        For ``chunk_bytes`` and ``max_chunk_rank``.

    Raises
    ------
    ShapeMismatchError
        Naming the shapes, if the factors do not chain or disagree on d_out,
        d_in, or the shifts do not fit.
    """

    def __init__(
        self,
        bs: Sequence[torch.Tensor],
        as_: Sequence[torch.Tensor],
        coefficients: Sequence[float] | torch.Tensor,
        *,
        b_shift: torch.Tensor | None = None,
        a_shift: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        cost: CostModel | None = None,
    ) -> None:
        if len(bs) != len(as_) or not bs:
            raise ShapeMismatchError(f"{len(bs)} B factors but {len(as_)} A factors")
        coef = torch.as_tensor(coefficients, dtype=torch.float64).flatten()
        if coef.numel() != len(bs):
            raise ShapeMismatchError(
                f"expected {len(bs)} coefficients, got {coef.numel()}"
            )
        d_out, d_in, self.ranks = check_hetero_factors(bs, as_)
        uniform = len(set(self.ranks)) == 1
        for name, shift, want in (
            ("b_shift", b_shift, (d_out, self.ranks[0])),
            ("a_shift", a_shift, (self.ranks[0], d_in)),
        ):
            if shift is not None and (not uniform or tuple(shift.shape) != want):
                raise ShapeMismatchError(
                    f"{name} has shape {tuple(shift.shape)}; it needs {want} and "
                    "one rank for every client"
                )
        self.bs = list(bs)
        self.as_ = list(as_)
        self.coefficients = coef
        self.dtype = dtype if dtype is not None else work_dtype(*bs, *as_)
        self.device = bs[0].device
        self.cost = cost if cost is not None else DEFAULT_COST_MODEL
        self.b_shift = None if b_shift is None else b_shift.to(self.device, self.dtype)
        self.a_shift = None if a_shift is None else a_shift.to(self.device, self.dtype)
        self.shape = (d_out, d_in)
        self._uniform = uniform
        self._chunk_buffers: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._stacked: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    @property
    def width(self) -> int:
        """``p = sum_i r_i``, the inner size of the stacked factors."""
        return sum(self.ranks)

    @property
    def num_clients(self) -> int:
        """``k``."""
        return len(self.bs)

    def _ranges(self, dtype: torch.dtype) -> Iterator[tuple[int, int, int]]:
        """Client index ranges ``[start, stop)`` of one chunk and their width."""
        d_out, d_in = self.shape
        itemsize = torch.empty((), dtype=dtype).element_size()
        budget = self.cost.chunk_bytes // ((d_out + d_in) * itemsize)
        max_inner = max(1, min(self.cost.max_chunk_rank, budget))
        start = 0
        while start < len(self.bs):
            stop, inner = start, 0
            while stop < len(self.bs) and (
                stop == start or inner + self.ranks[stop] <= max_inner
            ):
                inner += self.ranks[stop]
                stop += 1
            yield start, stop, inner
            start = stop

    def chunks(
        self, dtype: torch.dtype | None = None, *, keep: bool = True
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Stacked chunks ``([c_i (B_i - B_shift)]_i, [A_i - A_shift]_i)``.

        Parameters
        ----------
        dtype : torch.dtype, optional
            Default :attr:`dtype`.
        keep : bool, default True
            Keep the stacked chunks for later passes when they fit
            ``CostModel.cache_bytes``; False for a one-pass use.

        Yields
        ------
        left : (d_out, w) torch.Tensor
        right : (w, d_in) torch.Tensor
            ``left @ right`` summed over the chunks is ``M``. While the whole
            stack fits ``CostModel.cache_bytes`` the chunks are built once and
            kept for the next passes (until :meth:`release`); otherwise they
            are views of one buffer reused by the next chunk: use them before
            advancing, and never write to them.
        """
        dtype = self.dtype if dtype is None else dtype
        cached = self._stacked.get(dtype)
        if cached is not None:
            yield from cached
            return
        d_out, d_in = self.shape
        ranges = list(self._ranges(dtype))
        itemsize = torch.empty((), dtype=dtype).element_size()
        keep = keep and (
            self.width * (d_out + d_in) * itemsize <= self.cost.cache_bytes
        )
        stacked: list[tuple[torch.Tensor, torch.Tensor]] = []
        if not keep:
            left_buf, right_buf = self._buffers(dtype, max(i for _, _, i in ranges))
        coef = self.coefficients.to(self.device, dtype)
        b_shift = None if self.b_shift is None else self.b_shift.to(dtype)
        a_shift = None if self.a_shift is None else self.a_shift.to(dtype)
        for start, stop, inner in ranges:
            if keep:
                left = torch.empty(d_out, inner, dtype=dtype, device=self.device)
                right = torch.empty(inner, d_in, dtype=dtype, device=self.device)
                stacked.append((left, right))
            else:
                left = left_buf[: d_out * inner].view(d_out, inner)
                right = right_buf[: inner * d_in].view(inner, d_in)
            self._fill(left, right, start, stop)
            if self._uniform:
                r = self.ranks[0]
                blocks = left.view(d_out, stop - start, r)
                if b_shift is not None:
                    blocks.sub_(b_shift[:, None, :])
                blocks.mul_(coef[start:stop][None, :, None])
                if a_shift is not None:
                    right.view(stop - start, r, d_in).sub_(a_shift[None])
            else:
                col = 0
                for i in range(start, stop):
                    left[:, col : col + self.ranks[i]].mul_(coef[i])
                    col += self.ranks[i]
            yield left, right
        if keep:
            self._stacked[dtype] = stacked

    def _fill(
        self, left: torch.Tensor, right: torch.Tensor, start: int, stop: int
    ) -> None:
        """Copy clients ``start..stop-1`` into a chunk, a few calls per chunk."""
        bs, as_ = self.bs[start:stop], self.as_[start:stop]
        same = all(t.dtype == left.dtype and t.device == left.device for t in bs + as_)
        if self._uniform and same:
            r = self.ranks[0]
            torch.stack(bs, dim=1, out=left.view(left.shape[0], stop - start, r))
            torch.cat(as_, dim=0, out=right)
            return
        if self._uniform:
            r = self.ranks[0]
            left.view(left.shape[0], stop - start, r).copy_(torch.stack(bs, dim=1))
            right.copy_(torch.cat(as_, dim=0))
            return
        col = 0
        for b, a in zip(bs, as_, strict=True):
            width = int(b.shape[1])
            left[:, col : col + width].copy_(b)
            right[col : col + width].copy_(a)
            col += width

    def _buffers(
        self, dtype: torch.dtype, inner: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat chunk buffers for ``inner`` stacked columns, kept between passes."""
        d_out, d_in = self.shape
        cached = self._chunk_buffers.get(dtype)
        if cached is None or cached[0].numel() < d_out * inner:
            cached = (
                torch.empty(d_out * inner, dtype=dtype, device=self.device),
                torch.empty(inner * d_in, dtype=dtype, device=self.device),
            )
            self._chunk_buffers[dtype] = cached
        return cached

    def release(self) -> None:
        """Free what is kept between passes (rebuilt on the next use)."""
        self._chunk_buffers.clear()
        self._stacked.clear()

    def matmul(self, z: torch.Tensor) -> torch.Tensor:
        """``M @ z``.

        Parameters
        ----------
        z : (d_in, l) torch.Tensor

        Returns
        -------
        (d_out, l) torch.Tensor
            In :attr:`dtype`.
        """
        if z.ndim != 2 or z.shape[0] != self.shape[1]:
            raise ShapeMismatchError(
                f"cannot apply M {self.shape} to a block of shape {tuple(z.shape)}"
            )
        z = z.to(self.device, self.dtype)
        out = z.new_zeros(self.shape[0], z.shape[1])
        for left, right in self.chunks():
            out.addmm_(left, right @ z)
        return out

    def rmatmul(self, y: torch.Tensor) -> torch.Tensor:
        """``M^T @ y``.

        Parameters
        ----------
        y : (d_out, l) torch.Tensor

        Returns
        -------
        (d_in, l) torch.Tensor
            In :attr:`dtype`.
        """
        if y.ndim != 2 or y.shape[0] != self.shape[0]:
            raise ShapeMismatchError(
                f"cannot apply M^T {self.shape[::-1]} to a block of shape "
                f"{tuple(y.shape)}"
            )
        y = y.to(self.device, self.dtype)
        out = y.new_zeros(self.shape[1], y.shape[1])
        for left, right in self.chunks():
            out.addmm_(right.T, left.T @ y)
        return out

    def accumulate(self, out: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        """``out += alpha * M`` in place, one chunk GEMM at a time.

        Parameters
        ----------
        out : (d_out, d_in) torch.Tensor
            Accumulated in its own dtype.
        alpha : float

        Returns
        -------
        torch.Tensor
            ``out``.
        """
        if tuple(out.shape) != self.shape:
            raise ShapeMismatchError(
                f"buffer has shape {tuple(out.shape)}, the sum has {self.shape}"
            )
        for left, right in self.chunks(out.dtype, keep=False):
            out.addmm_(left, right, alpha=alpha)
        self.release()  # a one-pass use: do not keep the chunk buffer
        return out

    def dense(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``M`` as one dense (d_out, d_in) matrix, accumulated in place."""
        out = torch.zeros(
            self.shape, dtype=self.dtype if dtype is None else dtype, device=self.device
        )
        return self.accumulate(out)


def dense_mean_of_products(
    bs: Sequence[torch.Tensor],
    as_: Sequence[torch.Tensor],
    weights: Sequence[float] | torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    alpha: float = 1.0,
    dtype: torch.dtype | None = None,
    cost: CostModel | None = None,
) -> torch.Tensor:
    """``out += alpha * sum_i w_i B_i A_i`` in one buffer (the streaming dense path).

    Clients are stacked a chunk at a time (:class:`ProductSum`) and each
    chunk is one ``addmm_`` into the buffer: ``O(d_out d_in k r)`` flops, extra
    memory one chunk, nothing per client.

    Parameters
    ----------
    bs : k tensors (d_out, r)
    as_ : k tensors (r, d_in)
    weights : (k,) sequence of float
        Normalised internally.
    out : (d_out, d_in) torch.Tensor, optional
        Accumulated into in place; default a new zero matrix.
    alpha : float, default 1.0
    dtype : torch.dtype, optional
        Of a new ``out``; default float64 if a factor is float64, else float32.
    cost : CostModel, optional
        Chunk sizes.

    Returns
    -------
    (d_out, d_in) torch.Tensor
        ``out``.
    """
    check_factors(bs, as_)
    w = normalise_weights(weights, len(bs))
    op = ProductSum(bs, as_, w, dtype=dtype, cost=cost)
    if out is None:
        out = torch.zeros(op.shape, dtype=op.dtype, device=op.device)
    return op.accumulate(out, alpha)


@dataclass(frozen=True)
class FrobeniusEstimate:
    """A Hutch++ estimate of ``||M||_F^2``.

    Attributes
    ----------
    value : float
        The estimate: ``||Q^T M||_F^2`` (exact) plus the probes' mean of
        ``||(I - Q Q^T) M g_j||^2``.
    error : float
        ``CostModel.error_sigmas`` standard errors of the probe mean,
        estimated from the probes' spread (same units as ``value``).
    exact_part : float
        ``||Q^T M||_F^2`` for the deflation basis ``Q``.
    probes : int
        Number of Gaussian probes ``s``.
    """

    value: float
    error: float
    exact_part: float
    probes: int


def estimate_frobenius_sq(
    op: ProductSum,
    *,
    cost: CostModel | None = None,
    seed: int = 0,
    extra: torch.Tensor | None = None,
) -> tuple[FrobeniusEstimate, torch.Tensor]:
    """Hutch++ estimate of ``||M||_F^2`` from two streamed passes.

    1. One pass ``M [Omega, G, extra]`` with Gaussian ``Omega`` (d_in, l) for
       deflation (``l = CostModel.deflation``) and ``G`` (d_in, s) probes.
    2. ``Q = qr(M Omega)``; a second pass gives ``M^T Q``, hence the exact part
       ``||Q^T M||_F^2``.
    3. The residual ``(I - Q Q^T) M G = M G - Q (Q^T M) G`` gives
       ``s`` independent unbiased samples ``||(I - Q Q^T) M g_j||^2`` of the
       remaining energy; their mean is added, and their standard error
       (``sqrt(var / s)``) bounds the estimate's error.

    Deflating the leading directions first leaves a flatter residual
    spectrum, which is what Gaussian probes estimate well: with residual
    singular values ``tau``, the variance of the mean is
    ``2 sum tau^4 / s <= 2 tau_1^2 sum tau^2 / s``.

    Parameters
    ----------
    op : ProductSum
        ``M`` (d_out, d_in).
    cost : CostModel, optional
        ``deflation``, ``probes``, ``error_sigmas``.
    seed : int, default 0
    extra : (d_in, e) torch.Tensor, optional
        Further columns to multiply by ``M`` in the first pass.

    Returns
    -------
    estimate : FrobeniusEstimate
    extra_product : (d_out, e) torch.Tensor
        ``M @ extra`` (``e = 0`` columns without ``extra``).
    """
    cost = cost if cost is not None else DEFAULT_COST_MODEL
    d_out, d_in = op.shape
    ell = max(0, min(cost.deflation, d_out, d_in, op.width))
    s = cost.probes
    gen = torch.Generator().manual_seed(seed)
    omega = torch.randn(d_in, ell + s, generator=gen, dtype=torch.float64)
    block = [omega.to(op.device, op.dtype)]
    if extra is not None:
        block.append(extra.to(op.device, op.dtype))
    y = op.matmul(torch.cat(block, dim=1))
    probes = y[:, ell : ell + s]
    g = block[0][:, ell:]
    exact = 0.0
    if ell > 0:
        q = torch.linalg.qr(y[:, :ell]).Q
        qtm = op.rmatmul(q)  # (d_in, l): (Q^T M)^T
        exact = float(torch.linalg.vector_norm(qtm.double()) ** 2)
        probes = probes - q @ (qtm.T @ g)
    op.release()
    samples = (probes.double() ** 2).sum(dim=0)
    mean = float(samples.mean())
    spread = float(samples.std()) if s > 1 else 0.0
    error = cost.error_sigmas * spread / math.sqrt(s)
    estimate = FrobeniusEstimate(
        value=exact + mean, error=error, exact_part=exact, probes=s
    )
    return estimate, y[:, ell + s :]


class StreamedResidual:
    """One layer's FedEx residual, streamed: the many-client twin of StackedResidual.

    ``X = sum_i w_i B_i A_i - B_bar A_bar = sum_i w_i (B_i - B_bar)(A_i - A_bar)``
    is applied chunk by chunk (:class:`ProductSum`), never stacked whole.
    :meth:`fold` accumulates ``X`` in one ``d_out x d_in`` buffer (the GEMM the
    fold needs anyway), measures both norms exactly from it, then turns the
    buffer into ``W0 + scaling X`` in place. Without a fold, :meth:`gap_norms`
    takes the cheaper of that dense pass and a Hutch++ estimate
    (:meth:`CostModel.frobenius_norms`), and says which.

    Parameters
    ----------
    bs : k tensors (d_out, r)
    as_ : k tensors (r, d_in)
    weights : (k,) sequence of float
        Normalised internally.
    cost : CostModel, optional
    seed : int, default 0
        Of the estimate's probes.

    Attributes
    ----------
    b_bar : (d_out, r) torch.Tensor
        float64 ``sum_i w_i B_i``.
    a_bar : (r, d_in) torch.Tensor
        float64 ``sum_i w_i A_i``.
    rank : int
        ``r``.
    work_dtype : torch.dtype
        float64 if any client factor was float64, else float32.
    """

    def __init__(
        self,
        bs: Sequence[torch.Tensor],
        as_: Sequence[torch.Tensor],
        weights: Sequence[float] | torch.Tensor,
        *,
        cost: CostModel | None = None,
        seed: int = 0,
    ) -> None:
        _, self.rank, _ = check_factors(bs, as_)
        w = normalise_weights(weights, len(bs))
        self.cost = cost if cost is not None else DEFAULT_COST_MODEL
        self.seed = seed
        self.work_dtype = work_dtype(*bs, *as_)
        self.b_bar = _weighted_sum(bs, w)
        self.a_bar = _weighted_sum(as_, w)
        self.centered = ProductSum(
            bs,
            as_,
            w,
            b_shift=self.b_bar,
            a_shift=self.a_bar,
            dtype=self.work_dtype,
            cost=self.cost,
        )
        self._norms: GapNorms | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """``(d_out, d_in)``."""
        return self.centered.shape

    def _gap_norms(
        self, gap_sq: float, x_abar: torch.Tensor, *, error: float | None = None
    ) -> GapNorms:
        """Both norms from ``||X||^2`` and ``X A_bar^T`` (d_out, r): ``||M||^2 =
        ||X||^2 + 2<X, B_bar A_bar> + ||B_bar A_bar||^2``; ``error`` the bound of
        an estimated ``||X||^2``."""
        cross = float((self.b_bar * x_abar.double()).sum())
        bar_sq = factored_frobenius_norm(self.b_bar, self.a_bar) ** 2
        ref_sq = gap_sq + 2.0 * cross + bar_sq
        return GapNorms(
            math.sqrt(gap_sq),
            math.sqrt(max(ref_sq, 0.0)),
            estimated=error is not None,
            gap_sq_error=0.0 if error is None else error,
        )

    def _exact_norms(self, x: torch.Tensor) -> GapNorms:
        """Both norms from the dense residual ``x``."""
        gap_sq = float(torch.linalg.vector_norm(x)) ** 2
        return self._gap_norms(gap_sq, x @ self.a_bar.T.to(x.dtype))

    def norms_path(self) -> PathChoice:
        """How :meth:`gap_norms` would measure the norms without a fold."""
        d_out, d_in = self.shape
        return self.cost.frobenius_norms(
            self.centered.num_clients,
            self.rank,
            d_out,
            d_in,
            dtype_bytes=torch.empty((), dtype=self.work_dtype).element_size(),
        )

    def gap_norms(self) -> GapNorms:
        """``||X||_F`` and ``||M||_F``: exact after :meth:`fold`, else by cost model.

        Returns
        -------
        GapNorms
            ``estimated`` with an error bound when the Hutch++ path was taken.
        """
        if self._norms is not None:
            return self._norms
        if self.norms_path().path == DENSE:
            self._norms = self._exact_norms(self.centered.dense())
            return self._norms
        est, x_abar = estimate_frobenius_sq(
            self.centered, cost=self.cost, seed=self.seed, extra=self.a_bar.T
        )
        self._norms = self._gap_norms(max(est.value, 0.0), x_abar, error=est.error)
        return self._norms

    def norms(self) -> tuple[float, float]:
        """``(gap, reference)`` of :meth:`gap_norms`."""
        return self.gap_norms().pair

    def fold(
        self, base_weight: torch.Tensor, scaling: float, *, transposed: bool = False
    ) -> torch.Tensor:
        """``W0 + scaling X`` with one buffer; records the exact norms.

        Parameters
        ----------
        base_weight : (d_out, d_in) torch.Tensor
            Or (d_in, d_out) with ``transposed``.
        scaling : float
        transposed : bool, default False
            ``W0`` is stored (d_in, d_out) (GPT-2's ``Conv1D``, peft's
            ``fan_in_fan_out``): ``W0 + scaling X^T``.

        Returns
        -------
        torch.Tensor
            ``base_weight``'s shape, dtype and device; the input is not
            modified. Accumulated in float64 if the base weight or any client
            factor is float64, else in float32.
        """
        dtype = _fold_dtype(base_weight, self.shape, self.work_dtype, transposed)
        x = self.centered.dense(dtype)
        self._norms = self._exact_norms(x)
        if transposed:
            x = x.T  # a view: the buffer is reused, then made contiguous below
        x.mul_(float(scaling)).add_(base_weight.to(x.device, dtype))
        folded = x.to(base_weight.dtype)
        return folded.contiguous() if transposed else folded


def _weighted_sum(tensors: Sequence[torch.Tensor], w: torch.Tensor) -> torch.Tensor:
    """``sum_i w_i t_i`` in float64 (:func:`fedlr.linalg.weighted_mean`)."""
    return weighted_mean(tensors, w, dtype=torch.float64)


def _all_same(tensors: Sequence[torch.Tensor]) -> bool:
    first = tensors[0]
    return all(t is first for t in tensors) or all(
        t.dtype == first.dtype and torch.equal(t, first) for t in tensors
    )


def aggregate_gap(
    bs: Sequence[torch.Tensor],
    as_: Sequence[torch.Tensor],
    weights: Sequence[float] | torch.Tensor,
    b_agg: torch.Tensor,
    a_agg: torch.Tensor,
    *,
    cost: CostModel | None = None,
    seed: int = 0,
) -> GapNorms:
    """``||sum_i w_i B_i A_i - B_agg A_agg||_F`` and ``||sum_i w_i B_i A_i||_F``.

    Paths, cheapest adequate first:

    * every ``A_i`` the same (FedSVD, FFA-LoRA: ``A`` is shared) or every
      ``B_i`` the same: ``M = B_bar A`` (or ``B A_bar``) exactly, so both norms
      come from ``2 r``-wide factors, whatever ``k``;
    * otherwise by :meth:`CostModel.aggregate_gap`: the stacked factors'
      QR norms (``factored``), a float64 dense accumulation of ``M`` then
      ``M - B_agg A_agg`` in the same buffer (``dense``), or two Hutch++
      estimates (``randomized``, flagged ``estimated``).

    Parameters
    ----------
    bs : k tensors (d_out, r)
    as_ : k tensors (r, d_in)
    weights : (k,) sequence of float
        Normalised internally.
    b_agg : (d_out, r') torch.Tensor
    a_agg : (r', d_in) torch.Tensor
    cost : CostModel, optional
    seed : int, default 0

    Returns
    -------
    GapNorms
    """
    d_out, r, d_in = check_factors(bs, as_)
    if (
        b_agg.ndim != 2
        or a_agg.ndim != 2
        or b_agg.shape[0] != d_out
        or a_agg.shape[1] != d_in
        or b_agg.shape[1] != a_agg.shape[0]
    ):
        raise ShapeMismatchError(
            f"aggregate B {tuple(b_agg.shape)} and A {tuple(a_agg.shape)} do not "
            f"give a ({d_out}, {d_in}) product"
        )
    w = normalise_weights(weights, len(bs))
    b64, a64 = b_agg.double(), a_agg.double()
    if _all_same(as_) or _all_same(bs):
        if _all_same(as_):
            left, right = _weighted_sum(bs, w), as_[0].double()
        else:
            left, right = bs[0].double(), _weighted_sum(as_, w)
        return _factored_gap(left, right, b64, a64)
    cost = cost if cost is not None else DEFAULT_COST_MODEL
    path = cost.aggregate_gap(len(bs), r, int(b_agg.shape[1]), d_out, d_in).path
    if path == FACTORED:
        left, right = mean_of_products_factors(bs, as_, w)
        return _factored_gap(left, right, b64, a64)
    if path == DENSE:
        m = ProductSum(bs, as_, w, dtype=torch.float64, cost=cost).dense()
        reference = float(torch.linalg.vector_norm(m))
        m.addmm_(b64, a64, alpha=-1.0)
        return GapNorms(float(torch.linalg.vector_norm(m)), reference)
    return _estimated_gap(bs, as_, w, b_agg, a_agg, cost, seed)


def _factored_gap(
    left: torch.Tensor, right: torch.Tensor, b64: torch.Tensor, a64: torch.Tensor
) -> GapNorms:
    """``||left right - B A||_F`` and ``||left right||_F`` from stacked factors."""
    return GapNorms(
        factored_frobenius_norm(
            torch.cat([left, -b64], dim=1), torch.cat([right, a64], dim=0)
        ),
        factored_frobenius_norm(left, right),
    )


def _estimated_gap(
    bs: Sequence[torch.Tensor],
    as_: Sequence[torch.Tensor],
    w: torch.Tensor,
    b_agg: torch.Tensor,
    a_agg: torch.Tensor,
    cost: CostModel,
    seed: int,
) -> GapNorms:
    """The gap and the mean's norm estimated by randomized trace estimates
    (seeds ``seed``, ``seed + 1``) of streamed product sums."""
    dtype = work_dtype(*bs, *as_)
    mean = ProductSum(bs, as_, w, dtype=dtype, cost=cost)
    diff = ProductSum(
        [*bs, b_agg],
        [*as_, a_agg],
        torch.cat([w, -torch.ones(1, dtype=w.dtype)]),
        dtype=dtype,
        cost=cost,
    )
    ref, _ = estimate_frobenius_sq(mean, cost=cost, seed=seed)
    gap, _ = estimate_frobenius_sq(diff, cost=cost, seed=seed + 1)
    return GapNorms(
        math.sqrt(max(gap.value, 0.0)),
        math.sqrt(max(ref.value, 0.0)),
        estimated=True,
        gap_sq_error=gap.error,
    )
