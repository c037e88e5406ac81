"""SORF-VeRA costs: FWHT vs a dense S, and the adapter vs peft's VeRA.

1. ``S x`` for a batch of 64 vectors at ``n = 4096``: the fast Walsh-Hadamard
   path (:func:`fedlr.linalg.sorf.sorf_apply`) against the dense reference
   (``S = D1 H D2 H D3`` built as a 4096 x 4096 matrix, then one GEMM). Time
   ratio (dense / FWHT, building S included, as a client without the FWHT
   would have to) and also the GEMM alone with S prebuilt (best call of
   bursts alternating between the two, so a passing load hits both sides),
   with fresh and with reused allocations (see :func:`sorf_apply_case`).
   Peak memory comes
   from torch's profiler memory events (``profile_memory=True``: allocations
   and frees in time order, maximum of the running sum); torch's CPU allocator
   is invisible to ``tracemalloc``.
2. A forward (and a forward + backward) pass of MiniLM with SORF-VeRA layers
   against the same model with peft's VeRA at the same rank, batch 16 x 64
   tokens; the ratio SORF-VeRA / VeRA.
3. The server refit of one square layer (:func:`fedlr.linalg.refit_layer`,
   rank 16, float32 tensors as the strategy passes them) with the FWHT fit of
   ``b`` (:func:`fedlr.linalg.fit_b`: CGLS, or closed form when ``d_out`` is
   a power of two) against the same refit with the former dense fit
   (``_fit_b_dense``: ``d x d`` normal equations and an eigendecomposition),
   in the same process, alternating; the ratio dense / FWHT and the largest
   relative difference of the refit ``b``.
4. The sign choice of the singular pairs before the refit
   (:func:`fedlr.linalg.sorf_refit.choose_pair_signs`): the mean relative
   refit gap ``||Delta W_new - Delta W||_F / ||Delta W||_F`` over seeded
   layers with the former fixed rule (``"peak"``), the default search
   (``"gap"``: float32 Jacobi model), and the search on the exact float64
   model; the time of the search alone against one refit (alternating, best
   call); and, on a small layer, the range over all ``2^r`` patterns by brute
   force.

Run: ``python -m benchmarks.bench_sorf [apply] [forward] [refit] [signs]`` (no
argument: all four; or ``make bench``).
"""

from __future__ import annotations

import ctypes
import math
import sys
import time
from collections.abc import Callable, Sequence

import torch

from fedlr.linalg.sorf import (
    PolarFactor,
    SorfSigns,
    _fit_b_dense,
    build_lambda_d_rot,
    fwht,
    polar_factor,
    polar_target,
    sorf_apply,
    sorf_signs,
)
from fedlr.linalg.sorf_pair_signs import SignSearch, choose_pair_signs
from fedlr.linalg.sorf_refit import (
    LayerRefit,
    mean_lambda_d_rot,
    refit_layer,
    sorf_left,
)
from fedlr.linalg.svd import TruncatedSVD, factored_svd

N, BATCH = 4096, 64
REFIT_DIMS = (768, 3072, 4000, 4096)
REFIT_RANK = 16
# (d_out, d_in, rank, layers): the default model's 12 query/value layers,
# a wider one, and the small shapes of the cross-check (exhaustive search)
SIGN_CASES = ((384, 384, 16, 12), (768, 768, 16, 6), (24, 24, 6, 20), (16, 16, 6, 20))


def _time(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _paired(
    fast: Callable[[], object],
    slow: Callable[[], object],
    rounds: int,
    calls: int = 5,
) -> tuple[float, float]:
    """Best times of ``fast`` and ``slow``, run in alternating bursts.

    Each of ``rounds`` rounds times ``calls`` back-to-back calls of one, then of
    the other. Alternating keeps a load that comes and goes (another process on
    the same cores) from landing on one side of the ratio only; bursts let each
    side run as it would in a loop (warm caches, reused allocations); the best
    call is the least disturbed one (as ``timeit`` advises).
    """
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for side, fn in enumerate((fast, slow)):
            for _ in range(calls):
                start = time.perf_counter()
                fn()
                best[side] = min(best[side], time.perf_counter() - start)
    return best[0], best[1]


def dense_sorf(n: int, seed: int) -> torch.Tensor:
    """``D1 H D2 H D3`` as a dense (n, n) float32 matrix (the reference)."""
    signs = sorf_signs(n, seed)
    h = fwht(torch.eye(n))  # normalised Hadamard matrix, symmetric
    return (signs.d1[:, None] * h) @ (signs.d2[:, None] * h) * signs.d3


def peak_mib(fn: Callable[[], object]) -> float:
    """Peak of allocated minus freed CPU memory while ``fn`` runs, in MiB.

    From torch's profiler memory events (``profile_memory=True``): every op's
    own allocations and every free, in time order; the running sum's maximum.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []
    for e in prof.events():
        usage = e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        events.append((e.time_range.start, usage))
    events.sort()
    current = peak = 0
    for _, usage in events:
        current += usage
        peak = max(peak, current)
    return peak / 2**20


def set_malloc_mmap_threshold(size: int) -> bool:
    """Fix glibc's mmap threshold at ``size`` bytes (and trim at 4x); False if no glibc.

    glibc serves a block of at least the threshold (128 KiB at start, raised
    as such blocks are freed, up to 32 MiB) by a fresh ``mmap``, so every call
    that allocates a 1 MiB tensor pays page faults on all its pages. A long
    training process soon raises the threshold past its tensors' sizes; a
    fresh benchmark process has not. The benchmark measures both states.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, size)) and bool(
        mallopt(m_trim_threshold, 4 * size)
    )


def sorf_apply_case() -> dict[str, float]:
    """Time and peak memory of S x by FWHT and by a dense S.

    The FWHT makes about nine (batch, n) temporaries per call, the dense GEMM
    one, so the time of page faults on fresh allocations weighs on the FWHT:
    timed once with glibc's initial mmap threshold fixed (every 1 MiB
    temporary a fresh mapping: the worst case) and once with the threshold at
    32 MiB, the steady state of a training process.
    """
    x = torch.randn(BATCH, N)
    signs = sorf_signs(N, 0)
    t_dense_build = _time(lambda: x @ dense_sorf(N, 0).T, 2)
    s = dense_sorf(N, 0)
    glibc = set_malloc_mmap_threshold(128 * 1024)
    t_fwht_cold, t_dense_cold = _paired(
        lambda: sorf_apply(signs, x), lambda: x @ s.T, 20
    )
    if glibc:
        set_malloc_mmap_threshold(32 * 2**20)
    t_fwht, t_dense_gemm = _paired(lambda: sorf_apply(signs, x), lambda: x @ s.T, 20)
    err = float((sorf_apply(signs, x) - x @ s.T).abs().max())
    return {
        "glibc": float(glibc),
        "fwht_cold_ms": 1e3 * t_fwht_cold,
        "dense_gemm_cold_ms": 1e3 * t_dense_cold,
        "speedup_vs_gemm_cold": t_dense_cold / t_fwht_cold,
        "fwht_ms": 1e3 * t_fwht,
        "dense_build_and_apply_ms": 1e3 * t_dense_build,
        "dense_gemm_only_ms": 1e3 * t_dense_gemm,
        "speedup_vs_build": t_dense_build / t_fwht,
        "speedup_vs_gemm": t_dense_gemm / t_fwht,
        "max_abs_err": err,
        "fwht_peak_mib": peak_mib(lambda: sorf_apply(signs, x)),
        "dense_peak_mib": peak_mib(lambda: x @ dense_sorf(N, 0).T),
    }


def forward_case(rank: int = 16) -> dict[str, float]:
    """MiniLM forward (and train step) with SORF-VeRA vs peft VeRA at ``rank``."""
    from fedlr.adapters.sorf_vera import SorfVeraSettings, build_sorf_vera_model
    from fedlr.adapters.vera import VeraSettings, build_vera_model
    from fedlr.models import build_text_classifier

    sorf = build_sorf_vera_model(
        build_text_classifier("minilm", 2, 0),
        SorfVeraSettings(rank=rank, d_scale_initial=0.1),
    ).model
    vera = build_vera_model(
        build_text_classifier("minilm", 2, 0), VeraSettings(rank=rank)
    ).model
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 20000, (16, 64), generator=gen)
    mask = torch.ones_like(ids)
    labels = torch.randint(0, 2, (16,), generator=gen)

    def infer(model: torch.nn.Module) -> Callable[[], object]:
        def run() -> object:
            with torch.no_grad():
                return model(input_ids=ids, attention_mask=mask).logits

        return run

    def step(model: torch.nn.Module) -> Callable[[], object]:
        def run() -> object:
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            return loss

        return run

    for model in (sorf, vera):
        model.eval()
        infer(model)()
    t_sorf, t_vera = _paired(infer(sorf), infer(vera), 4, 2)
    for model in (sorf, vera):
        model.train()
    ts_sorf, ts_vera = _paired(step(sorf), step(vera), 3, 2)
    return {
        "rank": rank,
        "sorf_forward_ms": 1e3 * t_sorf,
        "vera_forward_ms": 1e3 * t_vera,
        "forward_ratio": t_sorf / t_vera,
        "sorf_step_ms": 1e3 * ts_sorf,
        "vera_step_ms": 1e3 * ts_vera,
        "step_ratio": ts_sorf / ts_vera,
    }


def refit_case(d: int, rank: int = REFIT_RANK, rounds: int = 0) -> dict[str, float]:
    """One layer's refit (d_out = d_in = ``d``) with the FWHT and the dense ``fit_b``.

    ``A`` and ``B`` Kaiming-uniform (float32) as the adapter draws them,
    ``b`` and the averaged ``Lambda_d`` random; ``b`` in float64 so that the
    refit ``b`` is returned unrounded and the two fits can be compared beyond
    float32 (the refit computes in float64 either way). Each side runs once
    per round, the two alternating (:func:`_paired`); best of ``rounds``
    (default 3 up to ``d = 1024``, else 1: the dense fit takes seconds).
    """
    from fedlr.adapters.sorf_vera import layer_signs, shared_sorf_projections

    a, b = shared_sorf_projections(rank, d, d, seed=0)
    gen = torch.Generator().manual_seed(d)
    b_real = 1.0 + 0.1 * torch.randn(d // 2, generator=gen, dtype=torch.float64)
    b_imag = 0.1 * torch.randn(d // 2, generator=gen, dtype=torch.float64)
    angles = 0.3 * torch.randn(rank * (rank - 1) // 2, generator=gen)
    scales = torch.tensor([0.05])
    lam = build_lambda_d_rot(scales, angles, rank) + 0.01 * torch.randn(
        rank, rank, generator=gen
    )  # a mean of clients' matrices is no longer a scaled rotation
    signs = layer_signs(d, 0)
    out: dict[str, LayerRefit] = {}

    def fast() -> object:
        out["fast"] = refit_layer(lam, b_real, b_imag, a, b, signs)
        return out["fast"]

    def dense() -> object:
        out["dense"] = refit_layer(
            lam, b_real, b_imag, a, b, signs, b_solver=_fit_b_dense
        )
        return out["dense"]

    t_fast, t_dense = _paired(fast, dense, rounds or (3 if d <= 1024 else 1), 1)
    new = torch.cat([out["fast"].b_real, out["fast"].b_imag]).double()
    old = torch.cat([out["dense"].b_real, out["dense"].b_imag]).double()
    return {
        "d": d,
        "rank": rank,
        "fast_s": t_fast,
        "dense_s": t_dense,
        "speedup": t_dense / t_fast,
        "b_rel_diff": float((new - old).norm() / old.norm()),
        "gap_rel_diff": abs(out["fast"].gap - out["dense"].gap) / out["dense"].gap,
        "b_residual": out["fast"].b_residual,
    }


SignLayer = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, SorfSigns
]


def _sign_layer(
    d_out: int, d_in: int, rank: int, seed: int, clients: int = 4
) -> SignLayer:
    """One seeded layer: the adapter's ``A``, ``B``, ``S``; random ``b``, ``Lambda``.

    ``Lambda_bar`` is the mean of ``clients`` scaled rotations (small scale
    and angles, as after a few local steps from ``m = 0``); ``b`` is near
    its initial ``1 + 0i``.
    """
    from fedlr.adapters.sorf_vera import layer_signs, shared_sorf_projections

    a, b = shared_sorf_projections(rank, d_in, d_out, seed=0)
    gen = torch.Generator().manual_seed(1000 * d_out + seed)
    b_real = 1.0 + 0.1 * torch.randn(d_out // 2, generator=gen)
    b_imag = 0.1 * torch.randn(d_out // 2, generator=gen)
    scales = [0.05 * torch.rand(1, generator=gen) for _ in range(clients)]
    angles = [
        0.3 * torch.randn(rank * (rank - 1) // 2, generator=gen) for _ in range(clients)
    ]
    lam = mean_lambda_d_rot(scales, angles, [1.0] * clients, rank)
    return lam, b_real, b_imag, a, b, layer_signs(d_out, 0)


def _svd_and_polar(layer: SignLayer) -> tuple[TruncatedSVD, PolarFactor]:
    """The rank-r SVD of a layer's averaged update and the polar factor."""
    lam, b_real, b_imag, a, b, signs = layer
    f64 = torch.float64
    svd = factored_svd(
        sorf_left(signs.to(f64), b_real, b_imag, b.to(f64)),
        lam.to(f64) @ a.to(f64),
        rank=a.shape[0],
    )
    return svd, polar_factor(polar_target(a, svd.vh))


def signs_case(
    d_out: int, d_in: int, rank: int, layers: int, rounds: int = 3
) -> dict[str, float]:
    """Mean relative refit gap under each sign rule, and the search's time.

    For each of ``layers`` seeded layers: the refit with the ``"peak"`` rule,
    with ``"gap"`` (default :class:`SignSearch`) and with the exact model
    (:meth:`SignSearch.exact`). Times on the first layer: the default search
    alone (:func:`choose_pair_signs`, from the layer's SVD and polar factor)
    against one refit (``"peak"``), alternating (:func:`_paired`), best call;
    the search on the exact model (best of two). Above the exhaustive bound
    also the exhaustive search on the same model: its time, and on how many
    layers the descent found its optimum.
    """
    search = SignSearch()
    gaps: dict[str, list[float]] = {"peak": [], "gap": [], "exact": []}
    flipped: list[int] = []
    greedy_optimal = 0
    for seed in range(layers):
        layer = _sign_layer(d_out, d_in, rank, seed)
        peak = refit_layer(*layer)
        fast = refit_layer(*layer, sign_search="gap")
        exact = refit_layer(*layer, sign_search="gap", search=SignSearch.exact())
        for key, fit in (("peak", peak), ("gap", fast), ("exact", exact)):
            gaps[key].append(fit.gap / fit.target_norm)
        assert fast.pair_signs is not None and peak.pair_signs is not None
        flipped.append(int((fast.pair_signs != peak.pair_signs).sum()))
        if rank > search.exhaustive_rank:
            every = SignSearch(exhaustive_rank=rank)
            best = choose_pair_signs(
                *_svd_and_polar(layer), layer[3], layer[4], layer[5], search=every
            )
            assert fast.sign_choice is not None
            greedy_optimal += fast.sign_choice.gap <= best.gap * (1 + 1e-9)
    layer = _sign_layer(d_out, d_in, rank, 0)
    svd, polar = _svd_and_polar(layer)
    a, b, signs = layer[3], layer[4], layer[5]
    t_search, t_refit = _paired(
        lambda: choose_pair_signs(svd, polar, a, b, signs, search=search),
        lambda: refit_layer(*layer),
        rounds,
        3,
    )
    t_exact = _time(
        lambda: choose_pair_signs(svd, polar, a, b, signs, search=SignSearch.exact()),
        2,
    )
    t_every = math.nan
    if rank > search.exhaustive_rank:
        every = SignSearch(exhaustive_rank=rank)
        t_every = _time(
            lambda: choose_pair_signs(svd, polar, a, b, signs, search=every), 2
        )
    choice = choose_pair_signs(svd, polar, a, b, signs, search=search)
    mean = {k: sum(v) / len(v) for k, v in gaps.items()}
    worse = [g > p * (1 + 1e-9) for g, p in zip(gaps["gap"], gaps["peak"], strict=True)]
    return {
        "d_out": d_out,
        "d_in": d_in,
        "rank": rank,
        "layers": layers,
        "peak": mean["peak"],
        "gap": mean["gap"],
        "exact": mean["exact"],
        "worse": sum(worse),
        "flipped": sum(flipped) / len(flipped),
        "exhaustive": float(choice.exhaustive),
        "patterns": choice.patterns,
        "search_ms": 1e3 * t_search,
        "refit_ms": 1e3 * t_refit,
        "exhaustive_ms": 1e3 * t_every,
        "exact_ms": 1e3 * t_exact,
        "greedy_optimal": greedy_optimal,
    }


def brute_force_range(
    d_out: int = 24, d_in: int = 24, rank: int = 6, seed: int = 0
) -> dict[str, float]:
    """Relative refit gap of all ``2^r`` patterns of one layer, and of the rules."""
    layer = _sign_layer(d_out, d_in, rank, seed)
    gaps = []
    for bits in range(2**rank):
        eps = torch.tensor([-1.0 if bits >> j & 1 else 1.0 for j in range(rank)])
        fit = refit_layer(*layer, pair_signs=eps)
        gaps.append(fit.gap / fit.target_norm)
    peak = refit_layer(*layer)
    fast = refit_layer(*layer, sign_search="gap")
    return {
        "min": min(gaps),
        "max": max(gaps),
        "peak": peak.gap / peak.target_norm,
        "gap": fast.gap / fast.target_norm,
    }


def main(cases: Sequence[str] = ("apply", "forward", "refit", "signs")) -> None:
    """Print the tables of ``cases`` (``apply``, ``forward``, ``refit``, ``signs``)."""
    if "apply" in cases:
        _print_apply(sorf_apply_case())
    if "forward" in cases:
        _print_forward(forward_case())
    if "refit" in cases:
        print(
            f"SORF-VeRA refit of one layer, d_out = d_in = d, rank {REFIT_RANK}, "
            f"FWHT fit_b vs dense fit_b ({torch.get_num_threads()} threads)"
        )
        for d in REFIT_DIMS:
            r = refit_case(d)
            print(
                f"  d = {r['d']:5d}: FWHT {1e3 * r['fast_s']:8.1f} ms | dense "
                f"{1e3 * r['dense_s']:9.1f} ms (x{r['speedup']:.0f}) | b rel diff "
                f"{r['b_rel_diff']:.1e} | gap rel diff {r['gap_rel_diff']:.1e} | "
                f"b-residual {r['b_residual']:.3f}"
            )
    if "signs" in cases:
        _print_signs()


def _print_signs() -> None:
    print(
        "SORF-VeRA refit: signs of the singular pairs, mean relative refit gap "
        f"(peak rule vs gap search), {torch.get_num_threads()} threads"
    )
    for d_out, d_in, rank, layers in SIGN_CASES:
        c = signs_case(d_out, d_in, rank, layers)
        how = "exhaustive" if c["exhaustive"] else "greedy"
        print(
            f"  {d_out:4d} x {d_in:4d}, r = {rank:2d}, {layers:2d} layers: peak "
            f"{c['peak']:.4f} | gap {c['gap']:.4f} (exact model {c['exact']:.4f}; "
            f"worse than peak on {c['worse']:.0f}) | {c['flipped']:.1f} pairs "
            f"flipped | search ({how}, {c['patterns']:.0f} patterns) "
            f"{c['search_ms']:.1f} ms vs refit {c['refit_ms']:.1f} ms "
            f"(x{c['search_ms'] / c['refit_ms']:.2f}); on the exact model "
            f"{c['exact_ms']:.1f} ms"
        )
        if not c["exhaustive"]:
            print(
                f"      all {2 ** (rank - 1)} patterns on the same model: "
                f"{c['exhaustive_ms']:.0f} ms; the descent found that optimum on "
                f"{c['greedy_optimal']:.0f} of {layers} layers"
            )
    b = brute_force_range()
    print(
        f"  24 x 24, r = 6, all 64 patterns: gap {b['min']:.4f} .. {b['max']:.4f}; "
        f"peak rule {b['peak']:.4f}, gap search {b['gap']:.4f}"
    )


def _print_apply(a: dict[str, float]) -> None:
    print(
        f"SORF apply, n = {N}, batch {BATCH} "
        f"(float32, {torch.get_num_threads()} threads)"
    )
    if a["glibc"]:
        print(
            f"  fresh allocations (glibc mmap threshold 128 KiB): FWHT "
            f"{a['fwht_cold_ms']:.2f} ms | dense GEMM {a['dense_gemm_cold_ms']:.2f} "
            f"ms (x{a['speedup_vs_gemm_cold']:.1f})"
        )
        print("  steady state (mmap threshold 32 MiB, as in a training process):")
    print(
        f"  FWHT {a['fwht_ms']:.2f} ms | dense S built + applied "
        f"{a['dense_build_and_apply_ms']:.1f} ms (x{a['speedup_vs_build']:.0f}) | "
        f"dense GEMM alone {a['dense_gemm_only_ms']:.2f} ms "
        f"(x{a['speedup_vs_gemm']:.1f}) | max |diff| {a['max_abs_err']:.1e}"
    )
    print(
        f"  peak CPU memory (torch profiler memory events): FWHT "
        f"{a['fwht_peak_mib']:.1f} MiB, dense {a['dense_peak_mib']:.1f} MiB "
        f"(dense S alone: {N * N * 4 / 2**20:.0f} MiB)"
    )


def _print_forward(f: dict[str, float]) -> None:
    print(f"MiniLM, batch 16 x 64 tokens, rank {f['rank']}: SORF-VeRA vs peft VeRA")
    print(
        f"  forward {f['sorf_forward_ms']:.1f} vs {f['vera_forward_ms']:.1f} ms "
        f"(ratio {f['forward_ratio']:.2f}) | forward+backward "
        f"{f['sorf_step_ms']:.1f} vs {f['vera_step_ms']:.1f} ms "
        f"(ratio {f['step_ratio']:.2f})"
    )


if __name__ == "__main__":
    main(sys.argv[1:] or ("apply", "forward", "refit", "signs"))
