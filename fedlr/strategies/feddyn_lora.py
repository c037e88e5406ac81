"""FedDyn-LoRA: dynamic regularisation of the clients, corrected on the server.

FedDyn [1]_ (Algorithm 1) changes each client's objective so that the
stationary points of the clients' problems agree with the global one. Over
the parameters the clients train (here every ``lora_A``, ``lora_B`` and the
head; ``A`` and ``B`` of a layer are regularised separately), client ``k``
keeps ``g_k``, its last ``grad L_k`` as the paper's first-order condition
gives it (zero at first), and in round ``t`` minimises

    L_k(theta) - <g_k, theta - theta_{t-1}> + (alpha / 2) ||theta - theta_{t-1}||^2

from the global ``theta_{t-1}`` it received (the linear term is taken
relative to ``theta_{t-1}``, a constant away from the paper's
``-<g_k, theta>``: the same gradient, the same minimiser, a loss that starts
at zero). It then sets

    g_k <- g_k - alpha (theta_k - theta_{t-1})

and replies ``theta_k``. The server keeps ``h`` (zero at first) and, with
``P`` the round's clients, ``m`` the nodes it sampled them from and ``w_k``
their shares of ``u.weight`` (``num-examples``),

    h       <- h - alpha (|P| / m) sum_k w_k (theta_k - theta_{t-1}),
    theta_t  = sum_k w_k theta_k - h / alpha.

With equal weights, ``(|P| / m) sum_k w_k = (1 / m) sum_k``: the paper's
uniform sums. The aggregation reads only the weighted sum of the replies and
their number, so it is sum-only.

What travels: ``feddyn-alpha`` in the round's ConfigRecord; nothing beyond
the arrays. ``g_k`` stays on the node, in ``context.state``.

References
----------
.. [1] Acar, Zhao, Matas, Mattina, Whatmough, Saligrama, "Federated Learning
   Based on Dynamic Regularization" (FedDyn), ICLR 2021.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Self, cast

import torch
from flwr.app import ArrayRecord, MetricRecordValues, RecordDict

from fedlr.adapters.lora import LoraModel, parameters_by_key
from fedlr.client.features import Bound, ClientFeature, Record, RoundJob
from fedlr.client_apps.payloads import LORA
from fedlr.errors import ProtocolError
from fedlr.flower.records import config_float, record_to_state
from fedlr.linalg import weighted_mean
from fedlr.options import NoOptions, option
from fedlr.strategies.base import ClientUpdate, RoundReport
from fedlr.strategies.lora import LoraStrategy, lora_model, saved_tensors
from fedlr.strategies.registration import ClientContract, register_method

__all__ = ["FEDDYN_ALPHA", "DynamicRegulariser", "FedDynLoRA", "FedDynOptions"]

FEDDYN_ALPHA = "feddyn-alpha"
"""Instruction key: FedDyn's ``alpha`` (> 0), the weight of the clients'
dynamic regulariser."""
_NODE_GRADIENT = "fedlr-feddyn"
"""``context.state`` ArrayRecord: the node's ``g_k``, keyed as the trained
arrays."""
CORRECTION_NORM = "feddyn-correction-norm"
"""The round's ``||h / alpha||_F``: how far the published model is from the
clients' weighted mean."""


class DynamicRegulariser(ClientFeature):
    """The client side: FedDyn's linear and quadratic terms, and ``g_k``.

    On for a ``train`` instruction that carries ``feddyn-alpha`` (a LoRA
    model only). The term over the trained parameters ``p`` (anchors ``p_0``:
    their values as loaded, the global ones) is

        sum_p -<g_p, p - p_0> + (alpha / 2) ||p - p_0||^2,

    with gradient ``-g_p + alpha (p - p_0)``; after training the node keeps
    ``g_p - alpha (p_trained - p_0)``. The node's ``g`` is read back per
    key: a missing key, or one of another shape (the rank changed), starts
    at zero; a non-floating or non-finite one is refused. A round whose
    trained arrays are not finite leaves ``g`` as it was (the server drops
    that reply).

    The term reads no data (the parameters, the received ones and ``g``, the
    node's post-processed history of its own replies), so DP-SGD adds its
    gradient after the per-example clipping and noise
    (:mod:`fedlr.privacy.dp_sgd`).
    """

    keys = (Bound(FEDDYN_ALPHA, "float", 0.0, low_open=True),)
    node_state = (
        Record(
            _NODE_GRADIENT,
            "the node's `g_k` (its last ∇L_k by FedDyn's first-order condition), "
            "keyed as the trained arrays (an ArrayRecord)",
        ),
    )
    loss_reads_data = False
    order = 42

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.params: dict[str, torch.nn.Parameter] = {}
        self.anchors: dict[str, torch.Tensor] = {}
        self.gradient: dict[str, torch.Tensor] = {}
        self.calls = 0

    @classmethod
    def training_change(cls, options: Any) -> str | None:
        alpha = options.feddyn_alpha if isinstance(options, FedDynOptions) else None
        return (
            f"FedDyn's dynamic regulariser (feddyn-alpha = {alpha:g})"
            if alpha is not None
            else "FedDyn's dynamic regulariser"
        )

    @classmethod
    def for_round(cls, job: RoundJob) -> Self | None:
        if not job.is_train or FEDDYN_ALPHA not in job.config:
            return None
        alpha = config_float(job.config, FEDDYN_ALPHA)
        if not (math.isfinite(alpha) and alpha > 0):
            raise ProtocolError(f"'{FEDDYN_ALPHA}' must be finite and > 0, got {alpha}")
        lora_model(job, f"'{FEDDYN_ALPHA}' regularises LoRA factors")
        return cls(alpha)

    def loss(self, job: RoundJob) -> Callable[[], torch.Tensor]:
        view = cast(LoraModel, job.adapted)  # for_round checked it
        trained = view.layout.keys(*job.train_roles)
        by_key = parameters_by_key(view.model, view.layout)
        self.params = {k: by_key[k] for k in trained}
        self.anchors = {k: p.detach().clone() for k, p in self.params.items()}
        kept = _kept_gradient(job, {k: tuple(p.shape) for k, p in self.params.items()})
        self.gradient = {
            k: kept[k].to(p.device, p.dtype) if k in kept else torch.zeros_like(p)
            for k, p in self.anchors.items()
        }
        params, alpha = self.params, self.alpha
        # the training loop may move the model to another device after this
        placed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

        def term() -> torch.Tensor:
            self.calls += 1
            total: torch.Tensor | None = None
            for key, p in params.items():
                p0, g = placed.get(key) or (self.anchors[key], self.gradient[key])
                if p0.device != p.device or p0.dtype != p.dtype:
                    p0, g = p0.to(p.device, p.dtype), g.to(p.device, p.dtype)
                placed[key] = (p0, g)
                step = p - p0
                value = 0.5 * alpha * step.pow(2).sum() - (g * step).sum()
                total = value if total is None else total + value
            return total if total is not None else torch.zeros(())

        return term

    def reply_records(
        self,
        job: RoundJob,
        trained: dict[str, torch.Tensor],
        metrics: dict[str, MetricRecordValues],
        content: RecordDict,
    ) -> None:
        if self.calls == 0:
            raise ProtocolError(
                "feddyn-lora adds a loss term: add job.penalty() to every step's "
                "loss (fedlr.client.round.ClientRound.penalty)"
            )
        new: dict[str, torch.Tensor] = {}
        for key, g in self.gradient.items():
            step = trained[key].double() - self.anchors[key].double().cpu()
            new[key] = (g.double().cpu() - self.alpha * step).to(trained[key].dtype)
        if all(bool(torch.isfinite(v).all()) for v in new.values()):
            job.context.state[_NODE_GRADIENT] = ArrayRecord(new)


def _kept_gradient(
    job: RoundJob, shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """The node's ``g`` of the keys in ``shapes`` that it kept at their shape.

    Raises
    ------
    ProtocolError
        If a kept entry is not floating point or not finite (the node never
        writes one: something else changed its state).
    """
    record = job.context.state.array_records.get(_NODE_GRADIENT)
    if record is None:
        return {}
    kept = {
        k: v
        for k, v in record_to_state(record).items()
        if k in shapes and tuple(v.shape) == shapes[k]
    }
    for key, value in kept.items():
        if not value.is_floating_point() or not bool(torch.isfinite(value).all()):
            raise ProtocolError(
                f"the node's '{_NODE_GRADIENT}' state is not finite floating point "
                f"at '{key}' ({value.dtype}); clear it to restart FedDyn at g = 0"
            )
    return kept


@dataclass(frozen=True)
class FedDynOptions(NoOptions):
    """FedDyn-LoRA's run-config key."""

    feddyn_alpha: float = option(
        0.01,
        "FedDyn's α: weight of the clients' dynamic regulariser "
        "−⟨g_k, θ⟩ + (α/2)·‖θ − θ_global‖² and of their g_k's update "
        "([methods/feddyn-lora.md](methods/feddyn-lora.md))",
        range="> 0",
    )


@register_method(
    "feddyn-lora",
    payload=LORA,
    options=FedDynOptions,
    summary="FedDyn: clients' dynamic regulariser; the mean of A and B minus h/α",
    client=(DynamicRegulariser,),
    sum_only=True,
    client_contract=ClientContract(
        carries="as FedAvg, plus `feddyn-alpha`",
        helpers="`job.penalty()` is FedDyn's regulariser `−⟨g, θ − θ_global⟩ + "
        "(α/2)‖θ − θ_global‖²`; add it to your loss; `job.reply()` updates "
        "`g` and keeps it in `context.state`",
    ),
)
class FedDynLoRA(LoraStrategy):
    """FedAvg-LoRA's mean corrected by FedDyn's server state ``h``.

    ``h`` (per trained tensor, zero at the start, in the tensor's dtype) is
    saved in :meth:`state_dict`; nothing else changes in a round. The round
    reports the Frobenius gap of the weighted mean (as ``fedavg-lora`` does)
    and ``feddyn-correction-norm``, ``||h / alpha||_F``.

    Parameters
    ----------
    options : FedDynOptions, optional
        ``feddyn_alpha`` (or pass it by name).
    **kwargs
        Other parameters: see :class:`~fedlr.strategies.lora.LoraStrategy`.
    """

    method_options: FedDynOptions

    extra_columns: tuple[str, ...] = (CORRECTION_NORM,)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.h: dict[str, torch.Tensor] = {
            key: torch.zeros(shape)
            for key, shape in self.layout.shapes(*self.train_roles).items()
        }

    def round_config(self, server_round: int) -> dict[str, Any]:
        """The base round config plus ``feddyn-alpha``."""
        config = super().round_config(server_round)
        config[FEDDYN_ALPHA] = self.method_options.feddyn_alpha
        return config

    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        alpha = self.method_options.feddyn_alpha
        share = len(updates) / max(self.nodes_sampled_from, len(updates))
        weights = [u.weight for u in updates]
        state = dict(current)
        moved: dict[str, torch.Tensor] = {}
        norm_sq = 0.0
        for key in self.layout.keys(*self.train_roles):
            x = current[key].double()
            mean = weighted_mean(
                [u.arrays[key] for u in updates], weights, dtype=torch.float64
            )
            h = self.h[key].double() - alpha * share * (mean - x)
            correction = h / alpha
            moved[key] = h.to(current[key].dtype)
            state[key] = (mean - correction).to(current[key].dtype)
            norm_sq += float(correction.square().sum())
        self.h = moved
        report = self.gap_report(updates)
        report.metrics[CORRECTION_NORM] = math.sqrt(norm_sq)
        return state, report

    def state_dict(self) -> dict[str, Any]:
        """FedDyn's ``h``, by tensor key."""
        return {"h": {k: v.clone() for k, v in self.h.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``h`` of :meth:`state_dict`.

        Raises
        ------
        ValueError
            For an unknown key, or an ``h`` that does not fit the layout.
        """
        shapes = self.layout.shapes(*self.train_roles)
        saved = saved_tensors(self, state, "h", shapes, complete=True)
        if saved is not None:
            self.h = saved
