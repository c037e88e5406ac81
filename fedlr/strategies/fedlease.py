"""FedLEASE: LoRA experts allocated by clustering, selected by an adaptive router.

Wang, Bian, Zhang and Xu [1]_ answer two questions of federated LoRA on
heterogeneous clients: how many LoRA experts, shared by which clients, and
which experts each client should use.

1. **Allocation** (after the warm-up rounds ``1 .. T_w``). The server
   measures the clients' distance by their LoRA ``B`` factors,

       d(i, j) = (1 / L) sum_l (1 - <B_i^l, B_j^l> / (||B_i^l|| ||B_j^l||)),

   clusters them by agglomerative (average-linkage) clustering of ``d``
   for every ``k`` in ``2 .. M_max`` and keeps the ``k`` of the largest
   silhouette score: ``M = k`` experts, expert ``e`` started as the mean of
   its cluster's ``(A_i, B_i)``.
2. **Selection** (later rounds). Client ``i`` of cluster ``c_i`` mixes the
   experts through a router ``G`` ((2M - 1, d_in) per adapted layer):

       p(x)  = softmax(G x),   T(x) = top-M entries of p(x), renormalised,
       slot s -> expert s for s < M, expert c_i for s >= M,
       h     = W0 x + s_LoRA sum_{s in T(x)} p_s(x) B_{e(s)} A_{e(s)} x,

   so the own expert is always selected (M of the 2M - 1 slots are its, and
   only M - 1 are not) and each token uses between 1 and M experts. The
   client trains its own expert and the router; the other experts are
   frozen. The server averages each expert over its cluster's replies, and
   each cluster's router over its members' (the authors' code).

fedlr's warm-up rounds are FedAvg-LoRA rounds (the paper's clients train
alone: the same thing for one warm-up round, the default) and the distance
reads each client's last update ``B_i - B`` (``B = 0`` in round 1: the
paper's ``B_i``). The head is averaged over all clients every round. A
silhouette that is not positive (no cluster structure, e.g. fewer than three
clients) gives one expert. Evaluation is personalised: each client evaluates
its own mixture on its own held-out part.

What travels: FedAvg-LoRA's arrays in warm-up rounds. Afterwards, down: the
global arrays (the warm-up adapter and the head), the per-node ArrayRecord
``fedlease-mixture`` (every expert's ``A``, ``B`` and the node's cluster's
router) and the ConfigRecord keys ``fedlease-expert`` (the node's expert)
and ``fedlease-experts`` (``M``); up: the own expert's ``A``, ``B``, the
head, and the record ``fedlease-router``.

References
----------
.. [1] Wang, Bian, Zhang, Xu, "Adaptive LoRA Experts Allocation and
   Selection for Federated Fine-Tuning" (FedLEASE), NeurIPS 2025,
   arXiv:2509.15087.
"""

from __future__ import annotations

import math
import weakref
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self, cast

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecordValues, RecordDict

from fedlr.adapters.lora import LoraModel
from fedlr.adapters.plugin import lora_layers
from fedlr.adapters.roles import AdapterLayout, Role
from fedlr.client.features import (
    Bound,
    ClientFeature,
    Expected,
    Incoming,
    Record,
    RoundJob,
    StepTogether,
)
from fedlr.client_apps.payloads import LORA
from fedlr.errors import ProtocolError
from fedlr.flower.records import config_int, record_to_state
from fedlr.linalg import stacked_residual
from fedlr.options import NoOptions, option
from fedlr.robust.spaces import RecordSpace, UpdateSpace
from fedlr.round.instructions import with_records
from fedlr.round.replies import Replies
from fedlr.strategies.base import ClientUpdate, RoundReport, weighted_means
from fedlr.strategies.lora import lora_model
from fedlr.strategies.lora_svd import PersonalLoraStrategy, PersonalReplies
from fedlr.strategies.registration import ClientContract, register_method
from fedlr.wire import protocol

__all__ = [
    "FEDLEASE_EXPERT",
    "FEDLEASE_EXPERTS",
    "FEDLEASE_MIXTURE",
    "FEDLEASE_ROUTER",
    "ExpertMixture",
    "FedLease",
    "FedLeaseOptions",
    "average_linkage",
    "b_distances",
    "choose_experts",
    "mixture_gates",
    "silhouette",
]

FEDLEASE_EXPERT = "fedlease-expert"
"""Instruction key: the node's own expert ``c_i`` (its cluster)."""
FEDLEASE_EXPERTS = "fedlease-experts"
"""Instruction key: ``M``, the number of experts."""
FEDLEASE_MIXTURE = "fedlease-mixture"
"""Instruction ArrayRecord: ``expert<e>/<A key>``, ``expert<e>/<B key>`` for
every expert and ``router/<layer>`` ((2M - 1, d_in)) of the node's cluster."""
FEDLEASE_ROUTER = "fedlease-router"
"""Reply ArrayRecord: the trained router, (2M - 1, d_in) per adapted layer."""

_HOOKS: weakref.WeakKeyDictionary[torch.nn.Module, list[Any]] = (
    weakref.WeakKeyDictionary()
)
"""The hook handles a round left on a (cached) model, removed by the next."""


# ------------------------------------------------------------------ kernels
def b_distances(bs: Sequence[Mapping[str, torch.Tensor]]) -> torch.Tensor:
    """FedLEASE's client distance ``d(i, j)``: the mean over layers of
    ``1 - cos(B_i^l, B_j^l)`` (the factors flattened).

    Parameters
    ----------
    bs : sequence of mappings of str to (d_out, r) tensors
        Each client's ``B`` per layer, the same keys for every client.

    Returns
    -------
    (n, n) float64 tensor
        Symmetric, zero diagonal; a zero ``B`` has cosine 0 with any other.
    """
    n = len(bs)
    if n == 0:
        return torch.zeros(0, 0, dtype=torch.float64)
    keys = sorted(bs[0])
    total = torch.zeros(n, n, dtype=torch.float64)
    for key in keys:
        flat = torch.stack([b[key].double().reshape(-1) for b in bs])
        norms = flat.norm(dim=1)
        unit = flat / torch.where(norms > 0, norms, 1.0)[:, None]
        total += 1.0 - unit @ unit.T
    distances = total / max(len(keys), 1)
    distances = 0.5 * (distances + distances.T)
    distances.fill_diagonal_(0.0)
    return distances.clamp_min(0.0)


def average_linkage(distances: torch.Tensor, k: int) -> list[int]:
    """Agglomerative clustering with average linkage (UPGMA) into ``k`` groups.

    Parameters
    ----------
    distances : (n, n) tensor
        Symmetric dissimilarities.
    k : int
        Groups wanted, ``1 <= k <= n``.

    Returns
    -------
    list of int
        Each point's group, numbered by first appearance (point 0 in group 0).
        Ties between pairs at the same linkage merge the pair of smallest
        indices first.
    """
    n = int(distances.shape[0])
    if not 1 <= k <= max(n, 1):
        raise ValueError(f"cannot cut {n} points into {k} groups")
    d = distances.double()
    groups: list[list[int]] = [[i] for i in range(n)]
    while len(groups) > k:
        # the smallest average linkage; ties: the first pair (a, b) in order
        _, a, b = min(
            (float(d[groups[a]][:, groups[b]].mean()), a, b)
            for a in range(len(groups))
            for b in range(a + 1, len(groups))
        )
        groups[a] = sorted(groups[a] + groups[b])
        del groups[b]
    labels = [0] * n
    for label, members in enumerate(sorted(groups, key=min)):
        for i in members:
            labels[i] = label
    return labels


def silhouette(distances: torch.Tensor, labels: Sequence[int]) -> float:
    """The mean silhouette score of a clustering, from the distances.

    ``s_i = (b_i - a_i) / max(a_i, b_i)`` with ``a_i`` the mean distance to
    the other members of its group and ``b_i`` the smallest mean distance to
    another group; ``s_i = 0`` in a group of one and where ``a_i = b_i = 0``
    (scikit-learn's convention).
    """
    d = distances.double()
    n = len(labels)
    groups = sorted(set(labels))
    if not 2 <= len(groups) <= n - 1:
        raise ValueError(f"a silhouette needs 2 to n - 1 groups, got {len(groups)}")
    members = {g: [i for i in range(n) if labels[i] == g] for g in groups}
    scores = []
    for i in range(n):
        own = [j for j in members[labels[i]] if j != i]
        if not own:
            scores.append(0.0)
            continue
        a = float(d[i, own].mean())
        b = min(float(d[i, members[g]].mean()) for g in groups if g != labels[i])
        top = max(a, b)
        scores.append((b - a) / top if top > 0 else 0.0)
    return sum(scores) / n


def choose_experts(distances: torch.Tensor, max_experts: int) -> list[int]:
    """FedLEASE's allocation: the average-linkage clustering of the ``k`` in
    ``2 .. min(max_experts, n - 1)`` with the largest silhouette (the smallest
    ``k`` on ties); one group when no ``k`` is possible or the best
    silhouette is not positive."""
    n = int(distances.shape[0])
    best: tuple[float, list[int]] | None = None
    for k in range(2, min(max_experts, n - 1) + 1):
        labels = average_linkage(distances, k)
        score = silhouette(distances, labels)
        if best is None or score > best[0]:
            best = (score, labels)
    if best is None or best[0] <= 0.0:
        return [0] * n
    return best[1]


def mixture_gates(logits: torch.Tensor, own: int, experts: int) -> torch.Tensor:
    """Each expert's gate under the adaptive top-M router.

    Parameters
    ----------
    logits : (..., 2M - 1) tensor
        ``G x``.
    own : int
        The node's expert ``c_i``.
    experts : int
        ``M``.

    Returns
    -------
    (..., M) tensor
        ``sum`` over the selected slots of each expert of the renormalised
        top-M probabilities (float32, differentiable in ``logits``); the
        own expert's gate is always positive.
    """
    slots = 2 * experts - 1
    if logits.shape[-1] != slots:
        raise ValueError(f"expected {slots} router logits, got {logits.shape[-1]}")
    p = torch.softmax(logits.float(), dim=-1)
    top, index = torch.topk(p, experts, dim=-1)
    top = top / top.sum(dim=-1, keepdim=True)
    expert_of = torch.arange(slots, device=logits.device)
    expert_of[experts:] = own
    gates = torch.zeros(*logits.shape[:-1], experts, device=logits.device)
    return gates.scatter_add(-1, expert_of[index], top)


def initial_router(
    seed: int, cluster: int, name: str, slots: int, d_in: int
) -> torch.Tensor:
    """A cluster's first router of one layer: uniform in ``(-1, 1) / sqrt(d_in)``
    (PyTorch's ``nn.Linear`` initialisation), seeded by the run, the cluster
    and the layer's name."""
    mixed = (seed * 1_000_003 + 7919 * cluster + zlib.crc32(name.encode())) % (2**62)
    g = torch.Generator().manual_seed(mixed)
    bound = 1.0 / math.sqrt(d_in)
    return (2.0 * torch.rand(slots, d_in, generator=g) - 1.0) * bound


# ------------------------------------------------------------------ client
def _mixture_expected(incoming: Incoming) -> Expected | None:
    """``fedlease-mixture`` when ``fedlease-expert`` is sent: every expert's
    ``A``, ``B`` (``expert<e>/<key>``, the layer's shapes) and each layer's
    router (``router/<layer>``, (2M - 1, d_in))."""
    layout = incoming.layout
    if FEDLEASE_EXPERT not in incoming.config or not isinstance(layout, AdapterLayout):
        return None
    count = int(cast(int, incoming.config.get(FEDLEASE_EXPERTS, 1)))
    factors = layout.shapes(Role.LORA_A, Role.LORA_B)
    shapes = {
        f"expert{e}/{key}": shape
        for e in range(count)
        for key, shape in factors.items()
    }
    for m in layout.modules:
        shapes[f"router/{m.name}"] = (2 * count - 1, m.d_in)
    return Expected(shapes)


class ExpertMixture(ClientFeature):
    """The client side: the experts, the router and the mixed forward pass.

    On for every instruction carrying ``fedlease-expert`` (a LoRA model
    only), which must come with the ArrayRecord ``fedlease-mixture``. The
    own expert is loaded into the model's LoRA ``A``, ``B`` (trained as the
    round's ``train-roles`` and sent back as ``arrays``); the other experts
    stay frozen beside it; each adapted layer's output becomes
    ``W0 x + s sum_e g_e(x) B_e A_e x`` (:func:`mixture_gates`). Training
    steps the routers with an AdamW of the round's learning rate and weight
    decay, and the reply adds ``fedlease-router``. The node keeps nothing.
    """

    keys = (
        Bound(FEDLEASE_EXPERT, "int", 0, 4095),
        Bound(FEDLEASE_EXPERTS, "int", 1, 4096),
    )
    receives = (
        Record(
            FEDLEASE_MIXTURE,
            "every expert's `A`, `B` and the router of the node's cluster",
            _mixture_expected,
        ),
    )
    sends = (
        Record(FEDLEASE_ROUTER, "the trained router, (2M - 1, d_in) per adapted layer"),
    )
    order = 55

    def __init__(self, own: int, experts: int, *, train: bool) -> None:
        self.own, self.count, self.train = own, experts, train
        self.frozen: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]] = {}
        self.routers: dict[str, torch.Tensor] = {}
        self.model: torch.nn.Module | None = None

    @classmethod
    def training_change(cls, options: Any) -> str | None:
        return "FedLEASE's router, trained on the data beside the own expert"

    @classmethod
    def for_round(cls, job: RoundJob) -> Self | None:
        if FEDLEASE_EXPERT not in job.config:
            return None
        own = config_int(job.config, FEDLEASE_EXPERT)
        count = config_int(job.config, FEDLEASE_EXPERTS, 1)
        if not 0 <= own < count:
            raise ProtocolError(
                f"'{FEDLEASE_EXPERT}'={own} is not one of the {count} experts"
            )
        lora_model(job, f"'{FEDLEASE_EXPERT}' mixes LoRA experts")
        return cls(own, count, train=job.is_train)

    def load(
        self,
        job: RoundJob,
        received: dict[str, torch.Tensor],
        state: dict[str, torch.Tensor],
    ) -> None:
        view = cast(LoraModel, job.adapted)
        mixture = record_to_state(job.message.content.array_records[FEDLEASE_MIXTURE])
        slots = 2 * self.count - 1
        for m in view.layout.modules:
            experts: list[tuple[torch.Tensor, torch.Tensor] | None] = []
            for e in range(self.count):
                a = mixture.get(f"expert{e}/{m.a_key}")
                b = mixture.get(f"expert{e}/{m.b_key}")
                if a is None or b is None:
                    raise ProtocolError(
                        f"'{FEDLEASE_MIXTURE}' has no expert {e} of {m.name}"
                    )
                if tuple(a.shape) != (m.rank, m.d_in) or tuple(b.shape) != (
                    m.d_out,
                    m.rank,
                ):
                    raise ProtocolError(
                        f"'{FEDLEASE_MIXTURE}': expert {e} of {m.name} has shapes "
                        f"{tuple(a.shape)}, {tuple(b.shape)}; the layer's are "
                        f"{(m.rank, m.d_in)}, {(m.d_out, m.rank)}"
                    )
                if e == self.own:
                    state[m.a_key] = a.to(state[m.a_key].dtype)
                    state[m.b_key] = b.to(state[m.b_key].dtype)
                    experts.append(None)  # the model's own LoRA factors
                else:
                    experts.append((a.float(), b.float()))
            router = mixture.get(f"router/{m.name}")
            if router is None or tuple(router.shape) != (slots, m.d_in):
                got = None if router is None else tuple(router.shape)
                raise ProtocolError(
                    f"'{FEDLEASE_MIXTURE}': the router of {m.name} is {got}, "
                    f"expected {(slots, m.d_in)}"
                )
            self.frozen[m.name] = experts
            self.routers[m.name] = router.float().clone().requires_grad_(self.train)
        job.personal_loaded = True
        self._install(view)

    def _install(self, view: LoraModel) -> None:
        model = view.model
        for handle in _HOOKS.pop(model, []):
            handle.remove()
        layers = lora_layers(model)
        adapter = model.active_adapter
        handles = [
            cast(torch.nn.Module, layers[m.name]).register_forward_hook(
                self._layer_hook(layers[m.name], adapter, m.name)
            )
            for m in view.layout.modules
        ]
        _HOOKS[model] = handles
        self.model = model

    def _layer_hook(
        self, layer: Any, adapter: str, name: str
    ) -> Callable[..., torch.Tensor]:
        def hook(
            module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor
        ) -> torch.Tensor:
            x = args[0]
            scale = float(layer.scaling[adapter])
            dropped = layer.lora_dropout[adapter](x)
            router = self.routers[name].to(x.device)
            gates = mixture_gates(x.to(router.dtype) @ router.T, self.own, self.count)
            out = layer.base_layer(x)
            for e, factors in enumerate(self.frozen[name]):
                gate = gates[..., e : e + 1].to(x.dtype)
                if factors is None:
                    expert = layer.lora_B[adapter](layer.lora_A[adapter](dropped))
                else:
                    a, b = (f.to(x.device, x.dtype) for f in factors)
                    expert = (dropped @ a.T) @ b.T
                out = out + scale * gate * expert
            return out

        return hook

    def wrap_optimizer(
        self, job: RoundJob, optimizer: torch.optim.Optimizer
    ) -> torch.optim.Optimizer:
        if not self.train:
            return optimizer
        return StepTogether.beside(optimizer, self.routers.values())

    def reply_records(
        self,
        job: RoundJob,
        trained: dict[str, torch.Tensor],
        metrics: dict[str, MetricRecordValues],
        content: RecordDict,
    ) -> None:
        if self.train:
            content[FEDLEASE_ROUTER] = ArrayRecord(
                {
                    name: r.detach().cpu().float().contiguous()
                    for name, r in self.routers.items()
                }
            )
        if self.model is not None:
            for handle in _HOOKS.pop(self.model, []):
                handle.remove()


# ------------------------------------------------------------------ server
class FedLeaseReplies(PersonalReplies):
    """FedLEASE's reply step: ``fedlease-router`` after the allocation."""

    method: FedLease

    def records(self) -> dict[str, dict[str, tuple[int, ...]]]:
        method = self.method
        if not method.mixture_sent:
            return {}
        slots = 2 * method.experts_count - 1
        return {
            FEDLEASE_ROUTER: {m.name: (slots, m.d_in) for m in method.layout.modules}
        }

    def clip_extras(self, update: ClientUpdate) -> ClientUpdate:
        """The router is no linear function of the update: it stays as sent."""
        return update

    def space(self, current: Mapping[str, torch.Tensor]) -> UpdateSpace:
        """The arrays' space, and (after the allocation) ``fedlease-router`` as
        a record of its own, its change against the router the node's cluster
        was sent: a robust rule bounds it there."""
        space = super().space(current)
        method = self.method
        if method.mixture_sent:
            space.records = (
                RecordSpace(
                    FEDLEASE_ROUTER,
                    lambda u: method.routers[method.expert_of(u.node_id)],
                ),
            )
        return space


@dataclass(frozen=True)
class FedLeaseOptions(NoOptions):
    """FedLEASE's run-config keys."""

    fedlease_warmup_rounds: int = option(
        1,
        "FedLEASE's warm-up rounds (FedAvg-LoRA) before the experts are "
        "allocated ([methods/fedlease.md](methods/fedlease.md))",
        range=">= 1",
    )
    fedlease_max_experts: int = option(
        4,
        "FedLEASE's M_max: most experts (clusters) the silhouette may choose",
        range="[1, 4096]",
    )


@register_method(
    "fedlease",
    payload=LORA,
    options=FedLeaseOptions,
    summary="LoRA experts per cluster of clients (B similarity, silhouette); "
    "each client mixes them by an adaptive top-M router (personalised)",
    client=(ExpertMixture,),
    sum_only=False,
    client_contract=ClientContract(
        carries="`A`, `B`, head; `keep-roles` empty, `personal-split`; after the "
        "allocation (round `fedlease-warmup-rounds`) the ArrayRecord "
        "`fedlease-mixture` and `fedlease-expert`, `fedlease-experts`",
        helpers="nothing before the allocation (FedAvg-LoRA); then `apply_round` "
        "loads your own expert into the LoRA layers and mixes every expert "
        "through your cluster's router in the forward pass (training and "
        "evaluation); step with `job.optimizer(...)` (it steps the router "
        "too); `job.reply()` sends your expert's `A`, `B`, the head and "
        "`fedlease-router`",
    ),
)
class FedLease(PersonalLoraStrategy):
    """FedAvg-LoRA warm-up, then clustered experts mixed by routers.

    Federated, personalised evaluation as :class:`PersonalLoraStrategy`.

    Parameters
    ----------
    options : FedLeaseOptions, optional
        ``fedlease_warmup_rounds``, ``fedlease_max_experts`` (or by name).
    **kwargs
        Other parameters: see :class:`PersonalLoraStrategy`.
    """

    method_options: FedLeaseOptions
    replies_type: ClassVar[type[Replies]] = FedLeaseReplies

    send_roles: ClassVar[tuple[Role, ...]] = (Role.LORA_A, Role.LORA_B, Role.HEAD)
    train_roles: ClassVar[tuple[Role, ...]] = (Role.LORA_A, Role.LORA_B, Role.HEAD)
    keep_roles: ClassVar[tuple[Role, ...]] = ()
    extra_columns: tuple[str, ...] = (*PersonalLoraStrategy.extra_columns, "experts")

    def __init__(self, *, layout: AdapterLayout, **kwargs: Any) -> None:
        super().__init__(layout=layout, **kwargs)
        self.mixture_sent = False
        """Whether the last train instructions carried the experts."""
        self.assignment: dict[int, int] = {}
        """Each allocated node's expert (its cluster)."""
        self.experts: list[dict[str, torch.Tensor]] = []
        """Each expert's ``A``, ``B`` by layout key."""
        self.routers: list[dict[str, torch.Tensor]] = []
        """Each cluster's router, (2M - 1, d_in) by layer name."""

    @property
    def experts_count(self) -> int:
        """``M`` (0 before the allocation)."""
        return len(self.experts)

    def expert_of(self, node: int) -> int:
        """The node's expert; a node not allocated joins the largest cluster
        (the lowest index on ties)."""
        if node in self.assignment:
            return self.assignment[node]
        counts = [0] * self.experts_count
        for e in self.assignment.values():
            counts[e] += 1
        return min(range(len(counts)), key=lambda e: (-counts[e], e))

    def instructions(
        self,
        server_round: int,
        messages: list[Message],
        arrays: ArrayRecord,
        *,
        train: bool,
    ) -> list[Message]:
        """After the allocation, each node's ``fedlease-mixture`` and its
        ``fedlease-expert`` / ``fedlease-experts`` keys."""
        messages = super().instructions(server_round, messages, arrays, train=train)
        if train:
            self.mixture_sent = bool(self.experts)
        if not self.experts:
            return messages
        shared: dict[str, torch.Tensor] = {}
        for e, expert in enumerate(self.experts):
            for key, value in expert.items():
                shared[f"expert{e}/{key}"] = value
        out = []
        for message in messages:
            own = self.expert_of(int(message.metadata.dst_node_id))
            tensors = dict(shared)
            for name, router in self.routers[own].items():
                tensors[f"router/{name}"] = router
            records = message.content.config_records
            config = (
                dict(records[protocol.CONFIG]) if protocol.CONFIG in records else {}
            )
            config[FEDLEASE_EXPERT] = own
            config[FEDLEASE_EXPERTS] = self.experts_count
            out.append(
                with_records(
                    message,
                    {
                        FEDLEASE_MIXTURE: ArrayRecord(tensors),
                        protocol.CONFIG: ConfigRecord(config),
                    },
                )
            )
        return out

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "mixture-sent": self.mixture_sent,
            "assignment": dict(self.assignment),
            "experts": [{k: v.clone() for k, v in e.items()} for e in self.experts],
            "routers": [{k: v.clone() for k, v in r.items()} for r in self.routers],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        known = {"mixture-sent", "assignment", "experts", "routers"}
        unknown = sorted(set(state) - known)
        if unknown:
            raise ValueError(f"FedLease: unknown state keys {unknown}")
        experts = [dict(e) for e in state.get("experts", [])]
        routers = [dict(r) for r in state.get("routers", [])]
        if len(experts) != len(routers):
            raise ValueError(
                f"FedLease: {len(experts)} experts but {len(routers)} routers"
            )
        assignment = {int(n): int(e) for n, e in state.get("assignment", {}).items()}
        if any(not 0 <= e < len(experts) for e in assignment.values()):
            raise ValueError("FedLease: a node is assigned to an expert that is not")
        self.mixture_sent = bool(state.get("mixture-sent", False))
        self.assignment, self.experts, self.routers = assignment, experts, routers

    # ----------------------------------------------------------- aggregation
    def _allocate(
        self, updates: Sequence[ClientUpdate], current: Mapping[str, torch.Tensor]
    ) -> None:
        """Cluster the round's clients by their ``B`` updates; start the experts
        as the clusters' means and the routers seeded."""
        b_keys = self.layout.keys(Role.LORA_B)
        changes = [
            {k: u.arrays[k].double() - current[k].double() for k in b_keys}
            for u in updates
        ]
        labels = choose_experts(
            b_distances(changes), self.method_options.fedlease_max_experts
        )
        count = max(labels) + 1
        keys = self.layout.keys(Role.LORA_A, Role.LORA_B)
        slots = 2 * count - 1
        self.assignment = {u.node_id: e for u, e in zip(updates, labels, strict=True)}
        self.experts = [
            weighted_means(
                [u for u, e in zip(updates, labels, strict=True) if e == c],
                keys,
                current,
            )
            for c in range(count)
        ]
        self.routers = [
            {
                m.name: initial_router(self.seed, c, m.name, slots, m.d_in)
                for m in self.layout.modules
            }
            for c in range(count)
        ]

    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        state = dict(current)
        heads = self.layout.keys(Role.HEAD)
        if not self.mixture_sent:  # a warm-up round: FedAvg-LoRA
            state.update(weighted_means(updates, self.layout.keys(*self.train_roles)))
            report = self.gap_report(updates)
            if server_round >= self.method_options.fedlease_warmup_rounds:
                self._allocate(updates, current)
        else:
            state.update(weighted_means(updates, heads, current))
            report = self._mix(updates)
        report.metrics["experts"] = float(self.experts_count)
        return state, self.with_personal_count(updates, report)

    def _mix(self, updates: Sequence[ClientUpdate]) -> RoundReport:
        """Each expert <- its cluster's mean, each router <- its members'
        mean; the gap of the experts taken together."""
        keys = self.layout.keys(Role.LORA_A, Role.LORA_B)
        experts = [dict(e) for e in self.experts]
        routers = [dict(r) for r in self.routers]
        layers: dict[str, list[float]] = {
            m.name: [0.0, 0.0] for m in self.layout.modules
        }
        for c in range(self.experts_count):
            members = [u for u in updates if self.expert_of(u.node_id) == c]
            if not members:
                continue
            experts[c] = weighted_means(members, keys, self.experts[c])
            weights = [u.weight for u in members]
            for name, old in self.routers[c].items():
                stacked = torch.stack(
                    [u.extras[FEDLEASE_ROUTER][name].double() for u in members]
                )
                w = torch.tensor(weights, dtype=torch.float64)
                routers[c][name] = torch.tensordot(w / w.sum(), stacked, dims=1).to(
                    old.dtype
                )
            for m in self.layout.modules:
                residual = stacked_residual(
                    [u.arrays[m.b_key] for u in members],
                    [u.arrays[m.a_key] for u in members],
                    weights,
                )
                gap, norm = residual.gap_norms().pair
                layers[m.name][0] += gap * gap
                layers[m.name][1] += norm * norm
        self.experts, self.routers = experts, routers
        return RoundReport.from_layers(
            {n: (math.sqrt(g), math.sqrt(r)) for n, (g, r) in layers.items()},
            rank=float(self.rank),
        )
