"""Global SVD and Local SVD: a shared input-side factor, client-specific outputs.

Orientation. The method is stated for weights ``W in R^{d x p}`` (input x
output): ``A = U_k sqrt(S_k)`` (d x k) is shared and
``B_i^T = sqrt(S_k) V_k^T[:, block i]`` (k x p) is client ``i``'s, the update
``A B_i^T``. fedlr's layers are ``nn.Linear`` with (out, in) weights and
peft's ``Delta = B A`` with ``lora_A`` (r, in) and ``lora_B`` (out, r), so the
shared factor is on the *input* side, ``lora_A = sqrt(S_k) U_k^T``, and each
client's ``lora_B = V_k[block i] sqrt(S_k)``.

``global-svd``: clients train ``lora_A`` and ``lora_B`` and send both. The
server stacks the transposed updates side by side,
``X = [sqrt(w_1) Delta_1^T, ..., sqrt(w_k) Delta_k^T]`` (d_in x k d_out), takes
the rank-``r`` truncated SVD (:func:`fedlr.linalg.updates_svd`: from the stacked
factors with per-client blocks while ``k r`` is small, else from the Gram
operator ``X X^T = sum_i A_i^T (w_i B_i^T B_i) A_i``, dense and exact for small
``d_in`` or by randomized subspace iteration, chosen by a cost model; the
report's ``svd-randomized`` says which), broadcasts the shared ``lora_A``
and sends each client its own block of ``lora_B`` (an ArrayRecord
``personal``, stored in the client's ``context.state``). Then
``sum_i w_i ||Delta_i - B_i' A'||_F^2`` is the discarded energy of ``X``: the
Frobenius gap reported per layer (exact for the factors sent, on every path).

``local-svd``: each client takes the SVD of its own update,
``Delta_i^T = U_i S_i V_i^T``, keeps ``lora_B = V_i sqrt(S_i)`` in its state and
sends ``lora_A = sqrt(S_i) U_i^T``; the server averages ``lora_A``. The gap is
``sum_i w_i ||B_i (A_i - A_bar)||_F^2`` from the clients' ``B_i^T B_i``.

Both are personalised: evaluated per client on its own held-out part.

References
----------
.. [1] Zhou, Feng, "Low-Rank Selective Aggregation in Federated Learning
   (Global SVD)", The University of Hong Kong (report), inspired by FedSA-LoRA.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Self

import torch

from fedlr.adapters.roles import AdapterLayout, Role
from fedlr.client.features import Bound, ClientFeature, RoundJob
from fedlr.client_apps.payloads import LORA
from fedlr.errors import ProtocolError
from fedlr.linalg import DEFAULT_COST_MODEL, local_svd_factors, pad_factors, updates_svd
from fedlr.robust.spaces import PRODUCT
from fedlr.strategies.base import ClientUpdate, RoundReport, weighted_means
from fedlr.strategies.lora_svd import PersonalArrays, PersonalLoraStrategy
from fedlr.strategies.registration import ClientContract, register_method
from fedlr.strategies.svd_solver import SvdSolverChoice, SvdSolverOptions

__all__ = ["CLIENT_SVD", "ClientSvd", "GlobalSVD", "LocalSVD"]

CLIENT_SVD = "client-svd"
"""Instruction key of Local SVD: the client re-factors ``(B, A)`` as balanced
singular factors before it replies."""


class ClientSvd(ClientFeature):
    """Local SVD's client side: reply with balanced singular factors.

    On with ``client-svd``: each LoRA layer's trained ``B``, ``A`` are
    re-factored as ``U sqrt(S)``, ``sqrt(S) V^T`` of their product
    (:func:`fedlr.linalg.local_svd_factors`) before they are sent.
    """

    keys = (Bound(CLIENT_SVD, "bool"),)
    order = 60

    @classmethod
    def for_round(cls, job: RoundJob) -> Self | None:
        return cls() if bool(job.config.get(CLIENT_SVD, False)) else None

    def reply_arrays(
        self, job: RoundJob, trained: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        layout = job.adapted.layout
        if not isinstance(layout, AdapterLayout):
            raise ProtocolError(
                f"'{CLIENT_SVD}' re-factors LoRA layers; the model "
                f"has a {type(layout).__name__}"
            )
        for m in layout.modules:
            trained[m.b_key], trained[m.a_key] = local_svd_factors(
                trained[m.b_key], trained[m.a_key]
            )
        return trained


@register_method(
    "global-svd",
    payload=LORA,
    summary="server SVD of the client updates side by side: shared lora_A, "
    "client-specific lora_B",
    options=SvdSolverOptions,
    client=(PersonalArrays,),
    client_contract=ClientContract(
        carries="`A`, head; from round 2 an ArrayRecord `personal`",
        helpers="load the node's `B` block and keep it in `context.state`; reply `A`, "
        "`B`, head",
    ),
)
class GlobalSVD(SvdSolverChoice, PersonalLoraStrategy):
    """Server-side SVD of the stacked client updates.

    The server keeps each node's latest ``lora_B`` block only to deliver it
    (with the next train and evaluate instructions). ``svd_solver``
    (``svd-solver``: ``auto``, ``exact``, ``randomized``;
    :mod:`fedlr.strategies.svd_solver`) picks the SVD's path.

    The global arrays are the shared ``lora_A`` and the head: a server-side
    ``evaluate_fn`` that loads them (``strategy.load_into``) keeps the
    model's initial ``lora_B`` and so evaluates no client's model; the
    clients' federated evaluation (each with its own block) is the method's
    accuracy, and their own metrics go to ``evaluate_metrics_aggr_fn`` too.

    Parameters: see :class:`~fedlr.strategies.lora_svd.PersonalLoraStrategy`.
    """

    aggregation_space: ClassVar[str] = PRODUCT  # an SVD / fold of the products

    method_options: SvdSolverOptions

    extra_columns: tuple[str, ...] = (
        *PersonalLoraStrategy.extra_columns,
        "svd-randomized",
    )
    send_roles: ClassVar[tuple[Role, ...]] = (Role.LORA_A, Role.HEAD)
    train_roles: ClassVar[tuple[Role, ...]] = (Role.LORA_A, Role.LORA_B, Role.HEAD)
    keep_roles: ClassVar[tuple[Role, ...]] = ()

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
        personal: dict[int, dict[str, torch.Tensor]] = {u.node_id: {} for u in updates}
        layers: dict[str, tuple[float, float]] = {}
        randomized = False
        for m in self.layout.modules:
            a, bs, svd = updates_svd(
                [u.arrays[m.b_key] for u in updates],
                [u.arrays[m.a_key] for u in updates],
                weights,
                m.rank,
                cost=DEFAULT_COST_MODEL,
                seed=self.seed + server_round,
                solver=self.svd_solver,
            )
            self.note_svd(
                "global-svd",
                m.name,
                svd,
                clients=len(updates),
                rank=m.rank,
                shape=(m.d_out, m.d_in),
            )
            randomized = randomized or svd.randomized
            dtype = current[m.a_key].dtype
            padded = [
                pad_factors(b, a, m.rank, seed=self.seed + server_round) for b in bs
            ]
            state[m.a_key] = padded[0][1].to(dtype)
            for u, (b, _) in zip(updates, padded, strict=True):
                personal[u.node_id][m.b_key] = b.to(dtype)
            layers[m.name] = (math.sqrt(svd.tail_energy), math.sqrt(svd.total_energy))
        self.personal.update(personal)
        report = self._report(layers, **{"svd-randomized": float(randomized)})
        return state, self.with_personal_count(updates, report)


@register_method(
    "local-svd",
    payload=LORA,
    summary="each client SVDs its own update; server averages the shared lora_A",
    client=(PersonalArrays, ClientSvd),
    client_contract=ClientContract(
        carries="`A`, head; `keep-roles` `lora_B`; `client-svd`",
        helpers="re-factor `(B, A)` by the SVD of `B A`; reply `A`, head and "
        "`personal-gram`; keep `B`",
    ),
)
class LocalSVD(PersonalLoraStrategy):
    """Client-side SVD; the server averages the input-side factor.

    Parameters: see :class:`~fedlr.strategies.lora_svd.PersonalLoraStrategy`.
    """

    send_roles: ClassVar[tuple[Role, ...]] = (Role.LORA_A, Role.HEAD)
    train_roles: ClassVar[tuple[Role, ...]] = (Role.LORA_A, Role.HEAD)
    keep_roles: ClassVar[tuple[Role, ...]] = (Role.LORA_B,)

    def round_config(self, server_round: int) -> dict[str, Any]:
        config = super().round_config(server_round)
        config[CLIENT_SVD] = True
        return config

    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        state = self.averaged(updates, current)
        return state, self.personal_gap_report(updates, state)
