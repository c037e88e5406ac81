"""Which path an aggregation kernel takes: a cost model, not a user flag.

Every server kernel on ``k`` clients' LoRA factors ``B_i`` (d_out, r) and
``A_i`` (r, d_in) has up to three ways to reach its result (``p = k r``):

``factored``
    QR of the stacked factors and an SVD (or norm) of the small core.
    Exact; ``O((d_out + d_in) p min(d, p))`` flops and ``O((d_out + d_in) p)``
    memory in float64: quadratic in ``k`` while ``p <= d``, and its ``p x p``
    core alone is ``8 p^2`` bytes.
``dense`` (``gram`` for Global SVD)
    The ``d_out x d_in`` matrix accumulated in place, client chunk by client
    chunk (one buffer), then a dense SVD, eigendecomposition or norm. Exact;
    ``O(d_out d_in p)`` flops, linear in ``k``; the dense decomposition adds
    ``O(d^3)``, so it only pays for small ``d``.
``randomized``
    A randomized range finder (Halko, Martinsson, Tropp) or trace estimator
    (Hutch++) that touches each client's factors a few times with a thin
    block of ``l`` columns: ``O(p (d_out + d_in) l)`` flops and
    ``O((d_out + d_in) l)`` memory. An approximation, flagged as such by the
    kernels that return it.

:meth:`CostModel.choose` keeps the reference exact path (``factored``)
while it is cheap in absolute terms (:attr:`CostModel.cheap_flops`) and fits
:attr:`CostModel.memory_budget`; else it takes the cheapest exact path that
fits if it is not dearer than ``exact_ratio`` times the randomized path;
otherwise the randomized path. Costs are counted in
"float32 GEMM flop equivalents": raw flop counts weighted by how much slower
than a large float32 GEMM each operation runs (QR, SVD, eigh, thin GEMMs,
float64), measured on a 2-core x86 CPU with torch 2.13 (see
``benchmarks/bench_scale.py``). Only ratios between paths matter, so the
weights need to be right within a small factor, not exactly.

References
----------
.. [1] Halko, Martinsson, Tropp, "Finding structure with randomness:
   probabilistic algorithms for constructing approximate matrix
   decompositions", SIAM Review 53(2), 2011.
.. [2] Meyer, Musco, Musco, Woodruff, "Hutch++: optimal stochastic trace
   estimation", SOSA 2021.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_COST_MODEL",
    "DENSE",
    "FACTORED",
    "GRAM",
    "RANDOMIZED",
    "CostModel",
    "PathChoice",
    "PathCost",
]

FACTORED = "factored"
DENSE = "dense"
GRAM = "gram"
RANDOMIZED = "randomized"

_F64 = 8  # bytes per float64


@dataclass(frozen=True)
class PathCost:
    """Estimated cost of one path.

    Attributes
    ----------
    flops : float
        Float32-GEMM flop equivalents.
    nbytes : float
        Peak extra memory of its intermediates, in bytes.
    exact : bool
        Whether the path's result is exact (up to rounding).
    """

    flops: float
    nbytes: float
    exact: bool


@dataclass(frozen=True)
class PathChoice:
    """A chosen path and the costs it was chosen from.

    Attributes
    ----------
    path : str
        One of ``"factored"``, ``"dense"``, ``"gram"``, ``"randomized"``.
    costs : mapping of str to PathCost
        Every candidate's estimate (for logs and tests).
    """

    path: str
    costs: Mapping[str, PathCost] = field(default_factory=dict)

    @property
    def exact(self) -> bool:
        """Whether the chosen path is exact."""
        return self.costs[self.path].exact if self.path in self.costs else True


@dataclass(frozen=True)
class CostModel:
    """Flop and memory estimates of each kernel's paths, and the rule between them.

    Attributes
    ----------
    cheap_flops : float, default 1.6e10
        An exact path at most this dear is always taken (about 0.25 s on two
        cores): exact where exact is cheap.
    exact_ratio : float, default 1.0
        Above ``cheap_flops``, an exact path is still taken if it costs at most
        this times the randomized one.
    memory_budget : int, default 512 MiB
        Largest intermediate (stacked float64 factors, their QR, a ``k r``
        core, a dense ``d x d`` buffer and its decomposition) an exact path may
        allocate.
    chunk_bytes : int, default 64 MiB
        Size of one chunk of stacked client factors in the streamed paths.
    max_chunk_rank : int, default 2048
        Largest inner size ``c r`` of one chunk (GEMM efficiency saturates).
    cache_bytes : int, default 1 GiB
        A multi-pass streamed kernel keeps its stacked chunks between passes
        (one copy of the factors) while they take at most this many bytes.
    oversample : int, default 10
        Randomized range finder: columns beyond the target rank.
    power_iterations : int, default 2
        Randomized range finder: passes with ``M^T`` then ``M`` after the first.
    probes : int, default 32
        Gaussian probes of the Hutch++ residual-energy estimate.
    deflation : int, default 16
        Range-finder columns the Frobenius-norm estimate deflates first.
    error_sigmas : float, default 3.0
        An estimate's error bound is this many standard errors (estimated from
        the probes' spread).
    thin, qr, svd, eigh, float64 : float
        Slowdowns against a large float32 GEMM: thin GEMMs (``<= 128``
        columns), Householder QR per flop, SVD per ``m n min(m, n)``, symmetric
        eigendecomposition per ``n^3``, float64 arithmetic.
    only : frozenset of str, optional
        Restrict the candidates to these paths (tests and benchmarks compare
        paths this way; the strategies never set it).
    """

    cheap_flops: float = 1.6e10
    exact_ratio: float = 1.0
    memory_budget: int = 512 * 2**20
    chunk_bytes: int = 64 * 2**20
    max_chunk_rank: int = 2048
    cache_bytes: int = 2**30
    oversample: int = 10
    power_iterations: int = 2
    probes: int = 32
    deflation: int = 16
    error_sigmas: float = 3.0
    thin: float = 3.0
    qr: float = 6.0
    svd: float = 80.0
    eigh: float = 25.0
    float64: float = 2.5
    only: frozenset[str] | None = None

    def __post_init__(self) -> None:
        for name in ("cheap_flops", "exact_ratio", "thin", "qr", "svd", "eigh"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("memory_budget", "chunk_bytes", "max_chunk_rank", "probes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.probes < 2:
            raise ValueError(f"probes must be >= 2 (a spread), got {self.probes}")
        for name in ("oversample", "power_iterations", "deflation"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    # ------------------------------------------------------------ primitives
    def qr_flops(self, m: int, n: int, *, with_q: bool = True) -> float:
        """Householder QR of an (m, n) matrix (reduced), ``Q`` formed or not."""
        small, large = min(m, n), max(m, n)
        flops = 2.0 * large * small * small - 2.0 / 3.0 * small**3
        return self.qr * flops * (2.0 if with_q else 1.0)

    def svd_flops(self, m: int, n: int) -> float:
        """SVD with singular vectors of an (m, n) matrix."""
        return self.svd * m * n * min(m, n)

    def pass_flops(self, p: int, d_out: int, d_in: int, columns: int) -> float:
        """``columns`` thin products with ``M`` or ``M^T`` from ``p``-wide factors."""
        return self.thin * 2.0 * p * (d_out + d_in) * columns

    def sketch_rank(self, rank: int, d_out: int, d_in: int, p: int) -> int:
        """Columns ``l = min(rank + oversample, d_out, d_in, p)`` of a range finder."""
        return max(1, min(rank + self.oversample, d_out, d_in, p))

    # ---------------------------------------------------------- the decision
    def choose(self, costs: Mapping[str, PathCost]) -> PathChoice:
        """The path by the rule of the module docstring.

        1. The first exact path (in ``costs``' order: the reference path
           first) that fits the memory budget and costs at most
           ``cheap_flops``.
        2. Else the cheapest exact path that fits, if it costs at most
           ``exact_ratio`` times the cheapest approximate path (or there is
           none).
        3. Else the cheapest approximate path; else the cheapest exact one.

        Parameters
        ----------
        costs : mapping of path name to PathCost
            At least one path, the preferred exact path first.
        """
        if self.only is not None:
            costs = {n: c for n, c in costs.items() if n in self.only}
        if not costs:
            raise ValueError("no candidate paths")
        exact = {n: c for n, c in costs.items() if c.exact}
        approx = {n: c for n, c in costs.items() if not c.exact}
        fitting = {n: c for n, c in exact.items() if c.nbytes <= self.memory_budget}
        for name, c in fitting.items():
            if c.flops <= self.cheap_flops:
                return PathChoice(name, dict(costs))
        best_approx = min(approx, key=lambda n: approx[n].flops) if approx else None
        if fitting:
            best = min(fitting, key=lambda n: fitting[n].flops)
            if (
                best_approx is None
                or fitting[best].flops <= self.exact_ratio * approx[best_approx].flops
            ):
                return PathChoice(best, dict(costs))
        if best_approx is not None:
            return PathChoice(best_approx, dict(costs))
        return PathChoice(min(exact, key=lambda n: exact[n].flops), dict(costs))

    # ------------------------------------------------------ kernel estimates
    def svd_of_mean(
        self, k: int, r: int, d_out: int, d_in: int, rank: int
    ) -> PathChoice:
        """Path of the rank-``rank`` truncated SVD of ``sum_i w_i B_i A_i``."""
        p = k * r
        m_o, m_i = min(d_out, p), min(d_in, p)
        factored = PathCost(
            flops=self.float64
            * (
                self.qr_flops(d_out, p)
                + self.qr_flops(d_in, p)
                + 2.0 * m_o * m_i * p
                + self.svd_flops(m_o, m_i)
            ),
            nbytes=_F64
            * (2.0 * (d_out + d_in) * p + (m_o + m_i) * p + 3.0 * m_o * m_i),
            exact=True,
        )
        dense = PathCost(
            flops=self.float64 * (2.0 * d_out * d_in * p + self.svd_flops(d_out, d_in)),
            nbytes=_F64 * 3.0 * d_out * d_in,
            exact=True,
        )
        ell = self.sketch_rank(rank, d_out, d_in, p)
        columns = ell + self.probes + (2 * self.power_iterations + 1) * ell
        randomized = PathCost(
            flops=self.pass_flops(p, d_out, d_in, columns)
            + self.float64 * self.svd_flops(ell, d_in),
            nbytes=self.chunk_bytes + _F64 * 3.0 * (d_out + d_in) * (ell + self.probes),
            exact=False,
        )
        return self.choose({FACTORED: factored, DENSE: dense, RANDOMIZED: randomized})

    def factored_norms(self, p: int, d_out: int, d_in: int) -> PathCost:
        """Two factored Frobenius norms of ``p``-wide stacks (a gap and its reference).

        ``p = (k + 1) r`` for FedEx's residual, ``k r + r_agg`` for an
        aggregate's gap.
        """
        m_o, m_i = min(d_out, p), min(d_in, p)
        return PathCost(
            flops=self.float64
            * 2.0
            * (
                self.qr_flops(d_out, p, with_q=False)
                + self.qr_flops(d_in, p, with_q=False)
                + 2.0 * m_o * m_i * p
            ),
            nbytes=_F64 * (3.0 * (d_out + d_in) * p + m_o * m_i),
            exact=True,
        )

    def residual(self, k: int, r: int, d_out: int, d_in: int) -> PathChoice:
        """Stacked (``factored``) or streamed (``dense``) FedEx residual.

        The stacked residual is kept while its norms are cheap and its float64
        stacks fit the memory budget; the streamed residual folds in place and
        measures its norms exactly from the fold's buffer, or by
        :meth:`frobenius_norms` when there is no fold.
        """
        factored = self.factored_norms((k + 1) * r, d_out, d_in)
        streamed = PathCost(
            flops=2.0 * d_out * d_in * k * r,
            nbytes=self.chunk_bytes + 4.0 * d_out * d_in,
            exact=True,
        )
        allowed = self.only is None or FACTORED in self.only
        if (
            allowed
            and factored.flops <= self.cheap_flops
            and factored.nbytes <= self.memory_budget
        ):
            return PathChoice(FACTORED, {FACTORED: factored, DENSE: streamed})
        return PathChoice(DENSE, {FACTORED: factored, DENSE: streamed})

    def frobenius_norms(
        self, k: int, r: int, d_out: int, d_in: int, *, dtype_bytes: int = 4
    ) -> PathChoice:
        """Norms of a streamed mean of products: ``dense`` or ``randomized``."""
        p = k * r
        scale = self.float64 if dtype_bytes == _F64 else 1.0
        dense = PathCost(
            flops=scale * 2.0 * d_out * d_in * p,
            nbytes=dtype_bytes * d_out * d_in + self.chunk_bytes,
            exact=True,
        )
        columns = 2 * self.deflation + self.probes + r
        randomized = PathCost(
            flops=scale * self.pass_flops(p, d_out, d_in, columns),
            nbytes=self.chunk_bytes + _F64 * (d_out + d_in) * columns,
            exact=False,
        )
        return self.choose({DENSE: dense, RANDOMIZED: randomized})

    def aggregate_gap(
        self, k: int, r: int, r_agg: int, d_out: int, d_in: int
    ) -> PathChoice:
        """Path of ``||sum_i w_i B_i A_i - B_agg A_agg||_F`` and ``||M||_F``."""
        p = k * r + r_agg
        factored = self.factored_norms(p, d_out, d_in)
        dense = PathCost(
            flops=self.float64 * 2.0 * d_out * d_in * p,
            nbytes=_F64 * d_out * d_in + self.chunk_bytes,
            exact=True,
        )
        columns = 2 * (2 * self.deflation + self.probes)
        randomized = PathCost(
            flops=self.pass_flops(p, d_out, d_in, columns),
            nbytes=self.chunk_bytes + _F64 * (d_out + d_in) * columns,
            exact=False,
        )
        return self.choose({FACTORED: factored, DENSE: dense, RANDOMIZED: randomized})

    def updates_svd(
        self, k: int, r: int, d_out: int, d_in: int, rank: int
    ) -> PathChoice:
        """Path of Global SVD's SVD of ``[sqrt(w_i) (B_i A_i)^T]_i`` (d_in, k d_out)."""
        p = k * r
        m = min(d_in, p)
        n_c = k * min(d_out, r)
        grams = 2.0 * k * r * r * d_out
        factored = PathCost(
            flops=self.float64
            * (
                self.qr_flops(d_in, p)
                + k * self.qr_flops(d_out, r)
                + 2.0 * m * r * p
                + self.svd_flops(m, n_c)
            ),
            nbytes=_F64 * (2.0 * d_in * p + 3.0 * m * n_c + m * m),
            exact=True,
        )
        gram = PathCost(
            flops=self.float64
            * (grams + 2.0 * d_in * d_in * p + self.eigh * float(d_in) ** 3),
            nbytes=_F64 * 3.0 * d_in * d_in + self.chunk_bytes,
            exact=True,
        )
        ell = self.sketch_rank(rank, d_in, d_in, p)
        applications = self.power_iterations + 2
        randomized = PathCost(
            flops=self.float64 * grams
            + self.thin * 4.0 * p * d_in * ell * applications,
            nbytes=self.chunk_bytes + _F64 * 4.0 * d_in * ell,
            exact=False,
        )
        return self.choose({FACTORED: factored, GRAM: gram, RANDOMIZED: randomized})


DEFAULT_COST_MODEL = CostModel()
