"""FedRot-LoRA: align each client's LoRA factors by a rotation before averaging.

A LoRA update ``B A`` is the same for ``(B R)(R^T A)`` with any orthogonal
``R`` (r x r): clients that learn the same update may hold it in different
coordinates of the rank space, and averaging such factors separately loses
the product (FedAvg-LoRA's cross terms ``B_i A_j``). FedRot-LoRA [1]_ has
each client ``i``, after local training, rotate its factors towards the
global ones it received (the reference ``A_ref``, ``B_ref``) before it
replies; the server then averages as FedAvg-LoRA does. With ``M`` the
r x r cross-covariance of the aligned factor and the reference,

    align on A:  M = A_i A_ref^T,   R_i = argmin_{R^T R = I} ||R^T A_i - A_ref||_F,
    align on B:  M = B_i^T B_ref,   R_i = argmin_{R^T R = I} ||B_i R - B_ref||_F,

    M = U S V^T  (SVD)   =>   R_i = U V^T          (orthogonal Procrustes),

    A_i <- R_i^T A_i,   B_i <- B_i R_i           (B_i A_i unchanged),

and the server's ``A = sum_i w_i A_i``, ``B = sum_i w_i B_i``, head likewise.
The aligned factor alternates: ``A`` in even rounds, ``B`` in odd rounds
from round 3; round 1 aligns nothing (every client starts from the same
adapter, with ``B = 0``), as the authors' code does. A softer alignment of
strength ``lambda`` in (0, 1) rotates by the orthogonal polar factor of
``(1 - lambda) I + lambda R_i``, ``R_i`` then the best *rotation*
(``det = +1``, Kabsch's sign correction), as in the authors' code.

What travels: the instruction's ConfigRecord carries ``fedrot-align`` (the
role aligned this round, ``lora_A`` or ``lora_B``; absent in round 1) and
``fedrot-strength`` (``lambda``); nothing else. The alignment runs on the
node, so the server only sums: sum-only, like FedAvg-LoRA.

References
----------
.. [1] Zhang, Kim, Cha, Vikalo, "FedRot-LoRA: Mitigating Rotational
   Misalignment in Federated LoRA", ICML 2026 (arXiv:2602.23638).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Self, cast

import torch

from fedlr.adapters.lora import LoraModel
from fedlr.adapters.roles import Role
from fedlr.client.features import Bound, ClientFeature, RoundJob
from fedlr.client_apps.payloads import LORA
from fedlr.errors import ProtocolError
from fedlr.flower.records import config_float
from fedlr.options import NoOptions, option
from fedlr.strategies.fedavg_lora import FedAvgLoRA
from fedlr.strategies.lora import lora_model
from fedlr.strategies.registration import ClientContract, register_method

__all__ = [
    "FEDROT_ALIGN",
    "FEDROT_STRENGTH",
    "FedRotLoRA",
    "FedRotOptions",
    "RotationAlignment",
    "align_factors",
    "procrustes_rotation",
]

FEDROT_ALIGN = "fedrot-align"
"""Instruction key: the role whose factor is aligned to the received one
this round (``lora_A`` or ``lora_B``); absent: no alignment."""
FEDROT_STRENGTH = "fedrot-strength"
"""Instruction key: the alignment's strength ``lambda`` in (0, 1]."""

_ROLES = {Role.LORA_A.value: Role.LORA_A, Role.LORA_B.value: Role.LORA_B}


# ------------------------------------------------------------------ kernel
def procrustes_rotation(
    factor: torch.Tensor, reference: torch.Tensor, *, role: Role, strength: float = 1.0
) -> torch.Tensor:
    """The orthogonal ``R`` (r x r) that best aligns ``factor`` to ``reference``.

    Parameters
    ----------
    factor, reference : (r, d_in) or (d_out, r) tensor
        ``A_i`` and ``A_ref`` (``role`` ``LORA_A``: minimises
        ``||R^T A_i - A_ref||_F``) or ``B_i`` and ``B_ref`` (``LORA_B``:
        minimises ``||B_i R - B_ref||_F``).
    role : Role
        ``Role.LORA_A`` or ``Role.LORA_B``.
    strength : float, default 1.0
        ``lambda`` in (0, 1]: 1 gives the Procrustes optimum over all
        orthogonal matrices, ``U V^T`` of ``M = U S V^T``; below 1, the
        orthogonal polar factor of ``(1 - lambda) I + lambda R*`` with ``R*``
        the best rotation (``det R* = +1``).

    Returns
    -------
    (r, r) float64 tensor
        Orthogonal: ``R^T R = I``.

    Raises
    ------
    ValueError
        If the shapes do not match, ``role`` is not a factor or ``strength``
        is outside (0, 1].
    """
    if factor.shape != reference.shape or factor.dim() != 2:
        raise ValueError(
            f"factor {tuple(factor.shape)} and reference "
            f"{tuple(reference.shape)} must be 2-D of one shape"
        )
    if not (math.isfinite(strength) and 0.0 < strength <= 1.0):
        raise ValueError(f"strength must be in (0, 1], got {strength}")
    x, ref = factor.double(), reference.double()
    if role is Role.LORA_A:
        cross = x @ ref.T  # (r, r): M = A_i A_ref^T
    elif role is Role.LORA_B:
        cross = x.T @ ref  # (r, r): M = B_i^T B_ref
    else:
        raise ValueError(f"role must be lora_A or lora_B, got {role.value!r}")
    u, _, vh = torch.linalg.svd(cross)
    if strength == 1.0:
        return u @ vh
    if float(torch.linalg.det(u @ vh)) < 0:  # the best rotation, not a reflection
        u = u.clone()
        u[:, -1] = -u[:, -1]
    best = u @ vh
    eye = torch.eye(best.shape[0], dtype=best.dtype)
    pu, _, pvh = torch.linalg.svd((1.0 - strength) * eye + strength * best)
    return pu @ pvh


def align_factors(
    a: torch.Tensor,
    b: torch.Tensor,
    reference: torch.Tensor,
    *,
    role: Role,
    strength: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(R^T A, B R)`` with ``R`` of :func:`procrustes_rotation`, in float64.

    Parameters
    ----------
    a : (r, d_in) tensor
    b : (d_out, r) tensor
    reference : tensor
        ``A_ref`` (r, d_in) for ``role`` ``LORA_A``, ``B_ref`` (d_out, r)
        for ``LORA_B``.
    role : Role
    strength : float, default 1.0

    Returns
    -------
    (r, d_in) tensor, (d_out, r) tensor
        The rotated factors, in the dtypes of ``a`` and ``b``; their product
        is ``B A`` up to rounding.
    """
    factor = a if role is Role.LORA_A else b
    rotation = procrustes_rotation(factor, reference, role=role, strength=strength)
    return ((rotation.T @ a.double()).to(a.dtype), (b.double() @ rotation).to(b.dtype))


# ------------------------------------------------------------------ client
class RotationAlignment(ClientFeature):
    """The client side: rotate the trained factors towards the received ones.

    On for a ``train`` instruction with ``fedrot-align`` (a LoRA model
    training both ``A`` and ``B``). The reference is each layer's factor of
    the aligned role as loaded (the global one); the reply (and nothing the
    node keeps) carries ``R^T A`` and ``B R`` per layer, the head as
    trained. No loss term, no gradient change: DP-SGD composes (the
    rotation post-processes the trained factors with the public global
    ones).
    """

    keys = (
        Bound(FEDROT_ALIGN, "str", note="(`lora_A` or `lora_B`)"),
        Bound(FEDROT_STRENGTH, "float", 0.0, 1.0, low_open=True),
    )
    order = 70

    def __init__(self, role: Role, strength: float) -> None:
        self.role = role
        self.strength = strength
        self.reference: dict[str, torch.Tensor] = {}

    @classmethod
    def for_round(cls, job: RoundJob) -> Self | None:
        if not job.is_train or FEDROT_ALIGN not in job.config:
            return None
        name = job.config[FEDROT_ALIGN]
        role = _ROLES.get(name) if isinstance(name, str) else None
        if role is None:
            raise ProtocolError(
                f"'{FEDROT_ALIGN}' must be one of {sorted(_ROLES)}, got {name!r}"
            )
        strength = config_float(job.config, FEDROT_STRENGTH, 1.0)
        if not (math.isfinite(strength) and 0.0 < strength <= 1.0):
            raise ProtocolError(
                f"'{FEDROT_STRENGTH}' must be in (0, 1], got {strength}"
            )
        lora_model(job, f"'{FEDROT_ALIGN}' rotates LoRA factors")
        missing = {Role.LORA_A, Role.LORA_B} - set(job.train_roles)
        if missing:
            raise ProtocolError(
                f"'{FEDROT_ALIGN}' rotates A and B together; this round does "
                f"not train {sorted(r.value for r in missing)}"
            )
        return cls(role, strength)

    def load(
        self,
        job: RoundJob,
        received: dict[str, torch.Tensor],
        state: dict[str, torch.Tensor],
    ) -> None:
        layout = cast(LoraModel, job.adapted).layout  # for_round checked it
        self.reference = {
            m.name: state[m.a_key if self.role is Role.LORA_A else m.b_key]
            .detach()
            .clone()
            for m in layout.modules
        }

    def reply_arrays(
        self, job: RoundJob, trained: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        layout = cast(LoraModel, job.adapted).layout
        out = dict(trained)
        for m in layout.modules:
            out[m.a_key], out[m.b_key] = align_factors(
                trained[m.a_key],
                trained[m.b_key],
                self.reference[m.name],
                role=self.role,
                strength=self.strength,
            )
        return out


# ------------------------------------------------------------------ server
@dataclass(frozen=True)
class FedRotOptions(NoOptions):
    """FedRot-LoRA's run-config keys."""

    fedrot_reference: str = option(
        "alternate",
        "FedRot-LoRA's aligned factor: `alternate` (A in even rounds, B in odd "
        "rounds from 3), or always `lora_A` or `lora_B` "
        "([methods/fedrot-lora.md](methods/fedrot-lora.md))",
        choices=("alternate", "lora_A", "lora_B"),
    )
    fedrot_strength: float = option(
        1.0,
        "FedRot-LoRA's alignment strength λ (1: the Procrustes rotation; "
        "below 1: the polar factor of (1 − λ)I + λR)",
        range="(0, 1]",
    )


@register_method(
    "fedrot-lora",
    payload=LORA,
    options=FedRotOptions,
    summary="FedAvg of A and B after each client rotates its factors onto the "
    "global ones (orthogonal Procrustes)",
    client=(RotationAlignment,),
    sum_only=True,
    client_contract=ClientContract(
        carries="as FedAvg; from round 2 `fedrot-align` (`lora_A` or `lora_B`) and "
        "`fedrot-strength` λ",
        helpers="nothing to call: `job.reply()` rotates your trained `A`, `B` onto "
        "the received factor of that role (orthogonal Procrustes, `Rᵀ A`, `B "
        "R`; `B A` unchanged)",
    ),
)
class FedRotLoRA(FedAvgLoRA):
    """FedAvg-LoRA whose clients align their factors before replying.

    The server's part is the instruction: from round 2 on, ``fedrot-align``
    (the role of this round's reference) and ``fedrot-strength``. The
    aggregation is FedAvg-LoRA's weighted means; its ``frobenius-gap`` then
    measures what alignment left of the averaging error.

    Parameters
    ----------
    options : FedRotOptions, optional
        ``fedrot_reference``, ``fedrot_strength``; default: their defaults
        (or pass either by name).
    **kwargs
        Other parameters: see :class:`~fedlr.strategies.lora.LoraStrategy`.
    """

    method_options: FedRotOptions

    def aligned_role(self, server_round: int) -> Role | None:
        """The role aligned in ``server_round`` (``None``: round 1, none)."""
        if server_round < 2:
            return None
        choice = self.method_options.fedrot_reference
        if choice != "alternate":
            return _ROLES[choice]
        return Role.LORA_A if server_round % 2 == 0 else Role.LORA_B

    def round_config(self, server_round: int) -> dict[str, Any]:
        """The base round config plus ``fedrot-align`` and ``fedrot-strength``."""
        config = super().round_config(server_round)
        role = self.aligned_role(server_round)
        if role is not None:
            config[FEDROT_ALIGN] = role.value
            config[FEDROT_STRENGTH] = self.method_options.fedrot_strength
        return config
