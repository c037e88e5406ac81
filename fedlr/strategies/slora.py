"""SLoRA: a sparse warm-up of the adapted weights, then LoRA from its SVD.

Babakniya et al. [1]_ close the gap between LoRA and full fine-tuning under
heterogeneous data with a data-driven initialisation, in two stages. fedlr's
rounds (``t`` from 1, ``T1`` = ``slora-warmup-rounds``):

**Stage 1, sparse fine-tuning** (``t <= T1``). A random mask ``M`` of density
``slora-density`` over each adapted layer's weight ``W`` (the same on every
node: drawn from the run's seed and the weight's key, :func:`warmup_mask`)
selects the entries that train. The clients receive ``W_t`` (and the head),
train ``W`` with the gradient masked (``grad <- M * grad``) and send ``W_i``
with every entry outside ``M`` put back to ``W_t`` (so a decoupled weight
decay cannot leak there either). The server publishes, per adapted layer,

    W_{t+1} = W_t + M * (sum_i w_i W_i - W_t),

and the weighted mean of the head; ``A`` and ``B`` do not train (``B = 0``:
the LoRA update is zero).

**The switch** (after round ``T1``'s aggregation). With ``W0`` the pristine
weight and ``Delta = W_{T1+1} - W0`` (non-zero only on ``M``), the truncated
SVD ``Delta_r = U_r S_r V_r^T`` at the LoRA rank ``r`` initialises

    B = U_r sqrt(S_r / s),    A = sqrt(S_r / s) V_r^T,    W <- W0,

``s = lora-alpha / r`` the LoRA scaling, so the published model is
``W0 + s B A = W0 + Delta_r``: the best rank-``r`` approximation of the
warm-up's model. Signs: each column of ``U_r`` has a positive largest-magnitude
entry (ties: the first).

**Stage 2, LoRA** (``t > T1``): FedAvg-LoRA of ``A``, ``B`` and the head from
that start; ``W`` stays ``W0``.

Every aggregation is a weighted mean (the mask and the switch are functions
of the mean): sum-only.

References
----------
.. [1] Babakniya, Elkordy, Ezzeldin, Liu, Song, El-Khamy, Avestimehr, "SLoRA:
   Federated Parameter Efficient Fine-Tuning of Language Models", FL@FM
   NeurIPS 2023 workshop (arXiv:2308.06522).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self, cast

import torch
from flwr.app import ArrayRecord, Message

from fedlr.adapters.lora import LoraModel, parameters_by_key
from fedlr.adapters.roles import Role
from fedlr.client.features import Bound, ClientFeature, RoundJob
from fedlr.client_apps.payloads import LORA
from fedlr.errors import CheckpointStateError, ProtocolError
from fedlr.flower.records import config_float, record_to_state
from fedlr.linalg import weighted_mean
from fedlr.options import NoOptions, option
from fedlr.strategies.base import ClientUpdate, RoundReport, weighted_means
from fedlr.strategies.lora import lora_model
from fedlr.strategies.lora_svd import RoundRoles
from fedlr.strategies.registration import ClientContract, register_method

__all__ = [
    "SLORA_DENSITY",
    "SLORA_MASK_SEED",
    "SLoRA",
    "SLoRAOptions",
    "SparseWarmup",
    "svd_init",
    "warmup_mask",
]

SLORA_DENSITY = "slora-density"
"""Instruction key (stage 1 only): the mask's density, in (0, 1]."""
SLORA_MASK_SEED = "slora-mask-seed"
"""Instruction key (stage 1 only): the seed the node draws the masks from."""


def warmup_mask(
    shape: tuple[int, ...], density: float, seed: int, key: str
) -> torch.Tensor:
    """SLoRA's stage-1 mask of one weight: ``k`` entries of ``shape`` set.

    Parameters
    ----------
    shape : (d_out, d_in) tuple
    density : float in (0, 1]
    seed : int
        The run's seed (``slora-mask-seed``).
    key : str
        The weight's key: every node draws the same mask for it.

    Returns
    -------
    (d_out, d_in) torch.Tensor of bool
        Exactly ``k = max(1, round(density * n))`` entries ``True``
        (``n = d_out d_in``), chosen uniformly without replacement by a CPU
        generator seeded with the CRC-32 of ``"<seed>:<key>"`` (torch's CPU
        generator keeps 32 bits of a seed, so both go into those bits).
    """
    n = math.prod(shape)
    k = min(n, max(1, round(density * n)))
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{key}".encode()))
    mask = torch.zeros(n, dtype=torch.bool)
    mask[torch.randperm(n, generator=g)[:k]] = True
    return mask.view(shape)


def svd_init(
    delta: torch.Tensor, rank: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """LoRA factors of the best rank-``rank`` approximation of ``delta``.

    Parameters
    ----------
    delta : (d_out, d_in) torch.Tensor
        The warm-up's update ``Delta`` (computed in float64).
    rank : int
        ``r``.
    scaling : float
        ``s``: the layer computes ``W0 + s B A``.

    Returns
    -------
    b : (d_out, r) torch.Tensor
        ``U_r sqrt(S_r / s)``.
    a : (r, d_in) torch.Tensor
        ``sqrt(S_r / s) V_r^T``, so ``s b a = Delta_r``.
    kept : float
        ``||Delta_r||_F^2 / ||Delta||_F^2`` (1 when ``Delta`` is zero).
    """
    u, s, vh = torch.linalg.svd(delta.double(), full_matrices=False)
    u, s, vh = u[:, :rank], s[:rank], vh[:rank]
    # signs: the largest-magnitude entry of each column of U is positive
    pivot = u.abs().argmax(dim=0)
    sign = torch.sign(u[pivot, torch.arange(u.shape[1])])
    sign[sign == 0] = 1.0
    u, vh = u * sign, vh * sign[:, None]
    root = torch.sqrt(s / scaling)
    total = float(delta.double().pow(2).sum())
    kept = float(s.pow(2).sum()) / total if total > 0 else 1.0
    return u * root, root[:, None] * vh, kept


class SparseWarmup(ClientFeature):
    """SLoRA's stage 1 on the node: train only the masked entries of ``W``.

    On for a ``train`` instruction that carries ``slora-density`` (with
    ``slora-mask-seed``) and trains the ``base`` role (a LoRA model only).
    After every ``backward`` it multiplies each adapted weight's gradient by
    its mask (:func:`warmup_mask`); the reply puts every entry outside the
    mask back to the received value, so only masked entries ever change.
    """

    keys = (
        Bound(SLORA_DENSITY, "float", 0.0, 1.0, low_open=True),
        Bound(SLORA_MASK_SEED, "int", 0),
    )
    order = 46

    def __init__(self, masks: dict[str, torch.Tensor]) -> None:
        self.masks = masks
        self.received: dict[str, torch.Tensor] = {}
        self.params: dict[str, torch.nn.Parameter] = {}

    @classmethod
    def training_change(cls, options: Any) -> str | None:
        return "SLoRA's sparse warm-up (a mask on the base weights' gradients)"

    @classmethod
    def for_round(cls, job: RoundJob) -> Self | None:
        if not job.is_train or SLORA_DENSITY not in job.config:
            return None
        density = config_float(job.config, SLORA_DENSITY)
        seed = job.config.get(SLORA_MASK_SEED)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ProtocolError(
                f"'{SLORA_DENSITY}' needs an integer '{SLORA_MASK_SEED}'"
            )
        view = lora_model(job, f"'{SLORA_DENSITY}' masks LoRA layers' base weights")
        if Role.BASE not in job.train_roles:
            raise ProtocolError(
                f"'{SLORA_DENSITY}' is SLoRA's warm-up of the base weights, but "
                f"train-roles does not name '{Role.BASE.value}'"
            )
        layout = view.layout
        masks = {
            m.base_key: warmup_mask((m.d_out, m.d_in), density, seed, m.base_key)
            for m in layout.modules
        }
        return cls(masks)

    def load(
        self,
        job: RoundJob,
        received: dict[str, torch.Tensor],
        state: dict[str, torch.Tensor],
    ) -> None:
        """Remember the weights as they are about to be loaded."""
        self.received = {k: state[k].detach().clone() for k in self.masks}

    def after_backward(self, job: RoundJob) -> None:
        if not self.params:
            view = cast(LoraModel, job.adapted)
            by_key = parameters_by_key(view.model, view.layout)
            self.params = {k: by_key[k] for k in self.masks}
        for key, param in self.params.items():
            if param.grad is not None:
                param.grad.mul_(self.masks[key].to(param.grad.device, param.grad.dtype))

    def reply_arrays(
        self, job: RoundJob, trained: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        out = dict(trained)
        for key, mask in self.masks.items():
            if key in out:
                before = self.received[key].to(out[key].dtype)
                out[key] = torch.where(mask, out[key], before)
        return out


@dataclass(frozen=True)
class SLoRAOptions(NoOptions):
    """SLoRA's run-config keys."""

    slora_warmup_rounds: int = option(
        1,
        "rounds of stage 1 (the sparse warm-up of the adapted weights); LoRA "
        "from the SVD of its update after them",
        range=">= 1",
    )
    slora_density: float = option(
        0.01,
        "share of each adapted weight's entries the warm-up trains (the random "
        "mask's density)",
        range="(0, 1]",
    )


@register_method(
    "slora",
    payload=LORA,
    options=SLoRAOptions,
    summary="sparse warm-up of the adapted weights (random mask), then LoRA "
    "initialised from the SVD of the warm-up's update",
    sum_only=True,
    client=(SparseWarmup,),
    client_contract=ClientContract(
        carries="`A`, `B`, head and the adapted layers' base weights; in the warm-up "
        "rounds `train-roles` `base,head` with `slora-density` and "
        "`slora-mask-seed`, then `lora_A,lora_B,head`",
        helpers="warm-up: call `job.after_backward()` after every `backward()` (it "
        "masks the base weights' gradients); `job.reply()` sends the base "
        "weights with the entries outside the mask as received. Then the "
        "plain LoRA round",
    ),
)
class SLoRA(RoundRoles):
    """Stage 1: masked means of the adapted weights; then FedAvg-LoRA.

    ``send_roles`` holds the base weights for the whole run (the key set of
    the global arrays is fixed): they change in stage 1 and are ``W0`` from
    the switch on. :meth:`round_roles` is one round's ``train-roles``.

    Parameters: see :class:`~fedlr.strategies.lora_svd.SeededLoraStrategy`.
    """

    method_options: SLoRAOptions
    send_roles: ClassVar[tuple[Role, ...]] = (
        Role.LORA_A,
        Role.LORA_B,
        Role.HEAD,
        Role.BASE,
    )
    train_roles: ClassVar[tuple[Role, ...]] = (
        Role.LORA_A,
        Role.LORA_B,
        Role.HEAD,
        Role.BASE,
    )
    folds_base: ClassVar[bool] = True
    extra_columns: tuple[str, ...] = ("stage", "svd-kept-energy")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pristine: dict[str, torch.Tensor] = {}
        """``W0`` at the mask's entries, per base key (1-D, row-major)."""
        opts = self.method_options
        self.masks = {
            m.base_key: warmup_mask(
                (m.d_out, m.d_in), opts.slora_density, self.seed, m.base_key
            )
            for m in self.layout.modules
        }

    def stage(self, server_round: int) -> int:
        """1 (sparse warm-up) for ``t <= T1``, 2 (LoRA) after."""
        return 1 if server_round <= self.method_options.slora_warmup_rounds else 2

    def round_roles(self, server_round: int) -> tuple[Role, ...]:
        """Stage 1: the base weights and the head; stage 2: A, B and the head."""
        if self.stage(server_round) == 1:
            return (Role.BASE, Role.HEAD)
        return (Role.LORA_A, Role.LORA_B, Role.HEAD)

    def round_config(self, server_round: int) -> dict[str, Any]:
        config = super().round_config(server_round)
        if self.stage(server_round) == 1:
            config[SLORA_DENSITY] = self.method_options.slora_density
            config[SLORA_MASK_SEED] = self.seed
        return config

    def instructions(
        self,
        server_round: int,
        messages: list[Message],
        arrays: ArrayRecord,
        *,
        train: bool,
    ) -> list[Message]:
        """Unchanged; round 1 keeps ``W0`` at the masks' entries.

        Raises
        ------
        CheckpointStateError
            A stage-1 round after the first without ``W0`` kept (a resumed
            run whose checkpoint has no ``pristine`` state).
        """
        messages = super().instructions(server_round, messages, arrays, train=train)
        if not train:
            return messages
        if self.stage(server_round) == 1 and not self.pristine:
            if server_round != 1:
                raise CheckpointStateError(
                    f"SLoRA: round {server_round} is in the warm-up, but W0 was "
                    "not kept (resume from a checkpoint with the strategy's state)"
                )
            state = record_to_state(arrays)
            self.pristine = {
                k: state[k][mask].clone() for k, mask in self.masks.items()
            }
        return messages

    def state_dict(self) -> dict[str, Any]:
        """The last instructed round and ``W0`` at the masks' entries."""
        return {
            "round": self._round,
            "pristine": {k: v.clone() for k, v in self.pristine.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        unknown = sorted(set(state) - {"round", "pristine"})
        if unknown:
            raise ValueError(f"SLoRA: unknown state keys {unknown}")
        pristine = dict(state.get("pristine", {}))
        for key, values in pristine.items():
            mask = self.masks.get(key)
            if mask is None or tuple(values.shape) != (int(mask.sum()),):
                raise ValueError(
                    f"SLoRA: the saved W0 entries of '{key}' do not fit the masks"
                )
        self.pristine = {k: v.clone() for k, v in pristine.items()}
        self._round = int(state.get("round", 0))

    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        state = dict(current)
        if self.stage(server_round) == 2:
            keys = self.layout.keys(Role.LORA_A, Role.LORA_B, Role.HEAD)
            state.update(weighted_means(updates, keys, like=current))
            report = self.gap_report(updates)
            report.metrics["stage"] = 2.0
            return state, report
        state.update(weighted_means(updates, self.layout.keys(Role.HEAD), like=current))
        weights = [u.weight for u in updates]
        means: dict[str, torch.Tensor] = {}
        for key, mask in self.masks.items():
            means[key] = weighted_mean([u.arrays[key] for u in updates], weights)
            state[key] = torch.where(
                mask, means[key].to(current[key].dtype), current[key]
            )
        metrics = {"stage": 1.0}
        if server_round == self.method_options.slora_warmup_rounds:
            metrics["svd-kept-energy"] = self.switch(state)
        return state, self.warmup_gap_report(state, current, means, metrics)

    def pristine_weight(self, key: str, weight: torch.Tensor) -> torch.Tensor:
        """``W0`` of ``key``: ``weight`` (changed only on the mask) with the
        mask's entries put back to the kept pristine values."""
        w0 = weight.clone()
        w0[self.masks[key]] = self.pristine[key].to(weight.dtype)
        return w0

    def warmup_gap_report(
        self,
        state: Mapping[str, torch.Tensor],
        current: Mapping[str, torch.Tensor],
        means: Mapping[str, torch.Tensor],
        metrics: dict[str, float],
    ) -> RoundReport:
        """Stage 1's gap: the published adapted layers ``W + s B A`` against
        the clients' mean ``sum_i w_i W_i + s B_t A_t`` (the factors they
        received, untrained), per layer, relative to the mean's change
        ``||sum_i w_i W_i - W0||_F``.

        Zero (to rounding) in a round whose clients kept to the mask; at the
        switch, the SVD's truncation ``||Delta - Delta_r||_F``.
        """
        layers: dict[str, tuple[float, float]] = {}
        for m in self.layout.modules:
            mean = means[m.base_key].double()
            w0 = self.pristine_weight(m.base_key, state[m.base_key]).double()
            sent = current[m.b_key].double() @ current[m.a_key].double()
            product = state[m.b_key].double() @ state[m.a_key].double()
            published = state[m.base_key].double() + m.scaling * product
            gap = published - (mean + m.scaling * sent)
            layers[m.name] = (
                float(torch.linalg.matrix_norm(gap)),
                float(torch.linalg.matrix_norm(mean - w0)),
            )
        return RoundReport.from_layers(layers, rank=float(self.rank), **metrics)

    def switch(self, state: dict[str, torch.Tensor]) -> float:
        """Stage 1 -> 2 in place: ``W <- W0``, ``(B, A)`` from the SVD of
        ``W - W0``; returns the kept energy over every layer."""
        kept_sq = total_sq = 0.0
        for m in self.layout.modules:
            mask, weight = self.masks[m.base_key], state[m.base_key]
            delta = torch.zeros(weight.shape, dtype=torch.float64)
            delta[mask] = weight[mask].double() - self.pristine[m.base_key].double()
            b, a, kept = svd_init(delta, m.rank, m.scaling)
            norm_sq = float(delta.pow(2).sum())
            kept_sq, total_sq = kept_sq + kept * norm_sq, total_sq + norm_sq
            state[m.base_key] = self.pristine_weight(m.base_key, weight)
            state[m.b_key] = b.to(state[m.b_key].dtype)
            state[m.a_key] = a.to(state[m.a_key].dtype)
        return kept_sq / total_sq if total_sq > 0 else 1.0
