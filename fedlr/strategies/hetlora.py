"""HetLoRA (Cho et al., 2024): zero-padding aggregation, optional rank self-pruning.

The server averages the clients' factors zero-padded to the largest rank; a
client of rank ``r`` keeps the leading ``r`` components. With
``hetlora-prune-gamma`` < 1 the clients regularise and prune their own tail
components (:class:`RankSelfPruning`, the method's client feature). The
family's protocol and reports: :mod:`fedlr.strategies.hetero`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from logging import DEBUG, INFO, getLogger
from typing import Any, ClassVar, Self, cast

import torch
from flwr.app import ArrayRecord, Message, RecordDict

from fedlr.adapters.ranks import leading_rank
from fedlr.adapters.roles import AdapterLayout
from fedlr.client.features import Bound, ClientFeature, Record, RoundJob
from fedlr.client.pruning import (
    PRUNE_GAMMA,
    PRUNE_LAMBDA,
    RANK_STATE,
    keep_rank,
    pruning_settings,
    round_pruning,
    tail_norm,
)
from fedlr.client_apps.payloads import LORA
from fedlr.errors import ReplyValidationError
from fedlr.linalg import (
    factored_frobenius_norm,
    hetlora_factors,
    received_gap,
    stacked_update,
)
from fedlr.options import NoOptions, option
from fedlr.round.replies import Replies
from fedlr.strategies.base import ClientUpdate, RoundReport
from fedlr.strategies.hetero import HeteroRankLoRA, LayerResult, LayerUpdates
from fedlr.strategies.hetero_replies import HeteroReplies
from fedlr.strategies.registration import (
    ClientContract,
    ContractVariant,
    register_method,
)
from fedlr.wire import protocol

_LOG = getLogger("fedlr")

__all__ = ["PRUNING_COLUMNS", "HetLoRA", "HetLoRAOptions", "RankSelfPruning"]


@dataclass(frozen=True)
class HetLoRAOptions(NoOptions):
    """HetLoRA's run-config keys: rank self-pruning."""

    hetlora_prune_gamma: float = option(
        1.0,
        "decay factor γ of the clients' rank self-pruning; `1.0` turns it off. "
        "A client of rank r regularises its last components [r′, r), "
        "r′ = max(1, ⌊γr⌋), and, if their norm went down during its local "
        "training, prunes to rank r′ for the rest of the run "
        "([methods/hetlora.md](methods/hetlora.md#rank-self-pruning))",
        range="(0, 1]",
    )
    hetlora_prune_lambda: float = option(
        0.1,
        "weight λ of the pruning term λ·Σ_layers ‖(α/r) B_tail A_tail‖_F added "
        "to the clients' loss (only with `hetlora-prune-gamma` < 1; 0: prune "
        "only when training alone shrinks the tail)",
        range=">= 0",
    )


PRUNING_COLUMNS = ("mean-client-rank", "pruned-clients")
"""``results.csv`` columns of HetLoRA with rank self-pruning."""


class RankSelfPruning(ClientFeature):
    """HetLoRA's client side: regularise the tail, prune it if it shrank.

    On for a ``train`` instruction with ``prune-gamma`` < 1 (and
    ``leading-rank``). A node of rank ``r`` adds ``prune-lambda`` times the
    norm of its components ``[r', r)`` to the loss
    (:func:`fedlr.client.pruning.round_pruning`); if that norm went down during
    training, it replies at rank ``r'`` (the leading components, rescaled by
    :func:`fedlr.adapters.ranks.leading_rank`), reports ``rank-pruned`` and keeps
    rank ``r'`` in ``context.state`` (:func:`fedlr.client.pruning.round_rank` serves
    later rounds at it).

    The tail regulariser reads no data (a norm of the parameters), so DP-SGD
    adds its gradient after the per-example clipping and noise; the pruning
    decision reads only the trained parameters.
    """

    keys = (
        Bound(PRUNE_GAMMA, "float", 0.0, 1.0, low_open=True),
        Bound(PRUNE_LAMBDA, "float", 0.0),
    )
    node_state = (
        Record(RANK_STATE, "the rank the node pruned itself to (key `rank`)"),
    )
    metrics = (
        Record(
            protocol.RANK_PRUNED,
            "1 if the node pruned its rank after this round's training, else 0",
        ),
    )
    loss_reads_data = False
    order = 50

    def __init__(self, gamma: float, lam: float, leading: bool) -> None:
        self.gamma, self.lam, self.leading = gamma, lam, leading
        self.pruned = 0

    @classmethod
    def training_change(cls, options: Any) -> str | None:
        if not isinstance(options, HetLoRAOptions) or options.hetlora_prune_gamma >= 1:
            return None
        return (
            "HetLoRA's rank self-pruning (its tail regulariser, "
            f"hetlora-prune-gamma = {options.hetlora_prune_gamma:g})"
        )

    @classmethod
    def for_round(cls, job: RoundJob) -> Self | None:
        gamma, lam = pruning_settings(job.config)
        if not job.is_train or gamma >= 1:
            return None
        return cls(gamma, lam, bool(job.config.get(protocol.LEADING_RANK, False)))

    def loss(self, job: RoundJob) -> Callable[[], torch.Tensor] | None:
        job.pruning, term = round_pruning(
            job.adapted, self.gamma, self.lam, self.leading
        )
        return term

    def reply_arrays(
        self, job: RoundJob, trained: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        pruning, layout = job.pruning, job.adapted.layout
        if pruning is None or not pruning.can_prune:
            return trained
        with torch.no_grad():
            after = float(tail_norm(job.adapted, pruning.keep, dtype=torch.float64))
        rank = pruning.decide(after)
        node = job.context.node_id
        if rank == pruning.rank:
            _LOG.log(
                DEBUG,
                "node %s: tail norm %.4g -> %.4g: rank %d kept",
                node,
                pruning.before,
                after,
                rank,
            )
            return trained
        lora = cast(AdapterLayout, layout)  # round_pruning checked it
        cut = leading_rank(lora.at_rank(rank), trained)
        keep_rank(job.context, rank)
        _LOG.log(
            INFO,
            "node %s: tail norm %.4g -> %.4g (components %d..%d): rank pruned %d -> %d",
            node,
            pruning.before,
            after,
            pruning.keep,
            pruning.rank - 1,
            pruning.rank,
            rank,
        )
        self.pruned = 1
        return cut

    def reply_records(
        self,
        job: RoundJob,
        trained: dict[str, torch.Tensor],
        metrics: dict[str, Any],
        content: RecordDict,
    ) -> None:
        metrics[protocol.RANK_PRUNED] = self.pruned


class HetLoRAReplies(HeteroReplies):
    """HetLoRA's reply step (:class:`~fedlr.round.replies.Replies`)."""

    method: HetLoRA

    def validate_replies(
        self, replies: list[Message], current: ArrayRecord
    ) -> tuple[list[ClientUpdate], list[str]]:
        self.method._shrunk = set()
        return super().validate_replies(replies, current)

    def check_rank(self, node: int, rank: int) -> None:
        """With pruning: any rank ``1 .. R`` not above the node's previous one.

        Self-pruning is the one change of a node's rank the server accepts
        (a smaller rank, for good); a node not seen yet may reply at any
        rank ``1 .. R`` (its partition's rank, or a smaller one, is checked
        after the arrays: :meth:`check_partition_rank`).

        Raises
        ------
        ReplyValidationError
            Naming the node: without pruning, a rank that is not a client
            rank or differs from the node's; with pruning, a rank above the
            node's previous rank (or R).
        """
        if not self.method.pruning:
            super().check_rank(node, rank)
            return
        known = node in self.method.node_ranks
        previous = self.method.node_ranks.get(node, self.method.rank)
        if rank > previous:
            raise ReplyValidationError(
                node,
                f"rank {rank} grew from {previous}: a node that pruned its rank "
                "never grows it back"
                if known
                else f"rank {rank} exceeds the largest client rank {previous}",
            )
        if known and rank < previous:
            self.method._shrunk.add(node)

    def check_partition_rank(self, update: ClientUpdate, rank: int) -> None:
        """With pruning, a first reply may be at its partition's rank or a
        smaller one (it pruned in its first round).

        Raises
        ------
        ReplyValidationError
            Naming the node, the partition and both ranks.
        """
        want = self.partition_rank(update)
        if not self.method.pruning or want is None:
            super().check_partition_rank(update, rank)
            return
        if rank > want:
            raise ReplyValidationError(
                update.node_id,
                f"rank {rank} exceeds partition {update.partition_id}'s rank {want} "
                "(client-ranks, cycled over the partitions)",
            )


@register_method(
    "hetlora",
    payload=LORA,
    options=HetLoRAOptions,
    summary="heterogeneous ranks: mean of the zero-padded factors; each client "
    "keeps the leading components at its own rank (optionally pruning it)",
    client=(RankSelfPruning,),
    client_contract=ClientContract(
        carries="`A`, `B` (the largest client rank, or your rank once the server "
        "knows it), head; `leading-rank`",
        helpers="keep your model's own rank: cut the leading components and rescale; "
        "reply at your rank (one of the server's `client_ranks`)",
        variants=(
            ContractVariant(
                when="with pruning",
                carries="as above, plus `prune-gamma` γ < 1 and `prune-lambda` λ",
                helpers="add `job.penalty()` (λ·Σ_layers ‖(α/r) B[:, r′:] A[r′:]‖_F, "
                "r′ = max(1, ⌊γr⌋)) to your loss; `job.reply()` prunes to "
                "rank r′ when that tail norm went down during training "
                "(leading r′ components times `sqrt(r′ / r)`), replies "
                "`rank-pruned`, and keeps r′ in `context.state`; the next "
                "`apply_round` rebuilds your model at r′. A model you cache "
                "for several nodes: pass `apply_round(model, message, "
                "context, rank=<the node's configured rank>)` so that each "
                "node gets its own rank back. The server accepts any rank up "
                "to the node's previous one and drops a reply whose rank grew",
            ),
        ),
    ),
)
class HetLoRA(HeteroRankLoRA):
    """HetLoRA: zero-padding aggregation, truncation to each client's rank.

    Rank self-pruning (``hetlora_prune_gamma`` < 1; the paper's Section 3): the
    round's
    ConfigRecord carries ``prune-gamma`` and ``prune-lambda``; a client of
    rank ``r`` adds ``lambda * sum_layers ||s B[:, r':] A[r':]||_F``
    (``r' = max(1, floor(gamma r))``, ``s = alpha / r``) to its loss and, if
    that tail norm is lower after training than as received, replies at rank
    ``r'`` and keeps it (:func:`fedlr.client.round.apply_round`). One rank per
    client, for all its layers (the norms are summed over the layers). The
    server then accepts a reply at any rank ``1 .. R`` up to the node's
    previous rank (:meth:`check_rank`); a node whose rank grows is dropped.
    A pruned client is sent only its ``r'`` components from then on. The
    round reports ``mean-client-rank`` (the round's replies) and
    ``pruned-clients`` (replies that pruned this round); ``gap-rank-<r>`` and
    the per-rank bytes stay those of the configured ``client-ranks`` (a
    client pruned to one of them counts there).

    Parameters
    ----------
    options : HetLoRAOptions, optional
        ``hetlora_prune_gamma``, the decay factor ``gamma`` in (0, 1] (1: no
        pruning; default), and ``hetlora_prune_lambda``, the pruning term's
        weight ``lambda`` >= 0 (default 0.1); either can be passed by name.
    **kwargs
        Other parameters: see :class:`HeteroRankLoRA`.

    Raises
    ------
    ConfigError
        Naming ``hetlora-prune-gamma`` or ``hetlora-prune-lambda`` for a value
        out of range.
    """

    method_options: HetLoRAOptions

    replies_type: ClassVar[type[Replies]] = HetLoRAReplies

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._shrunk: set[int] = set()
        if self.pruning:
            self.extra_columns = (*self.extra_columns, *PRUNING_COLUMNS)

    @property
    def prune_gamma(self) -> float:
        """The decay factor ``gamma`` (the ``hetlora-prune-gamma`` option)."""
        return self.method_options.hetlora_prune_gamma

    @property
    def prune_lambda(self) -> float:
        """The pruning term's weight (the ``hetlora-prune-lambda`` option)."""
        return self.method_options.hetlora_prune_lambda

    @property
    def pruning(self) -> bool:
        """Whether clients prune their rank (``prune_gamma`` < 1)."""
        return self.prune_gamma < 1.0

    def round_config(self, server_round: int) -> dict[str, Any]:
        """The base round config, plus ``prune-gamma`` and ``prune-lambda``."""
        config = super().round_config(server_round)
        if self.pruning:
            config[PRUNE_GAMMA] = self.prune_gamma
            config[PRUNE_LAMBDA] = self.prune_lambda
        return config

    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        state, report = super().aggregate_updates(server_round, updates, current)
        if self.pruning:
            key = self.layout.modules[0].a_key
            ranks = [int(u.arrays[key].shape[0]) for u in updates]
            report.metrics["mean-client-rank"] = sum(ranks) / len(ranks)
            report.metrics["pruned-clients"] = float(
                sum(
                    1
                    for u in updates
                    if u.node_id in self._shrunk
                    or u.metrics.get(protocol.RANK_PRUNED, 0.0) >= 0.5
                )
            )
        return state, report

    def aggregate_layer(
        self,
        layer: LayerUpdates,
        current: Mapping[str, torch.Tensor],
        state: dict[str, torch.Tensor],
    ) -> LayerResult:
        b, a = hetlora_factors(*layer.factors, self.rank)
        self.set_factors(layer.module, b, a, current, state)
        left, right = stacked_update(*layer.factors)
        # The configured ranks (report columns) and any pruned rank this round.
        ranks = sorted({*self.client_ranks, *(int(x.shape[0]) for x in layer.as_)})
        gaps = {r: received_gap(left, right, b, a, r) for r in ranks}
        return LayerResult(gaps, factored_frobenius_norm(left, right))
