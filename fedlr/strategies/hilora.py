"""HiLoRA: root, cluster and leaf LoRA adapters for personalised FL.

Peng et al. [1]_ give every client three tiers of LoRA adapters on one frozen
model, trained one after the other (cascaded), each on what the tiers below
leave:

1. **root** (rounds ``1 .. T_r``): one adapter for everyone. Clients train
   ``(A, B)``; the server publishes the best rank-``r`` factors of the mean
   product, ``B = U_r``, ``A = S_r V_r^T`` from the SVD of
   ``sum_i w_i B_i A_i`` (product-space aggregation). The server keeps, per
   node, an exponential moving average of each layer's normalised ``B_i``
   (``lambda`` = ``hilora-ema``).
2. **clustering** (after round ``T_r``): per node and layer the top-``r``
   left singular vectors ``U_i`` of its averaged ``B``; distances
   ``d_ij = mean_layers (1 - ||U_i^T U_j||_F^2 / r)``; affinities
   ``S_ij = exp(-d_ij^2 / (2 sigma^2))`` (``sigma`` the median positive
   distance); ``K`` in ``[k_min, min(k_max, n - 1)]`` at the largest gap
   ``mu_{K+1} - mu_K`` of the normalised Laplacian's ascending eigenvalues
   ``mu_1 <= mu_2 <= ...`` (the eigengap heuristic: ``K`` small
   eigenvalues, then a jump; :func:`choose_cluster_count`); spectral
   clustering of ``S`` into ``K`` groups (LoRA-Subspace Adaptive Clustering).
3. **cluster** (rounds ``T_r + 1 .. T_r + T_c``): the root folded into every
   node's frozen weights, ``W0 + s B_r A_r``; each node trains its cluster's
   adapter ``(A_c, B_c)`` (first ``B_c = 0``, ``A_c = A_r``) with the loss
   plus ``gamma_r sum_layers ||B_r^T B_c||_F^2``; the server publishes each
   cluster's product-space aggregate of its members' replies.
4. **leaf** (later rounds): root and cluster folded in; each node trains its
   own adapter ``(A_l, B_l)`` (first ``B_l = 0``, ``A_l = A_c``), kept on
   the node, with ``gamma_r ||B_r^T B_l||^2 + gamma_c ||B_c^T B_l||^2``.

The head (a classifier's ``modules_to_save``) is shared: averaged by
examples every round. Evaluation is personalised: each node evaluates
``W0 + s B_r A_r + s B_c A_c + s B_l A_l`` (the tiers it has) on its own
held-out part. The global arrays stay the root adapter and the head (what a
new node uses).

What travels: the root ``A``, ``B`` and the head every round; from the
cluster stage a per-node ArrayRecord ``hilora-tiers`` (the cluster stage:
the adapter to train; the leaf stage: the node's cluster's factors); the
ConfigRecord keys ``hilora-stage``, ``hilora-gamma-root``,
``hilora-gamma-cluster``. Up: ``A``, ``B`` and the head (root and cluster
stages), the head only in the leaf stage.

References
----------
.. [1] Peng, Zou, Zeng, Li, Chen, Li, Wang, "HiLoRA: Hierarchical Low-Rank
   Adaptation for Personalized Federated Learning", CVPR 2026
   (arXiv:2603.02785).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self, cast

import torch
from flwr.app import ArrayRecord, Message, MetricRecordValues, RecordDict

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
)
from fedlr.client_apps.payloads import LORA
from fedlr.errors import ProtocolError
from fedlr.flower.records import config_float, config_int, record_to_state
from fedlr.linalg import normalise_weights
from fedlr.linalg.svd import truncated_svd_of_mean
from fedlr.options import NoOptions, option
from fedlr.round.instructions import with_records
from fedlr.round.replies import Replies
from fedlr.strategies.base import ClientUpdate, RoundReport, weighted_means
from fedlr.strategies.lora import lora_model
from fedlr.strategies.lora_svd import (
    PersonalLoraStrategy,
    PersonalReplies,
    RoundRoles,
    RoundRolesReplies,
)
from fedlr.strategies.registration import ClientContract, register_method

__all__ = [
    "HILORA_GAMMA_CLUSTER",
    "HILORA_GAMMA_ROOT",
    "HILORA_STAGE",
    "HILORA_TIERS",
    "HiLoRA",
    "HiLoRAOptions",
    "HierarchicalTiers",
    "choose_cluster_count",
    "product_factors",
    "subspace_distances",
]

HILORA_STAGE = "hilora-stage"
"""Instruction key: 0 root, 1 cluster, 2 leaf."""
HILORA_GAMMA_ROOT = "hilora-gamma-root"
"""Instruction key: ``gamma_r``, the penalty on the trained ``B``'s overlap
with the root's."""
HILORA_GAMMA_CLUSTER = "hilora-gamma-cluster"
"""Instruction key: ``gamma_c``, the leaf's penalty of overlap with the
cluster's ``B``."""
HILORA_TIERS = "hilora-tiers"
"""Per-node ArrayRecord: ``cluster/<key>`` (the frozen cluster tier, leaf
stage) or ``active/<key>`` (the adapter the node starts from, cluster stage),
keys of A and B; the root tier is the instruction's ``arrays``."""
ROOT, CLUSTER, LEAF = 0, 1, 2
_NODE_LEAF = "fedlr-hilora-leaf"
"""``context.state`` ArrayRecord: the node's leaf adapter (A, B by layout key)."""


# ------------------------------------------------------------------ kernels
def product_factors(
    bs: Sequence[torch.Tensor],
    as_: Sequence[torch.Tensor],
    weights: Sequence[float] | torch.Tensor,
    rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``B = U_r``, ``A = S_r V_r^T`` of ``sum_i w_i B_i A_i`` (float64).

    Parameters
    ----------
    bs, as_ : k tensors (d_out, r) and (r, d_in)
    weights : (k,) non-negative, normalised here
    rank : int

    Returns
    -------
    (d_out, rank) and (rank, d_in) float64 tensors; signs fixed so each column
    of ``U`` has a positive peak (:func:`fedlr.linalg.svd.fix_signs`), columns
    beyond the product's rank zero.
    """
    svd = truncated_svd_of_mean(bs, as_, weights, rank=rank)
    u, s, vh = svd.u.double(), svd.s.double(), svd.vh.double()
    b = torch.zeros(u.shape[0], rank, dtype=torch.float64)
    a = torch.zeros(rank, vh.shape[1], dtype=torch.float64)
    keep = s.numel()
    b[:, :keep] = u
    a[:keep] = s[:, None] * vh
    return b, a


def subspace_distances(
    bases: Sequence[Mapping[str, torch.Tensor]], rank: int
) -> torch.Tensor:
    """``d_ij = mean_layers (1 - ||U_i^T U_j||_F^2 / r)`` of nodes' subspaces.

    Parameters
    ----------
    bases : n mappings of layer key to a (d_out, r) matrix
        Each node's ``B`` per layer (its top-``r`` left singular vectors are
        taken here; a zero matrix has none and is left out).
    rank : int

    Returns
    -------
    (n, n) float64 tensor, zero diagonal; 1 where two nodes share no layer.
    """
    us: list[dict[str, torch.Tensor]] = []
    for node in bases:
        own = {}
        for key, b in node.items():
            if float(torch.linalg.matrix_norm(b.double())) > 0.0:
                u = torch.linalg.svd(b.double(), full_matrices=False).U
                own[key] = u[:, :rank]
        us.append(own)
    n = len(us)
    d = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(i + 1, n):
            shared = sorted(us[i].keys() & us[j].keys())
            if not shared:
                d[i, j] = d[j, i] = 1.0
                continue
            total = sum(
                1.0 - float((us[i][k].T @ us[j][k]).square().sum()) / rank
                for k in shared
            )
            d[i, j] = d[j, i] = total / len(shared)
    return d


def affinities(distances: torch.Tensor) -> torch.Tensor:
    """``S = exp(-D^2 / (2 sigma^2))``, ``sigma`` the median positive distance
    (1 when none), diagonal 1."""
    positive = distances[distances > 0]
    sigma = float(positive.median()) if positive.numel() else 1.0
    s = torch.exp(-distances.square() / (2.0 * sigma**2))
    s.fill_diagonal_(1.0)
    return s


def choose_cluster_count(similarity: torch.Tensor, k_min: int, k_max: int) -> int:
    """``K`` at the largest eigengap of the normalised Laplacian of ``S``.

    ``L = I - D^-1/2 S D^-1/2`` with ascending eigenvalues ``mu_1 <= ...``;
    ``K = argmax_{k_min <= k <= min(k_max, n - 1)} mu_{k+1} - mu_k`` (1-based;
    the first such ``k`` on ties). Fewer than ``k_min + 1`` nodes: ``K =
    min(k_min, n)``.
    """
    n = similarity.shape[0]
    degree = similarity.sum(dim=1)
    inv = torch.where(degree > 0, degree.rsqrt(), torch.zeros_like(degree))
    laplacian = torch.eye(n, dtype=torch.float64) - inv[:, None] * similarity * inv
    mu = torch.linalg.eigvalsh(laplacian.double())
    best, best_gap = min(k_min, n), -math.inf
    for k in range(k_min, min(k_max, n - 1) + 1):
        gap = float(mu[k] - mu[k - 1])
        if gap > best_gap:
            best, best_gap = k, gap
    return best


def spectral_labels(similarity: torch.Tensor, k: int, seed: int) -> list[int]:
    """Spectral clustering of the precomputed affinities into ``k`` groups
    (scikit-learn's ``SpectralClustering``, seeded; ``k >= n``: one node a
    cluster)."""
    n = similarity.shape[0]
    if k <= 1 or n <= 1:
        return [0] * n
    if k >= n:  # each node its own cluster
        return list(range(n))
    from sklearn.cluster import SpectralClustering

    model = SpectralClustering(n_clusters=k, affinity="precomputed", random_state=seed)
    return [int(x) for x in model.fit_predict(similarity.numpy())]


# ------------------------------------------------------------------ client
def _tiers_expected(incoming: Incoming) -> Expected | None:
    """``hilora-tiers``: the cluster stage's ``active/`` ``A`` and ``B`` of
    every layer, the leaf stage's ``cluster/`` ones, at the layer's shapes."""
    stage = incoming.config.get(HILORA_STAGE, ROOT)
    if stage == ROOT or not isinstance(incoming.layout, AdapterLayout):
        return None
    prefix = "active/" if stage == CLUSTER else "cluster/"
    factors = incoming.layout.shapes(Role.LORA_A, Role.LORA_B)
    return Expected({f"{prefix}{key}": shape for key, shape in factors.items()})


class HierarchicalTiers(ClientFeature):
    """The client side: fold the frozen tiers into ``W0``, train the active one.

    On for every instruction carrying ``hilora-stage`` (a LoRA model only).
    Root stage: nothing to do. Cluster stage: ``W0 + s B_r A_r``, the adapter
    loaded from ``active/``. Leaf stage: ``W0 + s B_r A_r + s B_c A_c`` and
    the node's own leaf adapter (``context.state``; first ``B_l = 0``,
    ``A_l = A_c``), trained beside the head (``train-roles`` is the head) and
    kept at the reply. Training adds the orthogonality penalty, which reads
    no data.
    """

    keys = (
        Bound(HILORA_STAGE, "int", 0, 2),
        Bound(HILORA_GAMMA_ROOT, "float", 0.0),
        Bound(HILORA_GAMMA_CLUSTER, "float", 0.0),
    )
    receives = (
        Record(
            HILORA_TIERS,
            "the cluster's factors (leaf stage), the adapter to train (cluster stage)",
            _tiers_expected,
        ),
    )
    node_state = (Record(_NODE_LEAF, "the node's leaf adapter `A_l`, `B_l` per layer"),)
    loss_reads_data = False
    order = 55

    def __init__(self, stage: int, gamma_root: float, gamma_cluster: float) -> None:
        self.stage = stage
        self.gammas = {"root": gamma_root, "cluster": gamma_cluster}
        self.frozen: dict[str, dict[str, torch.Tensor]] = {}
        self.b_params: dict[str, torch.nn.Parameter] = {}
        self.lora: list[torch.nn.Parameter] = []

    @classmethod
    def training_change(cls, options: Any) -> str | None:
        return "HiLoRA's orthogonality penalty on the trained B (reads no data)"

    @classmethod
    def for_round(cls, job: RoundJob) -> Self | None:
        if HILORA_STAGE not in job.config:
            return None
        stage = config_int(job.config, HILORA_STAGE)
        lora_model(job, f"'{HILORA_STAGE}' stacks LoRA adapters")
        return cls(
            stage,
            config_float(job.config, HILORA_GAMMA_ROOT, 0.0),
            config_float(job.config, HILORA_GAMMA_CLUSTER, 0.0),
        )

    def load(
        self,
        job: RoundJob,
        received: dict[str, torch.Tensor],
        state: dict[str, torch.Tensor],
    ) -> None:
        if self.stage == ROOT:
            return
        view = cast(LoraModel, job.adapted)
        tiers = record_to_state(job.message.content.array_records[HILORA_TIERS])
        frozen = ("root",) if self.stage == CLUSTER else ("root", "cluster")
        kept = job.context.state.array_records
        leaf = record_to_state(kept[_NODE_LEAF]) if _NODE_LEAF in kept else {}
        for m in view.layout.modules:
            base = state[m.base_key].double()
            for tier in frozen:  # the root is the received global adapter
                source = received if tier == "root" else tiers
                prefix = "" if tier == "root" else f"{tier}/"
                a = source.get(f"{prefix}{m.a_key}")
                b = source.get(f"{prefix}{m.b_key}")
                if a is None or b is None:
                    raise ProtocolError(
                        f"'{HILORA_TIERS}' has no {tier} tier of {m.name}"
                    )
                base = base + m.scaling * (b.double() @ a.double())
                self.frozen.setdefault(tier, {})[m.b_key] = b.float()
            state[m.base_key] = base.to(state[m.base_key].dtype)
            if self.stage == CLUSTER:
                state[m.a_key] = tiers[f"active/{m.a_key}"].to(state[m.a_key].dtype)
                state[m.b_key] = tiers[f"active/{m.b_key}"].to(state[m.b_key].dtype)
            elif m.a_key in leaf and tuple(leaf[m.b_key].shape) == (m.d_out, m.rank):
                state[m.a_key], state[m.b_key] = leaf[m.a_key], leaf[m.b_key]
                job.personal_loaded = True
            else:
                state[m.a_key] = tiers[f"cluster/{m.a_key}"].to(state[m.a_key].dtype)
                state[m.b_key] = torch.zeros_like(state[m.b_key])

    def train_also(self, job: RoundJob) -> list[torch.nn.Parameter]:
        """The leaf stage: the node's own A and B (never sent)."""
        view = cast(LoraModel, job.adapted)
        layers = lora_layers(view.model)
        adapter = view.model.active_adapter
        for m in view.layout.modules:
            layer = layers[m.name]
            self.b_params[m.b_key] = cast(
                torch.nn.Parameter, layer.lora_B[adapter].weight
            )
            if self.stage == LEAF:
                self.lora.append(cast(torch.nn.Parameter, layer.lora_A[adapter].weight))
                self.lora.append(self.b_params[m.b_key])
        return list(self.lora)

    def loss(self, job: RoundJob) -> Callable[[], torch.Tensor] | None:
        if self.stage == ROOT or not job.is_train:
            return None

        def term() -> torch.Tensor:
            total = torch.zeros(())
            for tier, frozen in self.frozen.items():
                gamma = self.gammas[tier]
                if gamma <= 0.0:
                    continue
                for key, param in self.b_params.items():
                    overlap = frozen[key].to(param.device, param.dtype).T @ param
                    total = total.to(param.device) + gamma * overlap.square().sum()
            return total

        return term

    def reply_records(
        self,
        job: RoundJob,
        trained: dict[str, torch.Tensor],
        metrics: dict[str, MetricRecordValues],
        content: RecordDict,
    ) -> None:
        if self.stage != LEAF or not job.is_train:
            return
        view = cast(LoraModel, job.adapted)
        own = view.state((Role.LORA_A, Role.LORA_B))
        if all(bool(torch.isfinite(v).all()) for v in own.values()):
            job.context.state[_NODE_LEAF] = ArrayRecord(
                {k: v.detach().cpu().float().contiguous() for k, v in own.items()}
            )


# ------------------------------------------------------------------ server
class HiLoRAReplies(RoundRolesReplies, PersonalReplies):
    """HiLoRA's reply step: the replies' keys follow the stage."""

    method: HiLoRA


@dataclass(frozen=True)
class HiLoRAOptions(NoOptions):
    """HiLoRA's run-config keys (FedLLM-Factory's defaults)."""

    hilora_root_rounds: int = option(
        15,
        "HiLoRA's T_r: rounds of the root stage "
        "([methods/hilora.md](methods/hilora.md))",
        range=">= 1",
    )
    hilora_cluster_rounds: int = option(
        20,
        "HiLoRA's T_c: rounds of the cluster stage (then the leaf stage)",
        range=">= 0",
    )
    hilora_gamma_root: float = option(
        0.1,
        "HiLoRA's gamma_r: penalty of the trained B's overlap with the root's",
        range=">= 0",
    )
    hilora_gamma_cluster: float = option(
        0.1,
        "HiLoRA's gamma_c: penalty of the leaf B's overlap with the cluster's",
        range=">= 0",
    )
    hilora_ema: float = option(
        0.9,
        "HiLoRA's lambda: decay of each node's averaged B for the clustering",
        range="[0, 1)",
    )
    hilora_min_clusters: int = option(
        2, "HiLoRA's k_min: fewest clusters the eigengap may choose", range=">= 1"
    )
    hilora_max_clusters: int = option(
        10, "HiLoRA's k_max: most clusters the eigengap may choose", range=">= 1"
    )


@register_method(
    "hilora",
    payload=LORA,
    options=HiLoRAOptions,
    summary="root, cluster and leaf adapters trained in cascade; clusters from "
    "the clients' LoRA subspaces (personalised)",
    client=(HierarchicalTiers,),
    sum_only=False,
    client_contract=ClientContract(
        carries="`A`, `B` (the root adapter), head; `hilora-stage`, "
        "`hilora-gamma-root`, `hilora-gamma-cluster`, `personal-split`; from "
        "the cluster stage the ArrayRecord `hilora-tiers`; in the leaf stage "
        "`train-roles` `head`",
        helpers="`apply_round` folds the frozen tiers (the root from `arrays`, the "
        "cluster's from `hilora-tiers`) into your base weights and loads the "
        "adapter to train (cluster stage: the cluster's; leaf stage: your "
        "kept leaf, or B = 0); add `job.penalty()` (γ Σ‖B_frozenᵀB‖²) to your "
        "loss; in the leaf stage `job.parameters()` includes A and B (not "
        "sent) and `job.reply()` keeps them in `context.state`",
    ),
)
class HiLoRA(RoundRoles, PersonalLoraStrategy):
    """Root, cluster and leaf LoRA tiers, trained in that order.

    Parameters
    ----------
    options : HiLoRAOptions, optional
    **kwargs
        Other parameters: see :class:`PersonalLoraStrategy`.
    """

    method_options: HiLoRAOptions
    replies_type: ClassVar[type[Replies]] = HiLoRAReplies

    send_roles: ClassVar[tuple[Role, ...]] = (Role.LORA_A, Role.LORA_B, Role.HEAD)
    train_roles: ClassVar[tuple[Role, ...]] = (Role.LORA_A, Role.LORA_B, Role.HEAD)
    keep_roles: ClassVar[tuple[Role, ...]] = ()
    extra_columns: tuple[str, ...] = (*PersonalLoraStrategy.extra_columns, "clusters")

    def __init__(self, *, layout: AdapterLayout, **kwargs: Any) -> None:
        super().__init__(layout=layout, **kwargs)
        self.ema: dict[int, dict[str, torch.Tensor]] = {}
        """Each node's averaged normalised ``B`` per layer (root stage)."""
        self.labels: dict[int, int] = {}
        """Each clustered node's cluster."""
        self.clusters: dict[int, dict[str, torch.Tensor]] = {}
        """Each cluster's adapter (A, B by layout key)."""

    # ---------------------------------------------------------------- stages
    def stage(self, server_round: int) -> int:
        """0 (root) for rounds ``<= T_r``, 1 (cluster) to ``T_r + T_c``, then 2."""
        opts = self.method_options
        if server_round <= opts.hilora_root_rounds:
            return ROOT
        if server_round <= opts.hilora_root_rounds + opts.hilora_cluster_rounds:
            return CLUSTER
        return LEAF

    def round_roles(self, server_round: int) -> tuple[Role, ...]:
        """What a round's replies carry: A, B and the head (leaf stage: the head)."""
        if self.stage(server_round) == LEAF:
            return (Role.HEAD,)
        return self.train_roles

    def round_config(self, server_round: int) -> dict[str, Any]:
        config = super().round_config(server_round)
        opts = self.method_options
        config[HILORA_STAGE] = self.stage(server_round)
        config[HILORA_GAMMA_ROOT] = opts.hilora_gamma_root
        config[HILORA_GAMMA_CLUSTER] = opts.hilora_gamma_cluster
        return config

    def cluster_of(self, node: int) -> int:
        """The node's cluster; a node never seen in the root stage joins the
        largest cluster (the lowest label on ties)."""
        if node in self.labels:
            return self.labels[node]
        if not self.labels:
            return 0
        counts: dict[int, int] = {}
        for label in self.labels.values():
            counts[label] = counts.get(label, 0) + 1
        return min(counts, key=lambda k: (-counts[k], k))

    def instructions(
        self,
        server_round: int,
        messages: list[Message],
        arrays: ArrayRecord,
        *,
        train: bool,
    ) -> list[Message]:
        """From the cluster stage, each node's ``hilora-tiers``."""
        messages = super().instructions(server_round, messages, arrays, train=train)
        stage = self.stage(server_round)
        if stage == ROOT:
            return messages
        root = record_to_state(arrays)
        out = []
        for message in messages:
            cluster = self.clusters.get(
                self.cluster_of(int(message.metadata.dst_node_id))
            )
            tiers: dict[str, torch.Tensor] = {}
            for m in self.layout.modules:
                start_a = cluster[m.a_key] if cluster else root[m.a_key]
                start_b = (
                    cluster[m.b_key] if cluster else torch.zeros_like(root[m.b_key])
                )
                kind = "active" if stage == CLUSTER else "cluster"
                tiers[f"{kind}/{m.a_key}"] = start_a
                tiers[f"{kind}/{m.b_key}"] = start_b
            out.append(with_records(message, {HILORA_TIERS: ArrayRecord(tiers)}))
        return out

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "round": self._round,
            "ema": {
                n: {k: v.clone() for k, v in e.items()} for n, e in self.ema.items()
            },
            "labels": dict(self.labels),
            "clusters": {
                c: {k: v.clone() for k, v in a.items()}
                for c, a in self.clusters.items()
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        unknown = sorted(set(state) - {"round", "ema", "labels", "clusters"})
        if unknown:
            raise ValueError(f"HiLoRA: unknown state keys {unknown}")
        self._round = int(state.get("round", 0))
        self.ema = {int(n): dict(e) for n, e in state.get("ema", {}).items()}
        self.labels = {int(n): int(c) for n, c in state.get("labels", {}).items()}
        self.clusters = {int(c): dict(a) for c, a in state.get("clusters", {}).items()}

    # ----------------------------------------------------------- aggregation
    def _product(
        self, updates: Sequence[ClientUpdate], like: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        weights = normalise_weights([u.weight for u in updates], len(updates))
        out = {}
        for m in self.layout.modules:
            b, a = product_factors(
                [u.arrays[m.b_key] for u in updates],
                [u.arrays[m.a_key] for u in updates],
                weights,
                m.rank,
            )
            out[m.b_key] = b.to(like[m.b_key].dtype)
            out[m.a_key] = a.to(like[m.a_key].dtype)
        return out

    def _gap(
        self, updates: Sequence[ClientUpdate], tier: Mapping[str, torch.Tensor]
    ) -> RoundReport:
        """``||sum_i w_i B_i A_i - B A||_F`` of a tier and its clients' replies."""
        factors = {
            m.name: (
                [u.arrays[m.b_key] for u in updates],
                [u.arrays[m.a_key] for u in updates],
            )
            for m in self.layout.modules
        }
        aggregate = {
            m.name: (tier[m.b_key], tier[m.a_key]) for m in self.layout.modules
        }
        return self.factored_gap_report(updates, factors, aggregate)

    def _remember_subspaces(self, updates: Sequence[ClientUpdate]) -> None:
        lam = self.method_options.hilora_ema
        for u in updates:
            own = self.ema.setdefault(u.node_id, {})
            for m in self.layout.modules:
                b = u.arrays[m.b_key].double()
                unit = b / max(float(torch.linalg.matrix_norm(b)), 1e-12)
                if m.b_key in own:
                    unit = lam * own[m.b_key] + (1.0 - lam) * unit
                    unit = unit / max(float(torch.linalg.matrix_norm(unit)), 1e-12)
                own[m.b_key] = unit

    def _cluster(self) -> None:
        """LoRA-Subspace Adaptive Clustering of the nodes with a subspace."""
        opts = self.method_options
        nodes = sorted(self.ema)
        distances = subspace_distances([self.ema[n] for n in nodes], self.rank)
        similarity = affinities(distances)
        k = choose_cluster_count(
            similarity, opts.hilora_min_clusters, opts.hilora_max_clusters
        )
        labels = spectral_labels(similarity, k, self.seed)
        self.labels = dict(zip(nodes, labels, strict=True))

    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        stage = self.stage(server_round)
        state = dict(current)
        state.update(weighted_means(updates, self.layout.keys(Role.HEAD), current))
        report = RoundReport()
        if stage == ROOT:
            root = self._product(updates, current)
            state.update(root)
            report = self._gap(updates, root)
            self._remember_subspaces(updates)
            if server_round == self.method_options.hilora_root_rounds:
                self._cluster()
        elif stage == CLUSTER:
            groups: dict[int, list[ClientUpdate]] = {}
            for u in updates:
                groups.setdefault(self.cluster_of(u.node_id), []).append(u)
            gaps = []
            for label, members in sorted(groups.items()):
                self.clusters[label] = self._product(members, current)
                gaps.append(self._gap(members, self.clusters[label]).metrics)
            report.metrics = {
                "frobenius-gap": math.sqrt(sum(g["frobenius-gap"] ** 2 for g in gaps)),
                "relative-gap": max(g["relative-gap"] for g in gaps),
                "rank": float(self.rank),
            }
        report.metrics["clusters"] = float(len(set(self.labels.values())))
        return state, self.with_personal_count(updates, report)
