"""RAVAN: a LoRA update as a sum of heads with frozen bases and trained cores.

Raje et al. [1]_ write each adapted layer's update as a sum of ``N`` heads,

    Delta W = s_LoRA * sum_h s_h B_h H_h A_h,

with frozen random bases ``B_h`` (d_out, r) and ``A_h`` (r, d_in), trained
cores ``H_h`` (r, r) and trained scalars ``s_h`` (one per head), and
``s_LoRA = lora-alpha / lora-rank`` fedlr's usual scaling. A client uploads
its products ``C_i,h = s_i,h H_i,h``; because every client shares the
bases, the server's mean of the cores is the mean of the clients' updates
exactly:

    sum_i w_i sum_h B_h C_i,h A_h = sum_h B_h (sum_i w_i C_i,h) A_h,

and it publishes ``H_h <- sum_i w_i C_i,h`` with ``s_h <- 1`` (``w_i`` the
``num-examples`` shares). The bases span ``N r`` directions, so the update's
rank can reach ``N r`` while each client uploads ``N r^2`` numbers per layer.

fedlr holds the heads inside an ordinary LoRA adapter of rank ``N r``
(``lora-rank``, ``ravan-heads`` = ``N``):

* ``A`` = ``[A_1; ...; A_N]``, the seeded initial ``A`` every node builds
  (as in FFA-LoRA): frozen and never sent;
* ``B`` = ``[B_1 C_1, ..., B_N C_N]`` with ``[B_1, ..., B_N]`` a
  (d_out, N r) matrix with orthonormal columns drawn from the run's seed
  and the layer's name (:func:`head_bases`), the same on the server and on
  every node.

The server publishes ``B`` (so the global adapter is a plain LoRA adapter that
the server evaluates and a user exports); a node reads its cores back as
``C_h = B_h^T B[:, h]`` (:func:`cores_of`), trains ``H_h`` and ``s_h`` (the
chain rule of :class:`RavanHeads`: ``B`` is rebuilt from them after every
step, so the forward pass is the paper's) and replies with the head and the
record ``ravan-cores`` (``s_h H_h`` per layer, (N, r, r)). Down: ``B`` and the
head; up: the head and ``N r^2`` numbers per layer.

References
----------
.. [1] Raje, Askin, Jhunjhunwala, Joshi, "Ravan: Multi-Head Low-Rank
   Adaptation for Federated Fine-Tuning", NeurIPS 2025.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self, cast

import torch
from flwr.app import ArrayRecord, MetricRecordValues, RecordDict

from fedlr.adapters.lora import LoraModel
from fedlr.adapters.plugin import lora_layers
from fedlr.adapters.roles import AdapterLayout, Role
from fedlr.client.features import Bound, ClientFeature, Record, RoundJob
from fedlr.client_apps.payloads import LORA
from fedlr.errors import ConfigError, ProtocolError
from fedlr.flower.records import config_int
from fedlr.linalg import normalise_weights
from fedlr.options import NoOptions, option
from fedlr.robust.spaces import UpdateSpace
from fedlr.strategies.base import ClientUpdate, RoundReport, weighted_means
from fedlr.strategies.lora import lora_model
from fedlr.strategies.lora_svd import SeededLoraStrategy, SeededReplies
from fedlr.strategies.registration import ClientContract, register_method

__all__ = [
    "RAVAN_CORES",
    "RAVAN_HEADS",
    "RAVAN_SEED",
    "Ravan",
    "RavanHeads",
    "RavanOptions",
    "b_of",
    "cores_of",
    "head_bases",
]

RAVAN_HEADS = "ravan-heads"
"""Instruction key: ``N``, the heads each adapted layer's rank splits into."""
RAVAN_SEED = "ravan-seed"
"""Instruction key: the seed of the frozen output bases ``B_h``."""
RAVAN_CORES = "ravan-cores"
"""Reply record: per adapted layer (by module name), ``s_h H_h`` as (N, r, r)."""

_SPAN_TOLERANCE = 1e-4
"""Largest relative distance of a received ``B`` from the heads' span."""


# ------------------------------------------------------------------ kernels
def head_bases(seed: int, name: str, d_out: int, rank: int) -> torch.Tensor:
    """The frozen output bases ``[B_1, ..., B_N]`` of one adapted layer.

    Parameters
    ----------
    seed : int
        The run's seed.
    name : str
        The layer's module path (each layer draws its own bases).
    d_out : int
    rank : int
        ``N r``, the layer's LoRA rank.

    Returns
    -------
    (d_out, rank) float64 tensor
        Orthonormal columns: the Q factor of a seeded Gaussian matrix, each
        column's sign fixed by a positive diagonal of R (LAPACK's sign
        choice aside, the same on every machine). Heads ``h`` take columns
        ``h r .. (h + 1) r - 1``, so the heads' column spaces are orthogonal.

    Raises
    ------
    ValueError
        If ``rank > d_out`` (no ``rank`` orthonormal columns exist).
    """
    if rank > d_out:
        raise ValueError(
            f"layer '{name}': {rank} orthonormal columns do not fit in d_out={d_out}"
        )
    mixed = (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**62)
    g = torch.Generator().manual_seed(mixed)
    gauss = torch.randn(d_out, rank, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(gauss)
    signs = torch.where(torch.diagonal(r) < 0, -1.0, 1.0).to(torch.float64)
    return q * signs


def cores_of(b: torch.Tensor, bases: torch.Tensor, heads: int) -> torch.Tensor:
    """``C_h = B_h^T B[:, h]``: the cores of a ``B`` in the heads' span.

    Parameters
    ----------
    b : (d_out, N r) tensor
        ``[B_1 C_1, ..., B_N C_N]``.
    bases : (d_out, N r) tensor
        :func:`head_bases` (orthonormal columns).
    heads : int
        ``N``.

    Returns
    -------
    (N, r, r) float64 tensor
    """
    d_out, rank = bases.shape
    r = rank // heads
    blocks_b = b.double().reshape(d_out, heads, r).permute(1, 0, 2)
    blocks_q = bases.double().reshape(d_out, heads, r).permute(1, 0, 2)
    return blocks_q.transpose(1, 2) @ blocks_b


def b_of(cores: torch.Tensor, bases: torch.Tensor) -> torch.Tensor:
    """``[B_1 C_1, ..., B_N C_N]`` from the cores (the inverse of :func:`cores_of`).

    Parameters
    ----------
    cores : (N, r, r) tensor
    bases : (d_out, N r) tensor

    Returns
    -------
    (d_out, N r) tensor, in the dtype of ``cores`` (differentiable in it).
    """
    heads, r, _ = cores.shape
    d_out = bases.shape[0]
    blocks_q = bases.to(cores.dtype).reshape(d_out, heads, r).permute(1, 0, 2)
    return (blocks_q @ cores).permute(1, 0, 2).reshape(d_out, heads * r)


def _heads_of(rank: int, heads: int, name: str) -> int:
    """``r = rank / N``, or :class:`ValueError` naming the layer."""
    if heads < 1 or rank % heads:
        raise ValueError(
            f"layer '{name}': LoRA rank {rank} does not split into {heads} heads"
        )
    return rank // heads


# ------------------------------------------------------------------ client
class _CoreOptimizer(torch.optim.Optimizer):
    """Steps the round's optimizer, then the cores, then rebuilds ``B``.

    ``B``'s gradient ``G`` (from the model's ordinary backward pass, clipped
    with the others' by ``max-grad-norm``) gives the cores' by the chain rule
    through ``B = [B_h s_h H_h]``: ``dL/dH_h = s_h B_h^T G_h`` and
    ``dL/ds_h = <B_h H_h, G_h>``. The round's optimizer's own step of ``B``
    is overwritten by the rebuild.
    """

    def __init__(self, main: torch.optim.Optimizer, heads: RavanHeads):
        self.main, self.heads = main, heads
        self.param_groups = main.param_groups
        self.defaults = main.defaults
        self.state = main.state
        self.cores: torch.optim.Optimizer | None = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.main.zero_grad(set_to_none=set_to_none)
        if self.cores is not None:
            self.cores.zero_grad(set_to_none=set_to_none)
        for param in self.heads.b_params.values():
            param.grad = None

    def _core_optimizer(self) -> torch.optim.Optimizer:
        """The cores' optimizer, on ``B``'s device (after the model moved)."""
        heads = self.heads
        for name, param in heads.b_params.items():
            heads.h[name] = heads.h[name].detach().to(param.device, param.dtype)
            heads.h[name].requires_grad_(True)
            heads.s[name] = heads.s[name].detach().to(param.device, param.dtype)
            heads.s[name].requires_grad_(True)
            heads.bases[name] = heads.bases[name].to(param.device, param.dtype)
        trained = [*heads.h.values(), *heads.s.values()]
        group = self.main.param_groups[0]
        lr, decay = float(group["lr"]), float(group.get("weight_decay", 0.0))
        if isinstance(self.main, torch.optim.SGD):
            return torch.optim.SGD(trained, lr=lr, weight_decay=decay)
        return torch.optim.AdamW(trained, lr=lr, weight_decay=decay)

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        self.main.step()
        if self.cores is None:
            self.cores = self._core_optimizer()
        heads = self.heads
        for name, param in heads.b_params.items():
            if param.grad is None:
                continue
            scaled = heads.s[name][:, None, None] * heads.h[name]
            b_of(scaled, heads.bases[name]).backward(param.grad.detach())
        self.cores.step()
        heads.publish()


class RavanHeads(ClientFeature):
    """The client side: train the heads' cores ``H_h`` and scalars ``s_h``.

    On for every training instruction carrying ``ravan-heads`` (a LoRA model
    only). At the instruction it reads the cores from the received ``B``
    (refusing a ``B`` off the heads' span: a server not running RAVAN) and
    starts from ``H_h = C_h``, ``s_h = 1``. The round's ``B`` parameters take
    gradients (:meth:`train_also`; ``train-roles`` is the head, so ``B`` is
    never sent) and after every step ``B`` is rebuilt from the cores, whatever
    the round's optimizer did to it. The reply adds ``ravan-cores``; the node
    keeps nothing.
    """

    keys = (Bound(RAVAN_HEADS, "int", 1, 4096), Bound(RAVAN_SEED, "int", 0, 2**62))
    sends = (
        Record(RAVAN_CORES, "`s_h H_h` of every head, (N, r, r) per adapted layer"),
    )
    order = 60

    def __init__(self, heads: int, seed: int) -> None:
        self.heads, self.seed = heads, seed
        self.bases: dict[str, torch.Tensor] = {}
        self.h: dict[str, torch.Tensor] = {}
        self.s: dict[str, torch.Tensor] = {}
        self.b_params: dict[str, torch.nn.Parameter] = {}

    @classmethod
    def training_change(cls, options: Any) -> str | None:
        return "RAVAN's cores, trained by the chain rule through the LoRA B"

    @classmethod
    def for_round(cls, job: RoundJob) -> Self | None:
        if RAVAN_HEADS not in job.config or not job.is_train:
            return None
        heads = config_int(job.config, RAVAN_HEADS)
        seed = config_int(job.config, RAVAN_SEED, 0)
        view = lora_model(job, f"'{RAVAN_HEADS}' splits LoRA adapters into heads")
        for m in view.layout.modules:
            try:
                _heads_of(m.rank, heads, m.name)
                if m.rank > m.d_out:
                    raise ValueError(f"layer '{m.name}': rank {m.rank} > {m.d_out}")
            except ValueError as error:
                raise ProtocolError(f"'{RAVAN_HEADS}'={heads}: {error}") from None
        return cls(heads, seed)

    def load(
        self,
        job: RoundJob,
        received: dict[str, torch.Tensor],
        state: dict[str, torch.Tensor],
    ) -> None:
        view = cast(LoraModel, job.adapted)
        for m in view.layout.modules:
            bases = head_bases(self.seed, m.name, m.d_out, m.rank)
            b = state[m.b_key].detach().double()
            cores = cores_of(b, bases, self.heads)
            rebuilt = b_of(cores, bases)
            off = float(torch.linalg.matrix_norm(b - rebuilt))
            if off > _SPAN_TOLERANCE * max(float(torch.linalg.matrix_norm(b)), 1.0):
                raise ProtocolError(
                    f"layer '{m.name}': the received lora_B is {off:.3g} away from "
                    f"the span of its {self.heads} RAVAN heads (seed {self.seed}); "
                    "the server does not publish RAVAN's B"
                )
            state[m.b_key] = rebuilt.to(state[m.b_key].dtype)
            self.bases[m.name] = bases.float()
            self.h[m.name] = cores.float()
            self.s[m.name] = torch.ones(self.heads)

    def train_also(self, job: RoundJob) -> list[torch.nn.Parameter]:
        """Every layer's LoRA ``B``: it takes the gradients the cores' come from."""
        view = cast(LoraModel, job.adapted)
        layers = lora_layers(view.model)
        adapter = view.model.active_adapter
        for m in view.layout.modules:
            weight = layers[m.name].lora_B[adapter].weight
            self.b_params[m.name] = cast(torch.nn.Parameter, weight)
        return list(self.b_params.values())

    def wrap_optimizer(
        self, job: RoundJob, optimizer: torch.optim.Optimizer
    ) -> torch.optim.Optimizer:
        return _CoreOptimizer(optimizer, self)

    @torch.no_grad()
    def publish(self) -> None:
        """``B <- [B_h s_h H_h]`` in every layer (after each step)."""
        for name, param in self.b_params.items():
            scaled = self.s[name][:, None, None] * self.h[name]
            param.copy_(b_of(scaled.to(param.dtype), self.bases[name]))

    def reply_records(
        self,
        job: RoundJob,
        trained: dict[str, torch.Tensor],
        metrics: dict[str, MetricRecordValues],
        content: RecordDict,
    ) -> None:
        cores = {
            name: (self.s[name][:, None, None] * self.h[name])
            .detach()
            .cpu()
            .float()
            .contiguous()
            for name in self.h
        }
        content[RAVAN_CORES] = ArrayRecord(cores)
        for param in self.b_params.values():
            param.grad = None


# ------------------------------------------------------------------ server
class CoreSpace(UpdateSpace):
    """RAVAN's updates: the change of every layer's cores and of the head.

    ``u_i = (C_i - C, head_i - head)`` with ``C`` the cores of the round's
    global ``B``; a shrink moves both towards the reference.
    """

    def __init__(
        self, reference: Mapping[str, torch.Tensor], cores: Mapping[str, torch.Tensor]
    ) -> None:
        self.reference = reference
        self.cores = cores

    def vector(self, update: ClientUpdate) -> torch.Tensor:
        parts = []
        for name in sorted(self.cores):
            got = update.extras[RAVAN_CORES][name].double()
            parts.append((got - self.cores[name]).reshape(-1))
        for key in sorted(update.arrays):
            x = update.arrays[key].double()
            ref = self.reference.get(key)
            delta = x - ref.double() if ref is not None and ref.shape == x.shape else x
            parts.append(delta.reshape(-1))
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)

    def gram(self, updates: Sequence[ClientUpdate]) -> torch.Tensor:
        vectors = torch.stack([self.vector(u) for u in updates])
        return vectors @ vectors.T

    def norm(self, update: ClientUpdate) -> float:
        return float(torch.linalg.vector_norm(self.vector(update)))

    def shrink(self, update: ClientUpdate, factor: float) -> ClientUpdate:
        def towards(x: torch.Tensor, ref: torch.Tensor | None) -> torch.Tensor:
            if ref is None or ref.shape != x.shape:
                return (factor * x.double()).to(x.dtype)
            base = ref.double()
            return (base + factor * (x.double() - base)).to(x.dtype)

        arrays = {
            k: towards(v, self.reference.get(k)) for k, v in update.arrays.items()
        }
        record = update.extras[RAVAN_CORES]
        moved = {k: towards(v, self.cores.get(k)) for k, v in record.items()}
        extras = {**update.extras, RAVAN_CORES: moved}
        return dataclasses.replace(update, arrays=arrays, extras=extras)


class RavanReplies(SeededReplies):
    """RAVAN's reply step: every reply carries ``ravan-cores``."""

    method: Ravan

    def records(self) -> dict[str, dict[str, tuple[int, ...]]]:
        """``ravan-cores``: (N, r, r) per adapted layer, by module name."""
        n = self.method.heads
        return {
            RAVAN_CORES: {
                m.name: (n, m.rank // n, m.rank // n)
                for m in self.method.layout.modules
            }
        }

    def space(self, current: Mapping[str, torch.Tensor]) -> UpdateSpace:
        """:class:`CoreSpace`: the cores' and the head's changes."""
        return CoreSpace(current, self.method.global_cores(current))

    def clip_extras(self, update: ClientUpdate) -> ClientUpdate:
        """The cores were moved with the head by :meth:`CoreSpace.shrink`."""
        return update


@dataclass(frozen=True)
class RavanOptions(NoOptions):
    """RAVAN's run-config key."""

    ravan_heads: int = option(
        4,
        "RAVAN's number of heads N; each adapted layer's `lora-rank` splits "
        "into N heads of rank lora-rank / N ([methods/ravan.md](methods/ravan.md))",
        range="[1, 64]",
    )


@register_method(
    "ravan",
    payload=LORA,
    options=RavanOptions,
    summary="multi-head LoRA: frozen seeded bases, trained r x r cores and "
    "scalars per head; the server averages s_h H_h",
    client=(RavanHeads,),
    sum_only=True,
    client_contract=ClientContract(
        carries="`B`, head (`A` never travels); `train-roles` `head`, `ravan-heads`, "
        "`ravan-seed`",
        helpers="build the model from a fixed seed (`A` is the seeded one, frozen); "
        "step with `job.optimizer(...)`: `apply_round` makes `B` trainable "
        "too and every step trains the heads' cores `H_h` and scalars `s_h` "
        "through `B`'s gradient and rebuilds `B`; `job.reply()` sends the "
        "head and `ravan-cores` (`s_h H_h` per layer)",
    ),
)
class Ravan(SeededLoraStrategy):
    """Average the heads' cores ``s_h H_h`` and the head; ``A`` frozen, unsent.

    Parameters
    ----------
    layout : AdapterLayout
        Every layer's rank must split into ``ravan_heads`` heads and fit in
        its ``d_out``.
    options : RavanOptions, optional
        ``ravan_heads`` (or by name).
    **kwargs
        Other parameters: see :class:`SeededLoraStrategy`.

    Raises
    ------
    ConfigError
        ``ravan-heads`` for a rank that does not split into the heads.
    """

    method_options: RavanOptions
    replies_type: ClassVar[type[SeededReplies]] = RavanReplies

    send_roles: ClassVar[tuple[Role, ...]] = (Role.LORA_B, Role.HEAD)
    train_roles: ClassVar[tuple[Role, ...]] = (Role.HEAD,)

    def __init__(self, *, layout: AdapterLayout, **kwargs: Any) -> None:
        super().__init__(layout=layout, **kwargs)
        self.heads = self.method_options.ravan_heads
        self.bases: dict[str, torch.Tensor] = {}
        """Each layer's frozen ``[B_1, ..., B_N]`` (derived from the seed)."""
        for m in layout.modules:
            try:
                _heads_of(m.rank, self.heads, m.name)
                self.bases[m.name] = head_bases(self.seed, m.name, m.d_out, m.rank)
            except ValueError as error:
                raise ConfigError(RAVAN_HEADS, str(error)) from None

    def round_config(self, server_round: int) -> dict[str, Any]:
        """``ravan-heads`` and ``ravan-seed`` beside the LoRA keys."""
        config = super().round_config(server_round)
        config[RAVAN_HEADS] = self.heads
        config[RAVAN_SEED] = self.seed
        return config

    def global_cores(
        self, state: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The cores ``C_h`` of ``state``'s ``B`` per layer, (N, r, r) float64."""
        return {
            m.name: cores_of(state[m.b_key], self.bases[m.name], self.heads)
            for m in self.layout.modules
        }

    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        weights = normalise_weights([u.weight for u in updates], len(updates))
        state = dict(current)
        state.update(weighted_means(updates, self.layout.keys(Role.HEAD), current))
        client_b: dict[str, list[torch.Tensor]] = {}
        for m in self.layout.modules:
            stacked = torch.stack(
                [u.extras[RAVAN_CORES][m.name].double() for u in updates]
            )
            mean = torch.tensordot(weights, stacked, dims=1)
            state[m.b_key] = b_of(mean, self.bases[m.name]).to(current[m.b_key].dtype)
            client_b[m.name] = [b_of(c, self.bases[m.name]) for c in stacked]
        modules = self.layout.modules
        if not all(m.a_key in self.initial_state for m in modules):
            nan = float("nan")
            return state, RoundReport(
                metrics={"frobenius-gap": nan, "relative-gap": nan, "rank": self.rank}
            )
        k = len(updates)
        factors = {
            m.name: (client_b[m.name], [self.initial_state[m.a_key].double()] * k)
            for m in modules
        }
        aggregate = {
            m.name: (state[m.b_key], self.initial_state[m.a_key]) for m in modules
        }
        return state, self.factored_gap_report(updates, factors, aggregate)
