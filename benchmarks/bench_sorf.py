"""SORF-VeRA costs: FWHT vs a dense S, and the adapter vs peft's VeRA.

1. ``S x`` for a batch of 64 vectors at ``n = 4096``: the fast Walsh-Hadamard
   path (:func:`fedlr.linalg.sorf.sorf_apply`) against the dense reference
   (``S = D1 H D2 H D3`` built as a 4096 x 4096 matrix, then one GEMM). Time
   ratio (dense / FWHT, building S included, as a client without the FWHT
   would have to) and also the GEMM alone with S prebuilt. Peak memory comes
   from torch's profiler memory events (``profile_memory=True``: allocations
   and frees in time order, maximum of the running sum); torch's CPU allocator
   is invisible to ``tracemalloc``.
2. A forward (and a forward + backward) pass of MiniLM with SORF-VeRA layers
   against the same model with peft's VeRA at the same rank, batch 16 x 64
   tokens; the ratio SORF-VeRA / VeRA.

Run: ``python -m benchmarks.bench_sorf`` (or ``make bench``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from fedlr.linalg.sorf import fwht, sorf_apply, sorf_signs

N, BATCH = 4096, 64


def _time(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


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


def sorf_apply_case() -> dict[str, float]:
    """Time and peak memory of S x by FWHT and by a dense S."""
    x = torch.randn(BATCH, N)
    signs = sorf_signs(N, 0)
    t_fwht = _time(lambda: sorf_apply(signs, x), 10)
    t_dense_build = _time(lambda: x @ dense_sorf(N, 0).T, 2)
    s = dense_sorf(N, 0)
    t_dense_gemm = _time(lambda: x @ s.T, 5)
    err = float((sorf_apply(signs, x) - x @ s.T).abs().max())
    return {
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
    t_sorf = _time(infer(sorf), 5)
    t_vera = _time(infer(vera), 5)
    for model in (sorf, vera):
        model.train()
    ts_sorf = _time(step(sorf), 3)
    ts_vera = _time(step(vera), 3)
    return {
        "rank": rank,
        "sorf_forward_ms": 1e3 * t_sorf,
        "vera_forward_ms": 1e3 * t_vera,
        "forward_ratio": t_sorf / t_vera,
        "sorf_step_ms": 1e3 * ts_sorf,
        "vera_step_ms": 1e3 * ts_vera,
        "step_ratio": ts_sorf / ts_vera,
    }


def main() -> None:
    """Print both tables."""
    a = sorf_apply_case()
    print(
        f"SORF apply, n = {N}, batch {BATCH} "
        f"(float32, {torch.get_num_threads()} threads)"
    )
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
    f = forward_case()
    print(f"MiniLM, batch 16 x 64 tokens, rank {f['rank']}: SORF-VeRA vs peft VeRA")
    print(
        f"  forward {f['sorf_forward_ms']:.1f} vs {f['vera_forward_ms']:.1f} ms "
        f"(ratio {f['forward_ratio']:.2f}) | forward+backward "
        f"{f['sorf_step_ms']:.1f} vs {f['vera_step_ms']:.1f} ms "
        f"(ratio {f['step_ratio']:.2f})"
    )


if __name__ == "__main__":
    main()
