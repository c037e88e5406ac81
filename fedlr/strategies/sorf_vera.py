"""SORF-VeRA: average the rotations, refit ``b`` and ``d`` on the server.

A layer's update is ``Delta W = S Gamma(b) B Lambda_d A`` with ``Lambda_d =
m G(theta)`` (see :mod:`fedlr.adapters.sorf_vera`). Clients train ``m`` and
``theta`` with ``b`` frozen. Each round the server

1. averages the built ``Lambda_d_i = m_i G(theta_i)`` matrices, weighted by
   examples (not the angles: ``G`` is nonlinear in ``theta``); because ``b``
   is shared, ``S Gamma(b) B Lambda_bar A`` is exactly the weighted mean of the
   client updates;
2. takes its rank-``r`` truncated SVD ``U_r Sigma_r V_r^T`` in factored form
   (left ``S Gamma(b) B`` by FWHT, right ``Lambda_bar A``; no ``d_out x d_in``
   matrix);
3. refits ``d`` (``fit_d``: polar factor of ``V_r^T pinv(A)``, Givens angles,
   ``m`` = mean polar singular value) and ``b`` (``fit_b``: least squares on
   ``||S Gamma(b) B - U_r Sigma_r||_F``). The refit depends on the signs of
   the singular pairs (``U_r Sigma_r V_r^T`` does not): ``sign_search="gap"``
   (default) picks the pattern with the smallest refit gap among those whose
   polar factor is a rotation (``det = +1``, which ``G(theta)`` can
   represent), ``"peak"`` keeps the fixed rule (each ``u_j`` with a positive
   peak, the last pair flipped for a reflection); see
   :func:`fedlr.linalg.sorf_refit.choose_pair_signs`;
4. sends the new ``b`` (frozen on clients) and ``d`` next round.

Steps 1-3 are the kernels :func:`fedlr.linalg.mean_lambda_d_rot` and
:func:`fedlr.linalg.refit_layer` (:mod:`fedlr.linalg.sorf_refit`).

Logged every round: ``b-residual`` ``||S Gamma(b) B - U_r Sigma_r||_F /
||U_r Sigma_r||_F`` and ``d-residual`` ``||m G A - V_r^T||_F / ||V_r^T||_F``
(root mean square over layers), and as ``frobenius-gap`` the distance
between the refit update and the mean client update.
"""

from __future__ import annotations

import math
from logging import INFO
from typing import Any, ClassVar

import torch
from flwr.supercore import log

from fedlr.adapters.roles import Role, RoleLayout
from fedlr.adapters.sorf_vera import SorfVeraLayout, SorfVeraModule, layer_signs
from fedlr.client_apps.payloads import SORF_VERA
from fedlr.linalg import mean_lambda_d_rot, refit_layer, weighted_mean
from fedlr.linalg.sorf_pair_signs import SIGN_RULES
from fedlr.strategies.base import ClientUpdate, RoundReport
from fedlr.strategies.registration import ClientContract, register_method
from fedlr.strategies.vera import ProjectionChecked

__all__ = ["SorfVeRA"]


@register_method(
    "sorf-vera",
    payload=SORF_VERA,
    summary="average Lambda_d rotations, truncated SVD, refit b (SORF, LS) and d",
    client_contract=ClientContract(
        carries="`b_real`, `b_imag`, `d_scale`, `d_angles`, head",
        helpers="`b` frozen (the server refits it); train `d_scale`, `d_angles`, head",
    ),
)
class SorfVeRA(ProjectionChecked):
    """SORF-VeRA aggregation with server-side refit of ``b`` and ``d``.

    Parameters
    ----------
    layout : SorfVeraLayout
    projection_a : (r, max d_in) torch.Tensor
    projection_b : (max d_out, r) torch.Tensor
    sign_search : {"gap", "peak"}, default "gap"
        Signs of the singular pairs before the refit: ``"gap"`` minimises the
        refit gap (all ``2^(r-1)`` admissible patterns up to ``r = 12``,
        steepest descent over pair flips from four seeded starts above,
        on a float32 model of the gap); ``"peak"``, the former fixed rule.
    **kwargs
        Other parameters: see :class:`~fedlr.strategies.base.FedLRStrategy`.
    """

    layout_type: ClassVar[type[RoleLayout]] = SorfVeraLayout
    send_roles: ClassVar[tuple[Role, ...]] = (
        Role.SORF_B_REAL,
        Role.SORF_B_IMAG,
        Role.SORF_D_SCALE,
        Role.SORF_D_ANGLES,
        Role.HEAD,
    )
    train_roles: ClassVar[tuple[Role, ...]] = (
        Role.SORF_D_SCALE,
        Role.SORF_D_ANGLES,
        Role.HEAD,
    )

    def __init__(
        self,
        *,
        layout: SorfVeraLayout,
        projection_a: torch.Tensor,
        projection_b: torch.Tensor,
        sign_search: str = "gap",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if sign_search not in SIGN_RULES:
            raise ValueError(
                f"sign_search must be one of {SIGN_RULES}, got {sign_search!r}"
            )
        r = layout.rank
        if (
            projection_a.shape[0] != r
            or projection_b.shape[1] != r
            or projection_a.shape[1] < max(m.d_in for m in layout.modules)
            or projection_b.shape[0] < max(m.d_out for m in layout.modules)
        ):
            raise ValueError(
                f"projections A {tuple(projection_a.shape)} and B "
                f"{tuple(projection_b.shape)} do not fit the layout (rank {r})"
            )
        for m in layout.modules:
            if r > min(m.d_out, m.d_in):
                raise ValueError(
                    f"rank {r} exceeds the smaller side of layer {m.name} "
                    f"({m.d_out} x {m.d_in}): the rank-r refit needs r <= both"
                )
        self.layout = layout
        self.projection_a = projection_a
        self.projection_b = projection_b
        self.projection_seed = layout.projection_seed
        self.projection_rank = layout.rank
        self.sign_search = sign_search

    def summary(self) -> None:
        """Log the settings, then FedAvg's."""
        log(
            INFO,
            "\t├──> SorfVeRA: %d layers, rank %d (%d Givens angles), projection "
            "seed %d, pair signs by %s",
            len(self.layout.modules),
            self.layout.rank,
            self.layout.rank * (self.layout.rank - 1) // 2,
            self.layout.projection_seed,
            self.sign_search,
        )
        super().summary()

    def averaged_lambda(
        self, module: SorfVeraModule, updates: list[ClientUpdate]
    ) -> torch.Tensor:
        """``sum_i w_i m_i G(theta_i)``, (r, r) float64: :func:`mean_lambda_d_rot`."""
        return mean_lambda_d_rot(
            [u.arrays[module.d_scale_key] for u in updates],
            [u.arrays[module.d_angles_key] for u in updates],
            [u.weight for u in updates],
            module.rank,
        )

    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        weights = [u.weight for u in updates]
        state = dict(current)
        for key in self.layout.keys(Role.HEAD):
            state[key] = weighted_mean([u.arrays[key] for u in updates], weights)
        layers: dict[str, tuple[float, float]] = {}
        b_res: list[float] = []
        d_res: list[float] = []
        for m in self.layout.modules:
            fit = refit_layer(
                self.averaged_lambda(m, updates),
                current[m.b_real_key],
                current[m.b_imag_key],
                self.projection_a[:, : m.d_in],
                self.projection_b[: m.d_out],
                layer_signs(m.d_out, self.projection_seed),
                sign_search=self.sign_search,
            )
            state[m.b_real_key] = fit.b_real
            state[m.b_imag_key] = fit.b_imag
            state[m.d_scale_key] = fit.d_scale.to(current[m.d_scale_key].dtype)
            state[m.d_angles_key] = fit.d_angles.to(current[m.d_angles_key].dtype)
            layers[m.name] = (fit.gap, fit.target_norm)
            b_res.append(fit.b_residual)
            d_res.append(fit.d_residual)
        return state, RoundReport.from_layers(
            layers,
            rank=float(self.layout.rank),
            **{
                "b-residual": math.sqrt(sum(x * x for x in b_res) / len(b_res)),
                "d-residual": math.sqrt(sum(x * x for x in d_res) / len(d_res)),
            },
        )
