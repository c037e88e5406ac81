"""FedDPA: a global LoRA adapter shared by all, a local one kept by each client.

FedDPA [1]_ gives every client two adapters on the same frozen model: the
global adapter ``G = s B_g A_g`` (FedAvg-aggregated by the server) and a
local adapter ``L = s B_l A_l`` that never leaves the client. This module
implements the iterative variant, FedDPA-T. In round ``t >= 2`` client ``i``
trains, from the received global adapter,

    the global adapter alone:   h = W0 x + G x                      (sent),
    the local adapter in a mix: h = W0 x + (1 - a) [G x] + a L x    (kept),

``[.]`` no gradient (the global adapter is frozen for the local loss) and
``a`` the mix share (``feddpa-mix``, the authors' ``local_weight``, 0.5).
fedlr takes one step of each per local step on the same batch (the authors'
code runs the local epochs, then the global ones). Round 1 trains the
global adapter only. The server averages ``A_g``, ``B_g`` and the head by
examples, as FedAvg-LoRA.

At inference the client weights the two adapters per instance: with
``phi(x)`` the instance's representation under the local adapter (the
output of the last adapted layer, mean-pooled over positions) and
``phi_1 .. phi_K`` those of ``K`` of its own training instances (kept on the
node),

    alpha(x) = clip(w * (1 / K) sum_k cos(phi(x), phi_k), 0, 1),
    h        = W0 x + (1 - alpha(x)) G x + alpha(x) L x,

``w`` the weight cap (``feddpa-weight``, the authors' 0.5). Evaluation is
personalised (as :class:`~fedlr.strategies.lora_svd.PersonalLoraStrategy`):
each client evaluates its own dual-adapter model on its own held-out part
and the round reports the mean and spread.

What travels: the global adapter and head, as FedAvg-LoRA, and the
ConfigRecord keys ``feddpa-weight``, ``feddpa-anchors`` (``K``) and, from
round 2, ``feddpa-mix``. The local adapter and the ``K`` representations
stay in the node's ``context.state``.

References
----------
.. [1] Yang, Long, Shen, Jiang, Blumenstein, "Dual-Personalizing Adapter for
   Federated Foundation Models" (FedDPA), NeurIPS 2024.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Self, cast

import torch
from flwr.app import ArrayRecord, MetricRecordValues, RecordDict

from fedlr.adapters.lora import LoraModel
from fedlr.adapters.plugin import lora_layers
from fedlr.adapters.roles import Role
from fedlr.client.features import Bound, ClientFeature, Record, RoundJob, StepTogether
from fedlr.client_apps.payloads import LORA
from fedlr.errors import ProtocolError
from fedlr.flower.records import config_float, config_int, record_to_state
from fedlr.options import NoOptions, option
from fedlr.strategies.base import ClientUpdate, RoundReport, weighted_means
from fedlr.strategies.lora import lora_model
from fedlr.strategies.lora_svd import PersonalLoraStrategy
from fedlr.strategies.registration import ClientContract, register_method

__all__ = [
    "FEDDPA_ANCHORS",
    "FEDDPA_MIX",
    "FEDDPA_WEIGHT",
    "DualAdapter",
    "FedDPA",
    "FedDPAOptions",
    "dynamic_weight",
]

FEDDPA_MIX = "feddpa-mix"
"""Instruction key: ``a`` in (0, 1), the local adapter's share in the mix it
trains in (rounds >= 2; absent: the local adapter does not train)."""
FEDDPA_WEIGHT = "feddpa-weight"
"""Instruction key: ``w`` in (0, 1], the cap of the dynamic weight."""
FEDDPA_ANCHORS = "feddpa-anchors"
"""Instruction key: ``K``, how many training instances' representations the
node keeps for the dynamic weight."""
LOCAL_STEPS = "feddpa-local-steps"
"""Reply metric: the steps the local adapter took this round."""
_NODE_LOCAL = "fedlr-feddpa-local"
"""``context.state`` ArrayRecord: the local adapter, keyed as the layout's A, B."""
_NODE_ANCHORS = "fedlr-feddpa-anchors"
"""``context.state`` ArrayRecord ``{"anchors": (K, d)}``."""

_HOOKS: weakref.WeakKeyDictionary[torch.nn.Module, list[Any]] = (
    weakref.WeakKeyDictionary()
)
"""The hook handles a round left on a (cached) model, removed by the next."""


# ------------------------------------------------------------------ kernel
def dynamic_weight(
    representations: torch.Tensor, anchors: torch.Tensor, cap: float
) -> torch.Tensor:
    """FedDPA's instance-wise weight of the local adapter.

    Parameters
    ----------
    representations : (n, d) tensor
        ``phi(x)`` of the instances to weight.
    anchors : (K, d) tensor
        ``phi_k`` of the node's training instances.
    cap : float
        ``w`` in (0, 1].

    Returns
    -------
    (n,) float64 tensor
        ``clip(w * mean_k cos(phi(x), phi_k), 0, 1)`` (a zero vector has
        cosine 0).
    """
    if representations.dim() != 2 or anchors.dim() != 2:
        raise ValueError(
            f"expected (n, d) and (K, d), got {tuple(representations.shape)} "
            f"and {tuple(anchors.shape)}"
        )
    if representations.shape[1] != anchors.shape[1]:
        raise ValueError(
            f"representations of width {representations.shape[1]} against "
            f"anchors of width {anchors.shape[1]}"
        )
    x = torch.nn.functional.normalize(representations.double(), dim=1)
    k = torch.nn.functional.normalize(anchors.double(), dim=1)
    return (cap * (x @ k.T).mean(dim=1)).clamp(0.0, 1.0)


def _pooled(output: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """(n, ..., d) -> (n, d): the mean over the positions (``mask``: real ones)."""
    if output.dim() == 2:
        return output
    flat = output.reshape(output.shape[0], -1, output.shape[-1])
    if mask is not None and mask.shape == flat.shape[:2]:
        m = mask.to(flat.dtype).unsqueeze(-1)
        return (flat * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)
    return flat.mean(dim=1)


def _first(value: Any, count: int) -> Any:
    """The first ``count`` rows of every tensor in ``value`` (args, kwargs)."""
    if isinstance(value, torch.Tensor):
        return value[:count].detach().clone() if value.dim() else value
    if isinstance(value, dict):
        return {k: _first(v, count) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_first(v, count) for v in value)
    return value


# ------------------------------------------------------------------ client
class DualAdapter(ClientFeature):
    """The client side: the local adapter, its training and the weighted model.

    On for every instruction carrying ``feddpa-weight`` (a LoRA model only).
    The local adapter lives beside the model's own (global) LoRA layers as
    forward hooks; its ``A_l``, ``B_l`` are kept in ``context.state``
    (started as the received global ``A`` and ``B = 0``, so its update starts
    at zero; a kept one of another shape restarts so).

    Training (``feddpa-mix`` present): the round's loss term
    (``job.penalty()``) re-runs the step's forward with the local adapter in
    the mix and returns that loss; it needs a model that returns its loss
    (``output.loss``) when called with its labels, as fedlr's tasks and
    Hugging Face models do (otherwise the local adapter does not train this
    round and ``feddpa-local-steps`` says 0). The local adapter's AdamW steps
    with the round's optimizer (``job.optimizer``). At the reply the node
    keeps the local adapter and the representations of ``K`` training
    instances (the last batch seen).

    Evaluation: every forward first computes ``phi(x)`` under the local
    adapter alone, then runs the weighted model.
    """

    keys = (
        Bound(FEDDPA_MIX, "float", 0.0, 1.0, low_open=True),
        Bound(FEDDPA_WEIGHT, "float", 0.0, 1.0, low_open=True),
        Bound(FEDDPA_ANCHORS, "int", 1, 4096),
    )
    node_state = (
        Record(_NODE_LOCAL, "the node's local adapter `A_l`, `B_l` per layer"),
        Record(
            _NODE_ANCHORS,
            "`phi_k`: the representations of `K` of the node's training instances",
        ),
    )
    metrics = (Record(LOCAL_STEPS, "the steps the local adapter took this round"),)
    order = 50

    def __init__(
        self, mix: float | None, weight: float, anchors: int, *, train: bool
    ) -> None:
        self.mix, self.weight, self.count, self.train = mix, weight, anchors, train
        self.local: dict[str, torch.Tensor] = {}
        self.kept_anchors: torch.Tensor | None = None
        self.mode = "global"
        self.alpha: torch.Tensor | float = 0.0
        self.captured: tuple[Any, dict[str, Any]] | None = None
        self.representation: torch.Tensor | None = None
        self.busy = False
        self.steps = 0
        self.model: torch.nn.Module | None = None

    @classmethod
    def training_change(cls, options: Any) -> str | None:
        return "FedDPA's local adapter, trained on the data beside the global one"

    @classmethod
    def for_round(cls, job: RoundJob) -> Self | None:
        if FEDDPA_WEIGHT not in job.config:
            return None
        weight = config_float(job.config, FEDDPA_WEIGHT)
        anchors = config_int(job.config, FEDDPA_ANCHORS, 5)
        mix = config_float(job.config, FEDDPA_MIX) if FEDDPA_MIX in job.config else None
        if not (math.isfinite(weight) and 0.0 < weight <= 1.0):
            raise ProtocolError(f"'{FEDDPA_WEIGHT}' must be in (0, 1], got {weight}")
        if mix is not None and not (0.0 < mix < 1.0):
            raise ProtocolError(f"'{FEDDPA_MIX}' must be in (0, 1), got {mix}")
        lora_model(job, f"'{FEDDPA_WEIGHT}' weighs two LoRA adapters")
        return cls(mix if job.is_train else None, weight, anchors, train=job.is_train)

    # ----------------------------------------------------------- the round
    def load(
        self,
        job: RoundJob,
        received: dict[str, torch.Tensor],
        state: dict[str, torch.Tensor],
    ) -> None:
        view = cast(LoraModel, job.adapted)
        kept = job.context.state.array_records
        own = record_to_state(kept[_NODE_LOCAL]) if _NODE_LOCAL in kept else {}
        shapes = view.layout.shapes(Role.LORA_A, Role.LORA_B)
        fits = bool(own) and all(
            k in own and tuple(own[k].shape) == s for k, s in shapes.items()
        )
        for m in view.layout.modules:
            if fits:
                a, b = own[m.a_key].double(), own[m.b_key].double()
            else:
                a = state[m.a_key].detach().double().clone()
                b = torch.zeros(m.d_out, m.rank, dtype=torch.float64)
            self.local[m.a_key], self.local[m.b_key] = a.float(), b.float()
        job.personal_loaded = job.personal_loaded or fits
        if _NODE_ANCHORS in kept and fits:
            self.kept_anchors = record_to_state(kept[_NODE_ANCHORS]).get("anchors")
        if self.mix is not None:
            for t in self.local.values():
                t.requires_grad_(True)
        self._install(view)

    def _install(self, view: LoraModel) -> None:
        model = view.model
        for handle in _HOOKS.pop(model, []):
            handle.remove()
        layers = lora_layers(model)
        adapter = model.active_adapter
        handles: list[Any] = [
            model.register_forward_pre_hook(self._before, with_kwargs=True)
        ]
        last = view.layout.modules[-1].name
        for m in view.layout.modules:
            layer = layers[m.name]
            handles.append(
                cast(torch.nn.Module, layer).register_forward_hook(
                    self._layer_hook(layer, adapter, m.a_key, m.b_key, m.name == last)
                )
            )
        _HOOKS[model] = handles
        self.model = model

    def _layer_hook(
        self, layer: Any, adapter: str, a_key: str, b_key: str, last: bool
    ) -> Callable[..., torch.Tensor | None]:
        def hook(
            module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor
        ) -> torch.Tensor | None:
            if self.mode == "global":
                return None
            x = args[0]
            scale = float(layer.scaling[adapter])
            drop = layer.lora_dropout[adapter]
            a = self.local[a_key].to(x.device, x.dtype)
            b = self.local[b_key].to(x.device, x.dtype)
            local = scale * (drop(x) @ a.T) @ b.T
            base = layer.base_layer(x)
            if self.mode == "local":
                out = base + local
                if last:
                    self.representation = out.detach()
                return out
            glob = scale * layer.lora_B[adapter](layer.lora_A[adapter](drop(x)))
            if self.mode == "mix":
                share = cast(float, self.mix)
                # G's parameters are frozen by the loss term (not its path)
                return base + (1.0 - share) * glob + share * local
            alpha = self.alpha
            if isinstance(alpha, torch.Tensor):
                alpha = alpha.to(x.device, x.dtype).reshape(-1, *([1] * (x.dim() - 1)))
            return base + (1.0 - alpha) * glob + alpha * local

        return hook

    def _before(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        if self.busy:
            return
        if self.train:  # remember the step's inputs (the mix, the anchors)
            self.captured = (args, kwargs)
            return
        if self.kept_anchors is None:
            return  # no local adapter trained yet: the global model alone
        self.mode = "local"
        self.busy = True
        try:
            with torch.no_grad():
                module(*args, **kwargs)
        finally:
            self.busy = False
        mask = kwargs.get("attention_mask")
        rep = _pooled(cast(torch.Tensor, self.representation), mask)
        self.alpha = dynamic_weight(rep.cpu(), self.kept_anchors, self.weight).float()
        self.mode = "weighted"

    def loss(self, job: RoundJob) -> Callable[[], torch.Tensor] | None:
        if self.mix is None:
            return None

        def term() -> torch.Tensor:
            if self.captured is None or self.model is None:
                return torch.zeros(())
            args, kwargs = self.captured
            # the local loss trains the local adapter only (not the head)
            shared = [p for p in job.parameters()]
            for p in shared:
                p.requires_grad_(False)
            self.mode, self.busy = "mix", True
            try:
                output = self.model(*args, **kwargs)
            finally:
                self.mode, self.busy = "global", False
                for p in shared:
                    p.requires_grad_(True)
            loss = getattr(output, "loss", None)
            if not isinstance(loss, torch.Tensor):
                return torch.zeros(())
            self.steps += 1
            return loss

        return term

    def wrap_optimizer(
        self, job: RoundJob, optimizer: torch.optim.Optimizer
    ) -> torch.optim.Optimizer:
        if self.mix is None:
            return optimizer
        return StepTogether.beside(optimizer, self.local.values())

    def reply_records(
        self,
        job: RoundJob,
        trained: dict[str, torch.Tensor],
        metrics: dict[str, MetricRecordValues],
        content: RecordDict,
    ) -> None:
        local = {
            k: v.detach().cpu().float().contiguous() for k, v in self.local.items()
        }
        if all(bool(torch.isfinite(v).all()) for v in local.values()):
            job.context.state[_NODE_LOCAL] = ArrayRecord(local)
            trained_local = self.mix is not None and self.steps > 0
            if trained_local and self.captured is not None and self.model is not None:
                args, kwargs = _first(self.captured, self.count)
                self.mode, self.busy = "local", True
                try:
                    with torch.no_grad():
                        self.model(*args, **kwargs)
                finally:
                    self.mode, self.busy = "global", False
                rep = _pooled(
                    cast(torch.Tensor, self.representation),
                    kwargs.get("attention_mask"),
                )
                job.context.state[_NODE_ANCHORS] = ArrayRecord(
                    {"anchors": rep.detach().cpu().float().contiguous()}
                )
        metrics[LOCAL_STEPS] = self.steps
        self.mode, self.captured = "global", None
        if self.model is not None:
            for handle in _HOOKS.pop(self.model, []):
                handle.remove()


# ------------------------------------------------------------------ server
@dataclass(frozen=True)
class FedDPAOptions(NoOptions):
    """FedDPA's run-config keys (the authors' defaults)."""

    feddpa_mix: float = option(
        0.5,
        "FedDPA's local-adapter share a in the mix it trains in "
        "([methods/feddpa.md](methods/feddpa.md))",
        range="(0, 1)",
    )
    feddpa_weight: float = option(
        0.5,
        "FedDPA's cap w of the instance-wise weight of the local adapter",
        range="(0, 1]",
    )
    feddpa_anchors: int = option(
        5,
        "FedDPA's K: the training instances each node keeps representations of",
        range="[1, 4096]",
    )


@register_method(
    "feddpa",
    payload=LORA,
    options=FedDPAOptions,
    summary="FedAvg of a global adapter; each client keeps a local adapter, "
    "weighted per instance at inference (personalised)",
    client=(DualAdapter,),
    sum_only=True,
    client_contract=ClientContract(
        carries="`A`, `B`, head; `keep-roles` empty, `personal-split`, "
        "`feddpa-weight`, `feddpa-anchors`; from round 2 `feddpa-mix`",
        helpers="call your model with its labels (so it returns `.loss`), add "
        "`job.penalty()` (the local adapter's loss in the mix W0 + (1 − a)G + "
        "aL) and step with `job.optimizer(...)`; `job.reply()` keeps the "
        "local adapter and K representations in `context.state`; at "
        "evaluation `job.model` is the per-instance weighted W0 + (1 − α(x))G "
        "+ α(x)L",
    ),
)
class FedDPA(PersonalLoraStrategy):
    """FedAvg of the global adapter; the clients keep and weigh a local one.

    Federated, personalised evaluation as :class:`PersonalLoraStrategy`
    (``personal-clients``: the clients that started from a kept local
    adapter).

    Parameters
    ----------
    options : FedDPAOptions, optional
        ``feddpa_mix``, ``feddpa_weight``, ``feddpa_anchors`` (or by name).
    **kwargs
        Other parameters: see :class:`PersonalLoraStrategy`.
    """

    method_options: FedDPAOptions

    send_roles: ClassVar[tuple[Role, ...]] = (Role.LORA_A, Role.LORA_B, Role.HEAD)
    train_roles: ClassVar[tuple[Role, ...]] = (Role.LORA_A, Role.LORA_B, Role.HEAD)
    keep_roles: ClassVar[tuple[Role, ...]] = ()

    def round_config(self, server_round: int) -> dict[str, Any]:
        """``feddpa-weight``, ``feddpa-anchors``; ``feddpa-mix`` from round 2."""
        config = super().round_config(server_round)
        opts = self.method_options
        config[FEDDPA_WEIGHT] = opts.feddpa_weight
        config[FEDDPA_ANCHORS] = opts.feddpa_anchors
        if server_round >= 2:
            config[FEDDPA_MIX] = opts.feddpa_mix
        return config

    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        state = dict(current)
        state.update(weighted_means(updates, self.layout.keys(*self.train_roles)))
        return state, self.with_personal_count(updates, self.gap_report(updates))
