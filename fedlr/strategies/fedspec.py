"""FedSpec: the best rank-r factors of the mean of products, with adaptive rank.

With client weights ``w_i`` the ideal aggregate is
``M = sum_i w_i B_i A_i``. Its truncated SVD ``M ~ U_r S_r V_r^T``
(:func:`fedlr.linalg.svd_of_mean`: from the stacked factors while ``k r`` is
small, else a dense in-place sum for small layers or a randomized range finder
over the clients, chosen by a cost model) gives the
balanced factors

    B = U_r sqrt(S_r),    A = sqrt(S_r) V_r^T,

the best rank-``r`` approximation of ``M`` in Frobenius norm (Eckart-Young);
the gap ``||M - B A||_F`` is ``sqrt(sum_{j>r} sigma_j^2)``.

Adaptive rank: with the tail fraction ``tau = sum_{j>r} sigma_j^2 /
sum_j sigma_j^2`` at the current rank (the largest over the adapted layers;
``energy="sigma"`` uses ``sum_{j>r} sigma_j / sum_j sigma_j`` instead, the
FedSpec source's rule, which grows the rank sooner on a flat tail),
``tau > threshold`` grows the rank to ``min(r + 2, max_rank)``; it never
decreases (:func:`fedlr.linalg.adaptive_rank`). When it grows, this round's
factors are already cut at the new rank ``r'``. If ``M`` has fewer than
``r'`` singular values (``k r < r'``), the factors are padded
(:func:`fedlr.linalg.pad_factors`: zero columns of ``B``, orthonormal rows of
``A``), which leaves ``B A`` unchanged. The new rank travels to the clients as
``lora-rank`` in the ConfigRecord; they rebuild their adapter at that rank.
peft scales ``B A`` by ``alpha / r``; so that the model's update
``(alpha / r') B A`` equals ``(alpha / r) M_{r'}``, both factors are multiplied
by ``sqrt(r' / r)``.

With many clients the SVD may be randomized (``svd-solver``:
:mod:`fedlr.strategies.svd_solver`; ``auto`` logs the first switch):
``svd-randomized`` is then 1.0, and the tail energy (``tail-energy`` and the
gap) includes a Hutch++ estimate of the energy outside the sketched subspace:
``gap-estimated`` is 1.0 and ``gap-error-bound`` bounds the relative error of
``frobenius-gap`` (three standard errors of the estimate). The randomized
singular values are lower bounds of the true ones, so that point estimate of
the tail is biased upward; the rank rule decides on bounds instead
(:meth:`~fedlr.linalg.TruncatedSVD.tail_fraction_bounds`): it grows the rank
when even the lower bound exceeds the threshold, keeps it when even the upper
bound does not, and otherwise (near the threshold) measures the layer again:
first ``||M||_F^2`` exactly (:func:`fedlr.linalg.frobenius_sq_of_mean`, trace
of Gram products, no ``d x d`` matrix per client), which makes the upper
bound the exact error of the rank-``r`` factors, then, if still undecided,
the exact SVD of that layer (``auto``; with ``svd-solver = "randomized"`` an
undecided layer is judged by the exact tail of the factors it sends, which
exceeds the optimal tail by what the randomized subspace misses).

Heterogeneous ranks (``client-ranks``): :meth:`FedSpec.from_run_config`
builds a :class:`HeteroFedSpec`. Client ``i`` trains rank ``r_i`` with
scaling ``s_i = alpha / r_i``; the mean is taken of the updates,
``M = sum_i w_i s_i B_i A_i``, exactly from the stacked factors
(:func:`fedlr.linalg.stacked_update`, :func:`fedlr.linalg.factored_svd`).
The rank rule is the one above, from the largest client rank ``R_0``; the
global factors are ``U_R sqrt(S_R)``, ``sqrt(S_R) V_R^T`` at scaling
``alpha / R`` (FlexLoRA's, :mod:`fedlr.strategies.hetero`), and a client of
rank ``r_i`` receives their leading ``r_i`` components (``R >= R_0 >= r_i``:
the rank never decreases), i.e. the best rank-``r_i`` approximation ``M_{r_i}``.

References
----------
.. [1] "FedSpec: Spectrally Optimal Aggregation for Federated LoRA" (2024).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from logging import INFO
from typing import Any, ClassVar

import torch
from flwr.supercore import log

from fedlr.adapters.roles import AdapterLayout, Role
from fedlr.client_apps.payloads import LORA
from fedlr.errors import ConfigError
from fedlr.linalg import (
    DEFAULT_COST_MODEL,
    GapNorms,
    TruncatedSVD,
    adaptive_rank,
    factored_svd,
    frobenius_sq_of_mean,
    gap_summary,
    pad_factors,
    stacked_update,
    svd_of_mean,
    truncate,
)
from fedlr.options import option, require
from fedlr.robust.spaces import PRODUCT
from fedlr.strategies.base import ClientUpdate, RoundReport, weighted_means
from fedlr.strategies.hetero import HeteroRankLoRA, layout_at_rank
from fedlr.strategies.lora_svd import SeededLoraStrategy
from fedlr.strategies.registration import ClientContract, register_method
from fedlr.strategies.svd_solver import SvdSolverChoice, SvdSolverOptions
from fedlr.wire import protocol

__all__ = [
    "ENERGY_RULES",
    "FedSpec",
    "FedSpecOptions",
    "HeteroFedSpec",
    "layout_at_rank",
]

ENERGY_RULES = ("sigma2", "sigma")
"""What the rank rule sums over the tail: squared singular values or the values."""


@dataclass(frozen=True)
class FedSpecOptions(SvdSolverOptions):
    """FedSpec's run-config keys (and ``svd-solver``)."""

    fedspec_threshold: float = option(
        0.05,
        "the rank grows by 2 (up to `fedspec-max-rank`) when the tail energy "
        "fraction Σ_{j>r}σⱼ² / Σⱼσⱼ² of the mean of products exceeds this",
        range="[0, 1)",
    )
    fedspec_max_rank: int = option(
        16,
        "cap of the adaptive rank, ≥ `lora-rank` and ≤ the smaller side of "
        "every adapted layer (checked when the server builds the model)",
        range=">= 1",
    )
    fedspec_energy: str = option(
        "sigma2",
        "the tail fraction the rank rule compares with `fedspec-threshold`: "
        '`"sigma2"` (squared singular values, the energy) or `"sigma"` '
        "(singular values, the FedSpec source's rule)",
        bad=[("sigma3", r"one of \['sigma2', 'sigma'\]")],
    )

    def check(self) -> None:
        super().check()
        require(
            self.fedspec_energy in ENERGY_RULES,
            "fedspec-energy",
            f"must be one of {list(ENERGY_RULES)}, got {self.fedspec_energy!r}",
        )


@register_method(
    "fedspec",
    payload=LORA,
    options=FedSpecOptions,
    summary="truncated SVD of the mean of products, B=U sqrt(S), A=sqrt(S) V^T; "
    "rank grows by 2 while the tail energy exceeds a threshold",
    client_contract=ClientContract(
        carries="`A`, `B`, head; `lora-rank`, `lora-alpha`",
        helpers="rebuild the adapter at `lora-rank` with scaling `lora-alpha / r`",
    ),
)
class FedSpec(SvdSolverChoice, SeededLoraStrategy):
    """Spectrally optimal aggregation with a monotone adaptive rank.

    Parameters
    ----------
    layout : AdapterLayout
        At the initial rank.
    options : FedSpecOptions, optional
        ``fedspec_threshold`` (tail energy fraction above which the rank
        grows, default 0.05), ``fedspec_max_rank`` (cap of the rank, at most
        the smallest side of an adapted layer; default 16) and
        ``fedspec_energy`` (``"sigma2"``, the tail fraction of the squared
        singular values, the Frobenius gap's, or ``"sigma"``, of the singular
        values, the FedSpec source's rule) and ``svd_solver`` (``"auto"``,
        ``"exact"``, ``"randomized"``); each can be passed by name.
    **kwargs
        Other parameters: see :class:`~fedlr.strategies.lora_svd.SeededLoraStrategy`.
    """

    aggregation_space: ClassVar[str] = PRODUCT  # an SVD / fold of the products

    method_options: FedSpecOptions

    extra_columns: tuple[str, ...] = (
        "tail-energy",
        "gap-estimated",
        "gap-error-bound",
        "svd-randomized",
    )
    heterogeneous_ranks: ClassVar[bool] = True
    """Accepts ``client-ranks`` (then :meth:`from_run_config` builds a
    :class:`HeteroFedSpec`)."""

    def __init__(self, *, layout: AdapterLayout, **kwargs: Any) -> None:
        super().__init__(layout=layout, **kwargs)
        max_rank = self.max_rank
        narrow = min(min(m.d_in, m.d_out) for m in layout.modules)
        if max_rank < self.rank:
            raise ConfigError(
                "fedspec-max-rank",
                f"{max_rank} is below the initial rank {self.rank}; the rank "
                "never decreases",
            )
        if max_rank > narrow:
            raise ConfigError(
                "fedspec-max-rank",
                f"{max_rank} exceeds the smaller side {narrow} of an adapted layer",
            )
        if len({m.rank for m in layout.modules}) != 1:
            raise ValueError("FedSpec needs one LoRA rank for every layer")
        self.rank_history: list[int] = []

    @property
    def threshold(self) -> float:
        """The ``fedspec-threshold`` option."""
        return self.method_options.fedspec_threshold

    @property
    def max_rank(self) -> int:
        """The ``fedspec-max-rank`` option."""
        return self.method_options.fedspec_max_rank

    @property
    def energy(self) -> str:
        """The ``fedspec-energy`` option."""
        return self.method_options.fedspec_energy

    def state_dict(self) -> dict[str, Any]:
        """The current rank and its history (the layout follows the rank)."""
        return {"rank": self.rank, "rank-history": list(self.rank_history)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        unknown = sorted(set(state) - {"rank", "rank-history"})
        if unknown:
            raise ValueError(f"FedSpec: unknown state keys {unknown}")
        rank = int(state["rank"])
        if not self.rank <= rank <= self.max_rank:
            raise ValueError(
                f"FedSpec: checkpointed rank {rank} is outside [{self.rank}, "
                f"{self.max_rank}]"
            )
        self.layout = layout_at_rank(self.layout, rank)
        self.rank_history = [int(r) for r in state.get("rank-history", [])]

    def round_config(self, server_round: int) -> dict[str, Any]:
        config = super().round_config(server_round)
        config[protocol.LORA_RANK] = self.rank
        return config

    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        self.check_ranks(updates)
        state = dict(current)
        state.update(weighted_means(updates, self.layout.keys(Role.HEAD)))
        weights = [u.weight for u in updates]
        rank = self.rank
        # 1. Truncated SVD of every layer's mean of products, at the largest rank
        #    the rule can reach; the path (factored QR, dense, randomized) is the
        #    cost model's (fedlr.linalg.svd_of_mean), exact while that is cheap.
        reach = max(rank, min(rank + 2, self.max_rank))
        factors = {
            m.name: (
                [u.arrays[m.b_key] for u in updates],
                [u.arrays[m.a_key] for u in updates],
            )
            for m in self.layout.modules
        }
        svds = self._layer_svds(server_round, factors, weights, reach)
        # 2. Rank rule on the largest tail fraction at the current rank, from
        #    bounds where the SVD was randomized (undecided layers measured
        #    again, exactly).
        decisive = self.decide(server_round, svds, factors, weights, reach)
        tail = self.tail_fraction(svds.values())
        new_rank = adaptive_rank(rank, decisive, self.threshold, self.max_rank)
        new_layout = layout_at_rank(self.layout, new_rank)
        gain = math.sqrt(new_rank / rank)  # (alpha / r') B A == (alpha / r) M_r'
        # 3. Balanced factors of the rank-r' truncation, padded if needed.
        gaps = self._balanced(server_round, svds, new_layout, new_rank, gain, state)
        self.set_rank(server_round, new_layout, tail)
        report = self._report(
            {name: g.pair for name, g in gaps.items()},
            **gap_summary(gaps.values()),
            **{"svd-randomized": float(any(v.randomized for v in svds.values()))},
        )
        report.metrics["tail-energy"] = tail
        return state, report

    def _layer_svds(
        self,
        server_round: int,
        factors: Mapping[str, tuple[list[torch.Tensor], list[torch.Tensor]]],
        weights: list[float],
        reach: int,
    ) -> dict[str, TruncatedSVD]:
        """Each layer's truncated SVD of its mean of products at rank ``reach``
        (the path, factored QR, dense or randomized, is the cost model's)."""
        svds: dict[str, TruncatedSVD] = {}
        for m in self.layout.modules:
            svds[m.name] = svd_of_mean(
                *factors[m.name],
                weights,
                reach,
                cost=DEFAULT_COST_MODEL,
                seed=self.seed + server_round,
                solver=self.svd_solver,
            )
            self.note_svd(
                "fedspec",
                m.name,
                svds[m.name],
                clients=len(weights),
                rank=self.rank,
                shape=(m.d_out, m.d_in),
            )
        return svds

    def _balanced(
        self,
        server_round: int,
        svds: Mapping[str, TruncatedSVD],
        new_layout: AdapterLayout,
        new_rank: int,
        gain: float,
        state: dict[str, torch.Tensor],
    ) -> dict[str, GapNorms]:
        """Write into ``state`` the balanced factors of each layer's rank-r'
        truncation (padded if needed, scaled by ``gain``, in the factors'
        dtype) in place of the old ones; each layer's gap norms."""
        gaps: dict[str, GapNorms] = {}
        for m, new_m in zip(self.layout.modules, new_layout.modules, strict=True):
            cut = truncate(svds[m.name], new_rank)
            b, a = cut.split_sqrt()
            b, a = pad_factors(b, a, new_rank, seed=self.seed + server_round)
            dtype = state[m.b_key].dtype
            del state[m.b_key], state[m.a_key]
            state[new_m.b_key] = (gain * b).to(dtype)
            state[new_m.a_key] = (gain * a).to(dtype)
            gaps[m.name] = GapNorms(
                math.sqrt(max(cut.tail_energy, 0.0)),
                math.sqrt(max(cut.total_energy, 0.0)),
                estimated=cut.energy_estimated,
                gap_sq_error=cut.energy_error,
            )
        return gaps

    def fraction_bounds(self, svd: TruncatedSVD) -> tuple[float, float]:
        """Bounds of one layer's tail fraction at the current rank (of
        ``sigma^2`` or of ``sigma``, ``energy``); equal for an exact SVD."""
        if self.energy == "sigma2":
            return svd.tail_fraction_bounds(self.rank)
        return svd.sigma_fraction_bounds(self.rank)

    def decide(
        self,
        server_round: int,
        svds: dict[str, TruncatedSVD],
        factors: Mapping[str, tuple[list[torch.Tensor], list[torch.Tensor]]],
        weights: list[float],
        reach: int,
    ) -> float:
        """The rank rule's input: the largest upper bound of the layers' tail
        fractions, after measuring the undecided layers again.

        A layer is undecided when its bounds straddle the threshold (only a
        randomized SVD has distinct bounds). It is measured again, in place
        in ``svds``: first with the exact ``||M||_F^2``, which makes the
        upper bound the exact tail of the rank-``r`` factors the randomized
        SVD returns; then, if still undecided and ``svd-solver`` is ``auto``,
        by the exact SVD. A decided layer's upper bound is on the right side
        of the threshold; an undecided one left (``svd-solver =
        "randomized"``) is judged by the exact tail of its own factors, never
        by a point estimate: the rank grows when the factors it would send
        lose more than the threshold.
        """
        threshold = self.threshold
        for name, svd in list(svds.items()):
            low, high = self.fraction_bounds(svd)
            if not low <= threshold < high:
                continue
            bs, as_ = factors[name]
            if svd.energy_estimated:
                svd = svd.with_total_energy(
                    frobenius_sq_of_mean(bs, as_, weights, cost=DEFAULT_COST_MODEL)
                )
                svds[name] = svd
                low, high = self.fraction_bounds(svd)
            if low <= threshold < high and self.svd_solver == "auto":
                svds[name] = svd_of_mean(
                    bs, as_, weights, reach, cost=DEFAULT_COST_MODEL, solver="exact"
                )
                log(
                    INFO,
                    "fedspec round %d: layer %s's tail fraction is within "
                    "[%.4f, %.4f] of the randomized SVD, around the threshold "
                    "%.4f: decided by the exact SVD",
                    server_round,
                    name,
                    low,
                    high,
                    threshold,
                )
        return min(max(self.judged_fraction(s) for s in svds.values()), 1.0)

    def judged_fraction(self, svd: TruncatedSVD) -> float:
        """One layer's value for the rank rule (see :meth:`decide`).

        The upper bound, which is on the threshold's side of the exact value
        when the bounds do not straddle it, and the exact tail fraction of
        the returned factors when they do (``sigma2``, the total measured
        exactly). For ``energy="sigma"`` its upper bound is loose (only
        ``||M||_F^2`` is known beyond the sketch); an undecided layer is then
        judged by the point value :meth:`TruncatedSVD.sigma_fraction_at`,
        which underestimates the sigma-tail (the rank grows later).
        """
        low, high = self.fraction_bounds(svd)
        if self.energy == "sigma" and low <= self.threshold < high:
            return svd.sigma_fraction_at(self.rank)
        return high

    def tail_fraction(self, svds: Iterable[TruncatedSVD]) -> float:
        """The rank rule's input: the largest layer's tail fraction at the
        current rank (of ``sigma^2`` or of ``sigma``, ``energy``)."""
        rank = self.rank
        return max(
            s.tail_fraction_at(rank)
            if self.energy == "sigma2"
            else s.sigma_fraction_at(rank)
            for s in svds
        )

    def set_rank(self, server_round: int, layout: AdapterLayout, tail: float) -> None:
        """Adopt the round's new layout (rank), record and log it."""
        rank, new_rank = self.rank, max(m.rank for m in layout.modules)
        if new_rank != rank:
            log(INFO, "fedspec round %d: rank %d -> %d", server_round, rank, new_rank)
        self.layout = layout
        self.rank_history.append(new_rank)
        log(
            INFO,
            "fedspec round %d: rank %d, tail energy fraction %.4f at rank %d",
            server_round,
            new_rank,
            tail,
            rank,
        )


class HeteroFedSpec(HeteroRankLoRA, FedSpec):
    """FedSpec over clients of different ranks (``client-ranks``).

    ``M = sum_i w_i s_i B_i A_i`` with ``s_i = alpha / r_i`` (the mean of the
    clients' updates), its SVD exact from the stacked factors. The rank rule
    is FedSpec's, starting from the largest client rank; the global factors
    at the new rank ``R`` are FlexLoRA's (``U_R sqrt(S_R)``,
    ``sqrt(S_R) V_R^T``, padded as FedSpec pads, at scaling ``alpha / R``),
    and a client of rank ``r <= R`` receives their leading ``r`` components
    (:class:`~fedlr.strategies.hetero.HeteroRankLoRA`'s downlink): the best
    rank-``r`` approximation of ``M``. ``frobenius-gap`` is FedSpec's,
    ``||M - M_R||_F``; ``gap-rank-<r>`` is ``||M - M_r||_F``.

    Its SVD is always the exact one of the stacked updates; ``svd-solver =
    "randomized"`` is refused.

    Parameters: see :class:`FedSpec` and
    :class:`~fedlr.strategies.hetero.HeteroRankLoRA`.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.svd_solver == "randomized":
            raise ConfigError(
                "svd-solver",
                '"randomized" is not available with client-ranks: FedSpec over '
                "heterogeneous ranks takes the exact SVD of the stacked updates; "
                'use "auto" or "exact"',
            )

    def round_config(self, server_round: int) -> dict[str, Any]:
        """FedSpec's, without ``lora-rank``: every client keeps its own rank."""
        config = super().round_config(server_round)
        del config[protocol.LORA_RANK]
        return config

    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        state = dict(current)
        state.update(weighted_means(updates, self.layout.keys(Role.HEAD)))
        layers = self.layer_updates(updates)
        svds = {
            layer.module.name: factored_svd(*stacked_update(*layer.factors))
            for layer in layers
        }
        tail = self.tail_fraction(svds.values())
        new_rank = adaptive_rank(
            self.rank, min(tail, 1.0), self.threshold, self.max_rank
        )
        self.set_rank(server_round, layout_at_rank(self.layout, new_rank), tail)
        received: dict[str, tuple[dict[int, float], float]] = {}
        gaps: dict[str, GapNorms] = {}
        for module in self.layout.modules:  # at the new rank
            svd = svds[module.name]
            b, a = truncate(svd, new_rank).split_sqrt()
            b, a = pad_factors(b, a, new_rank, seed=self.seed + server_round)
            self.set_factors(module, b, a, current, state)
            norm = math.sqrt(max(svd.total_energy, 0.0))
            received[module.name] = (
                {
                    r: math.sqrt(max(svd.energy_beyond(min(r, new_rank)), 0.0))
                    for r in self.client_ranks
                },
                norm,
            )
            gaps[module.name] = GapNorms(
                math.sqrt(max(svd.energy_beyond(new_rank), 0.0)), norm
            )
        report = self.rank_report(
            updates,
            received,
            layer_gaps={name: g.pair for name, g in gaps.items()},
            **gap_summary(gaps.values()),
            **{"svd-randomized": 0.0},
        )
        report.metrics["tail-energy"] = tail
        return state, report


FedSpec.hetero_variant = HeteroFedSpec
