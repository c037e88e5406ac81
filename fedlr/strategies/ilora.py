"""ILoRA: QR-initialised LoRA and concatenated-QR aggregation across ranks.

Zhou, Liu and Shang [1]_ address three problems of federated LoRA over
heterogeneous clients; fedlr implements two of them exactly (``t`` the
server round, from 1; ``s_r = alpha / r`` the LoRA scaling at rank ``r``;
``R`` the largest client rank, the global adapters' rank):

**QR-based orthonormal initialisation.** With the reduced QR factorisation
``W0 = Q Rm`` of each adapted layer's pretrained weight (``d_out x d_in``,
``diag(Rm) >= 0``), the first global adapter and base weight are

    B_1 = Q[:, :R],    A_1 = Rm[:R, :] / s_R,    W_1 = W0 - Q[:, :R] Rm[:R, :],

so ``W_1 + s_R B_1 A_1 = W0``: the model is unchanged and every client starts
in the same orthonormal subspace. The paper scales nothing (``s = 1``);
fedlr divides ``A`` by ``s_R`` so that ``B`` stays orthonormal and the
product is the paper's at any ``lora-alpha``.

**Concatenated QR aggregation.** With the clients' factors stacked,

    B_c = [w_1 s_1 B_1, ..., w_k s_k B_k],   A_c = [A_1; ...; A_k],
    M = B_c A_c = sum_i w_i s_i B_i A_i,

(``w_i`` the ``num-examples`` shares, ``s_i = alpha / r_i``), the server
takes the reduced QR factorisation ``M = Q Rm`` (``diag(Rm) >= 0``) and
publishes ``B = Q[:, :R]``, ``A = Rm[:R, :] / s_R``, the head's weighted mean
and ``W`` unchanged. A client of rank ``r`` keeps the leading ``r``
components (the family's ``leading-rank`` rule, ``sqrt(r / R)`` on each
factor), so its product is ``Q[:, :r] Rm[:r, :]``: the paper's
``B_k = Q[:, :r_k]``, ``A_k = Rm[:r_k, :]``. ``Q[:, :r] Rm[:r, :]`` is the
projection of ``M`` onto the span of its first ``r`` columns; it is computed
from the stacked factors without forming ``M`` (:func:`concatenated_qr`):
the first ``R`` columns ``M[:, :R] = B_c A_c[:, :R]`` are factored, ``Q_R
Rm_11``, and ``Rm[:R, :] = (Q_R^T B_c) A_c``, which is Householder's answer
whenever those columns are independent (the sign rule makes it unique).

``gap-rank-<r>`` is ``||M - Q_r Q_r^T M||_F`` (what a client of rank ``r``
receives against ``M``), a factored norm of ``(B_c - Q_r Q_r^T B_c) A_c``.

**Not implemented: the clients' AdamW with rank-aware control variates**
(the paper's drift correction). fedlr's clients train with the run's local
optimiser (AdamW by default) without control variates; docs/methods/ilora.md
says why.

The base weights travel with the family's factored downlink
(``fedex-downlink``): a node receives ``W_1`` once and keeps it, since ILoRA
never changes it after the initialisation. The aggregation needs each
client's product ``B_i A_i``, not a sum of the clients' arrays: not sum-only.

References
----------
.. [1] Zhou, Liu, Shang, "ILoRA: Federated Learning with Low-Rank Adaptation
   for Heterogeneous Client Aggregation", arXiv:2511.16069, 2025.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch

from fedlr.adapters.roles import LoraModule, Role
from fedlr.client_apps.payloads import LORA
from fedlr.errors import ShapeMismatchError
from fedlr.linalg import factored_frobenius_norm, stacked_update
from fedlr.robust.spaces import PRODUCT
from fedlr.strategies.base import RoundReport
from fedlr.strategies.fedex_downlink import DownlinkOptions
from fedlr.strategies.hetero import HeteroFoldLoRA, LayerResult, LayerUpdates
from fedlr.strategies.registration import ClientContract, register_method

__all__ = ["ILoRA", "concatenated_qr", "qr_init", "signed_qr"]

_F64 = torch.float64


def signed_qr(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduced QR with a non-negative diagonal of ``R``, in float64.

    Parameters
    ----------
    matrix : (m, n) torch.Tensor

    Returns
    -------
    q : (m, p) torch.Tensor
        Orthonormal columns, ``p = min(m, n)``.
    r : (p, n) torch.Tensor
        Upper triangular with ``diag(r) >= 0`` (a column ``j`` of ``q`` and
        row ``j`` of ``r`` are negated together where LAPACK's diagonal is
        negative), so the factorisation is unique when ``matrix`` has full
        column rank.
    """
    if matrix.ndim != 2:
        raise ShapeMismatchError(
            f"expected a 2D matrix, got shape {tuple(matrix.shape)}"
        )
    q, r = torch.linalg.qr(matrix.to(_F64), mode="reduced")
    signs = torch.where(torch.diagonal(r) < 0, -1.0, 1.0).to(_F64)
    return q * signs, signs[:, None] * r


def qr_init(weight: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ILoRA's initial factors of a pretrained weight ``W0`` (Section 5.1).

    Parameters
    ----------
    weight : (d_out, d_in) torch.Tensor
        ``W0`` in ``nn.Linear``'s orientation.
    rank : int
        ``R``, at most ``min(d_out, d_in)``.

    Returns
    -------
    q, r : (d_out, R), (R, d_in) torch.Tensor, float64
        ``Q[:, :R]`` and ``Rm[:R, :]`` of ``W0 = Q Rm`` (:func:`signed_qr`);
        the initial product is ``q @ r``.
    """
    if not 1 <= rank <= min(weight.shape):
        raise ShapeMismatchError(
            f"rank {rank} is outside 1 .. {min(weight.shape)} for a weight of "
            f"shape {tuple(weight.shape)}"
        )
    q, r = signed_qr(weight)
    return q[:, :rank], r[:rank]


def concatenated_qr(
    left: torch.Tensor, right: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leading ``rank`` QR components of ``M = left @ right``, never forming ``M``.

    Parameters
    ----------
    left : (d_out, K) torch.Tensor
        ``B_c``, the weighted stacked ``B`` (:func:`fedlr.linalg.stacked_update`).
    right : (K, d_in) torch.Tensor
        ``A_c``, the stacked ``A``.
    rank : int
        ``R``, at most ``min(d_out, d_in)``.

    Returns
    -------
    q : (d_out, R) torch.Tensor, float64
        ``Q[:, :R]`` of ``M = Q Rm``: the first ``R`` columns of ``M``
        orthonormalised (:func:`signed_qr`).
    r : (R, d_in) torch.Tensor, float64
        ``Rm[:R, :] = Q[:, :R]^T M``.

    Notes
    -----
    1. ``M[:, :R] = left @ right[:, :R]`` (``d_out x R``) and its QR give
       ``Q[:, :R]``: Householder's first ``R`` columns depend on ``M``'s first
       ``R`` columns only.
    2. ``Rm[:R, :] = (Q[:, :R]^T left) @ right`` (``R x d_in``).
    Cost ``O(d_out K R + R K d_in)``; no ``d_out x d_in`` matrix.
    """
    d_out, d_in = left.shape[0], right.shape[1]
    if left.shape[1] != right.shape[0]:
        raise ShapeMismatchError(
            "stacked factors do not multiply: "
            f"{tuple(left.shape)} @ {tuple(right.shape)}"
        )
    if not 1 <= rank <= min(d_out, d_in):
        raise ShapeMismatchError(f"rank {rank} is outside 1 .. {min(d_out, d_in)}")
    left, right = left.to(_F64), right.to(_F64)
    q, _ = signed_qr(left @ right[:, :rank])
    return q, (q.T @ left) @ right


def _oriented(module: LoraModule, base: torch.Tensor) -> torch.Tensor:
    """The stored base weight in ``nn.Linear``'s (d_out, d_in) orientation."""
    return base.T if module.fan_in_fan_out else base


@register_method(
    "ilora",
    payload=LORA,
    options=DownlinkOptions,
    summary="heterogeneous ranks: QR-initialised adapters (W0 moved by the same "
    "product) and the QR of the concatenated clients' factors",
    client_contract=ClientContract(
        carries="`A`, `B` (the largest client rank, or your rank once the server "
        "knows it), head, base weights (dense or as changes, as `fedex-lora`; "
        "they change only once, by the QR initialisation, before round 1); "
        "`leading-rank`",
        helpers="load the base weights too and keep them (reply `base-held`); keep "
        "your rank's leading components as for `flexlora`; reply `A`, `B` at "
        "your rank, head. `ILoRA.for_model(model).initial_arrays(model)` "
        "gives the QR-initialised first arrays",
    ),
)
class ILoRA(HeteroFoldLoRA):
    """ILoRA: QR initialisation from ``W0``, QR of the stacked client factors.

    The global state is ``A``, ``B`` at the largest client rank ``R``, the
    head and the base weights ``W_1`` (moved once, by the initialisation);
    the global model is ``W_1 + s_R B A``.

    Parameters: see :class:`~fedlr.strategies.hetero.HeteroRankLoRA` and
    ``fedex_downlink``
    (:class:`~fedlr.strategies.fedex_downlink.FactoredDownlink`).
    """

    aggregation_space: ClassVar[str] = PRODUCT  # an SVD / fold of the products

    send_roles: ClassVar[tuple[Role, ...]] = (
        Role.LORA_A,
        Role.LORA_B,
        Role.HEAD,
        Role.BASE,
    )
    folds_gap: ClassVar[bool] = False  # W moves once, at initialisation

    def initial_global_state(
        self, state: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Section 5.1: ``B_1 = Q_R``, ``A_1 = Rm_R / s_R``, ``W_1 = W0 - Q_R Rm_R``.

        Parameters
        ----------
        state : mapping of str to torch.Tensor
            The seeded model's ``send_roles`` tensors (``W0`` pristine).

        Raises
        ------
        KeyError
            If a layer's base weight is missing.
        """
        out = dict(state)
        for m in self.layout.modules:
            if m.base_key not in state:
                raise KeyError(
                    f"initial arrays lack the base weight '{m.base_key}' that "
                    "ILoRA's QR initialisation factors"
                )
            base = state[m.base_key]
            q, r = qr_init(_oriented(m, base), m.rank)
            moved = _oriented(m, base).to(_F64) - q @ r
            out[m.b_key] = q.to(state[m.b_key].dtype)
            out[m.a_key] = (r / m.scaling).to(state[m.a_key].dtype)
            out[m.base_key] = (moved.T if m.fan_in_fan_out else moved).to(base.dtype)
        return out

    def aggregate_layer(
        self,
        layer: LayerUpdates,
        current: Mapping[str, torch.Tensor],
        state: dict[str, torch.Tensor],
    ) -> LayerResult:
        """``B = Q_R``, ``A = Rm_R / s_R`` of ``M = B_c A_c``; ``W`` stays."""
        module = layer.module
        left, right = stacked_update(*layer.factors)
        q, r = concatenated_qr(left, right, self.rank)
        state[module.b_key] = q.to(current[module.b_key].dtype)
        state[module.a_key] = (r / module.scaling).to(current[module.a_key].dtype)
        return LayerResult(
            _received_gaps(q, left, right, self.client_ranks),
            factored_frobenius_norm(left, right),
        )

    def finish_report(
        self, state: Mapping[str, torch.Tensor], report: RoundReport
    ) -> RoundReport:
        """No new base version: ``W_1`` never changes, so nodes keep theirs
        (publishing an unchanged version would send it dense again)."""
        report.metrics["dense-base-sends"] = float(self._dense_sends)
        return report


def _received_gaps(
    q: torch.Tensor, left: torch.Tensor, right: torch.Tensor, ranks: Sequence[int]
) -> dict[int, float]:
    """``||M - Q_k Q_k^T M||_F`` for each rank ``k``, ``M = left @ right``.

    ``(I - Q_k Q_k^T) M = (left - Q_k (Q_k^T left)) @ right``: a factored norm,
    accurate when the gap is small against ``||M||_F`` (no difference of squares).
    """
    gaps: dict[int, float] = {}
    for k in ranks:
        qk = q[:, :k]
        gaps[k] = factored_frobenius_norm(left - qk @ (qk.T @ left), right)
    return gaps
