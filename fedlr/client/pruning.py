"""HetLoRA's rank self-pruning on a node, and the rank a node's model takes.

A node of rank ``r`` adds ``lambda`` times the norm of its tail components
``[r', r)``, ``r' = max(1, floor(gamma r))`` (:func:`tail_norm`), to its loss;
if that norm went down during training it replies at rank ``r'`` and keeps
that rank in ``context.state`` (:class:`RankPruning`; the client feature
:class:`fedlr.strategies.hetlora.RankSelfPruning` drives it).

Whether a node serves a round at its own rank, the rank it pruned itself to,
or the instruction's ``lora-rank`` is decided in one place,
:func:`round_rank` (the node's instruction check and
:func:`fedlr.client.round.apply_round` both use its answer).

The pruning's wire keys (:data:`PRUNE_GAMMA`, :data:`PRUNE_LAMBDA`) and its
node state (:data:`RANK_STATE`) are named here, the lowest module that reads
them; the feature declares their bounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from flwr.app import ConfigRecord, Context, RecordDict

from fedlr.adapters.lora import LoraModel, parameters_by_key
from fedlr.adapters.plugin import adapted
from fedlr.adapters.ranks import pruned_rank
from fedlr.adapters.roles import AdaptedModel, AdapterLayout
from fedlr.errors import ProtocolError
from fedlr.flower.records import config_float, config_int
from fedlr.wire import protocol

__all__ = [
    "PRUNE_GAMMA",
    "PRUNE_LAMBDA",
    "RANK_STATE",
    "RankPruning",
    "RoundRank",
    "keep_rank",
    "kept_rank",
    "pruning_settings",
    "received_width",
    "round_pruning",
    "round_rank",
    "tail_norm",
]

PRUNE_GAMMA = "prune-gamma"
"""HetLoRA rank self-pruning: the decay factor ``gamma`` in (0, 1] (1: off).
With ``leading-rank``, a node of rank ``r`` whose tail components
``[r', r)``, ``r' = max(1, floor(gamma r))``
(:func:`fedlr.adapters.ranks.pruned_rank`), have a smaller norm
``sum_layers ||s B[:, r':] A[r':]||_F`` (``s = alpha / r``) after its local
training than before replies at rank ``r'`` (the leading ``r'`` components,
rescaled as :func:`fedlr.adapters.ranks.leading_rank` does) and keeps that
rank from then on (:data:`RANK_STATE`); its rank never grows back."""
PRUNE_LAMBDA = "prune-lambda"
"""HetLoRA rank self-pruning: weight ``lambda`` >= 0 of the term
``lambda * sum_layers ||s B[:, r':] A[r':]||_F`` added to the training loss
(:data:`PRUNE_GAMMA`)."""
RANK_STATE = "fedlr-rank"
"""Name of the ConfigRecord in ``context.state`` under which a node keeps the
LoRA rank it pruned itself to (:data:`PRUNE_GAMMA`), key ``rank``."""


@dataclass(frozen=True)
class RankPruning:
    """HetLoRA's rank self-pruning in one round (:data:`PRUNE_GAMMA`).

    One rank per model: the tail norm sums the layers' norms
    (:func:`tail_norm`), and the node keeps or prunes every layer together.

    Attributes
    ----------
    gamma : float
        The decay factor ``gamma`` in (0, 1).
    lam : float
        The weight ``lambda`` >= 0 of the tail-norm term in the loss.
    rank : int
        The node's rank ``r`` this round.
    keep : int
        ``r' = max(1, floor(gamma r))`` (:func:`fedlr.adapters.ranks.pruned_rank`):
        the tail is the components ``[r', r)``.
    before : float
        The tail norm of the model as received, before training (float64).
    """

    gamma: float
    lam: float
    rank: int
    keep: int
    before: float

    @property
    def can_prune(self) -> bool:
        """Whether there is a tail to prune (``r' < r``; a rank-1 node has none)."""
        return self.keep < self.rank

    def decide(self, after: float) -> int:
        """The rank to reply at: ``r'`` if the tail norm went down, else ``r``.

        Parameters
        ----------
        after : float
            The tail norm after training.
        """
        return self.keep if self.can_prune and after < self.before else self.rank


def tail_norm(
    model: torch.nn.Module | AdaptedModel,
    start: int,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``sum_layers ||s B[:, start:] A[start:]||_F``: the LoRA tail's norm.

    ``s`` is each layer's scaling (``alpha / r``), so each term is the norm
    of the tail components' contribution to the layer's weight. Computed from
    the ``t x t`` Gram matrices (``t = r - start``),
    ``||B_t A_t||_F^2 = sum((B_t^T B_t) * (A_t A_t^T))``, never the
    ``d_out x d_in`` product; differentiable in the live parameters (a zero
    tail has gradient 0, not NaN). A layer of rank ``<= start`` adds 0.

    Parameters
    ----------
    model : peft.PeftModel or AdaptedModel
        A LoRA model.
    start : int
        The first tail component, ``>= 0``.
    dtype : torch.dtype, optional
        Compute in this dtype (default: the parameters').

    Returns
    -------
    torch.Tensor
        A scalar, on the parameters' device.

    Raises
    ------
    ProtocolError
        If the model is not a LoRA model.
    ValueError
        If ``start`` < 0.
    """
    view = adapted(model)
    if not isinstance(view, LoraModel):
        raise ProtocolError(
            f"the tail norm is of LoRA layers; the model has a "
            f"{type(view.layout).__name__}"
        )
    return _tail_norm_of(_tail_factors(view, start), dtype)


def pruning_settings(config: ConfigRecord) -> tuple[float, float]:
    """``(gamma, lambda)`` of ``prune-gamma`` and ``prune-lambda`` (1, 0 if absent)."""
    gamma = config_float(config, PRUNE_GAMMA, 1.0)
    if not 0.0 < gamma <= 1.0:
        raise ProtocolError(f"'{PRUNE_GAMMA}' must be in (0, 1], got {gamma}")
    lam = config_float(config, PRUNE_LAMBDA, 0.0)
    if not (math.isfinite(lam) and lam >= 0):
        raise ProtocolError(f"'{PRUNE_LAMBDA}' must be finite and >= 0, got {lam}")
    return gamma, lam


def kept_rank(state: RecordDict) -> int | None:
    """The rank a node pruned itself to (:data:`RANK_STATE` in its
    ``context.state``), if any."""
    record = state.config_records.get(RANK_STATE)
    if record is None or "rank" not in record:
        return None
    return config_int(record, "rank")


def keep_rank(context: Context, rank: int) -> None:
    """Keep ``rank`` as the node's pruned rank (:data:`RANK_STATE`)."""
    context.state[RANK_STATE] = ConfigRecord({"rank": int(rank)})


def received_width(layout: AdapterLayout, content: RecordDict) -> int | None:
    """The declared rank of the instruction's first ``A`` (else ``B``), if any.

    Read from the ``Array``'s declared shape; nothing is decoded.
    """
    record = content.array_records.get(protocol.ARRAYS)
    if record is None or not layout.modules:
        return None
    m = layout.modules[0]
    if m.a_key in record and len(record[m.a_key].shape) == 2:
        return int(record[m.a_key].shape[0])
    if m.b_key in record and len(record[m.b_key].shape) == 2:
        return int(record[m.b_key].shape[1])
    return None


@dataclass(frozen=True)
class RoundRank:
    """The LoRA rank a node's model takes this round, and who decided it.

    Attributes
    ----------
    rank : int or None
        ``None``: each LoRA layer keeps its own rank (no rank was given
        anywhere and the model's layers differ).
    source : {"instruction", "kept", "node", "model", "server-pruned"}
        ``lora-rank`` of the instruction; the rank the node pruned itself to
        (:data:`RANK_STATE`); the node's own rank (``own``); the model's; or,
        under pruning, a narrower instruction than the node's rank: the
        server knows the node at a pruned rank its state lost (a restarted
        node, a resumed run), which the node takes and keeps
        (:func:`keep_rank`).
    instead : int or None
        ``"server-pruned"``: the rank the node would have taken.
    """

    rank: int | None
    source: str
    instead: int | None = None

    @property
    def adopted(self) -> bool:
        """Whether the node takes a pruned rank the server knows it at."""
        return self.source == "server-pruned"


def round_rank(
    config: Mapping[str, object],
    state: RecordDict | None,
    *,
    own: int | None,
    received: int | None = None,
    model_rank: int | None = None,
) -> RoundRank:
    """The rank a node's LoRA model takes this round: one decision, in order.

    1. the instruction's ``lora-rank`` (FedSpec grows it, a server may set
       it);
    2. heterogeneous ranks (``leading-rank``): the rank the node pruned
       itself to (``state``, :data:`RANK_STATE`);
    3. ``own``, the node's configured rank (its ``client-ranks`` entry, else
       ``lora-rank``; :meth:`fedlr.config.run.RunConfig.rank_for`), whatever rank
       an earlier instruction gave a model the process caches;
    4. none: each layer keeps its own rank.

    With pruning (``prune-gamma`` < 1 under ``leading-rank``), an
    instruction whose factors are narrower (``received``) than that rank
    (or than ``model_rank`` when none is known) is served at their width
    (``source = "server-pruned"``: the caller keeps it, :func:`keep_rank`).

    Parameters
    ----------
    config : mapping
        The instruction's ConfigRecord, already checked against its bounds.
    state : flwr.app.RecordDict or None
        The node's ``context.state`` (``None``: nothing kept).
    own : int or None
        The node's configured rank (``None``: the model's).
    received : int or None
        The declared width of the instruction's first ``A``
        (:func:`received_width`).
    model_rank : int or None
        The model's largest layer rank.

    Returns
    -------
    RoundRank

    Raises
    ------
    ProtocolError
        If ``lora-rank`` is not >= 1, or ``prune-gamma`` / ``prune-lambda``
        are out of range (:func:`pruning_settings`).
    """
    if protocol.LORA_RANK in config:
        rank = config_int(config, protocol.LORA_RANK)  # type: ignore[arg-type]
        if rank < 1:
            raise ProtocolError(f"'{protocol.LORA_RANK}' must be >= 1, got {rank}")
        return RoundRank(rank, "instruction")
    leading = bool(config.get(protocol.LEADING_RANK, False))
    kept = kept_rank(state) if leading and state is not None else None
    decided = (
        RoundRank(kept, "kept")
        if kept is not None
        else RoundRank(own, "node" if own is not None else "model")
    )
    gamma, _ = pruning_settings(config)  # type: ignore[arg-type]
    if leading and gamma < 1:
        mine = decided.rank if decided.rank is not None else model_rank
        if received is not None and mine is not None and 1 <= received < mine:
            return RoundRank(received, "server-pruned", instead=mine)
    return decided


_TailFactors = list[tuple[float, torch.nn.Parameter, torch.nn.Parameter, int]]


def _tail_factors(view: LoraModel, start: int) -> _TailFactors:
    """Each layer's ``(s, A, B, start)`` with a tail beyond ``start`` (live)."""
    if start < 0:
        raise ValueError(f"the tail starts at a component >= 0, got {start}")
    params = parameters_by_key(view.model, view.layout)
    return [
        (m.scaling, params[m.a_key], params[m.b_key], start)
        for m in view.layout.modules
        if m.rank > start
    ]


def _tail_norm_of(factors: _TailFactors, dtype: torch.dtype | None) -> torch.Tensor:
    """``sum_layers s ||B[:, start:] A[start:]||_F`` from ``t x t`` Grams."""
    total: torch.Tensor | None = None
    for scaling, a_full, b_full, start in factors:
        a, b = a_full[start:], b_full[:, start:]
        if dtype is not None:
            a, b = a.to(dtype), b.to(dtype)
        square = ((b.T @ b) * (a @ a.T)).sum()
        # sqrt has no finite gradient at 0: a zero tail (B = 0) gets 0.
        tiny = torch.finfo(square.dtype).tiny
        norm = torch.where(
            square > tiny,
            torch.sqrt(torch.clamp(square, min=tiny)),
            torch.zeros_like(square),
        )
        term = scaling * norm
        total = term if total is None else total + term
    if total is None:
        return torch.zeros((), dtype=dtype or torch.float32)
    return total


def round_pruning(
    view: AdaptedModel, gamma: float, lam: float, leading: bool
) -> tuple[RankPruning, Callable[[], torch.Tensor] | None]:
    """The round's :class:`RankPruning` and its loss term (``None``: none)."""
    if not isinstance(view, LoraModel) or not leading:
        raise ProtocolError(
            f"'{PRUNE_GAMMA}' prunes the rank of a LoRA model under "
            f"'{protocol.LEADING_RANK}' (heterogeneous ranks); got a "
            f"{type(view.layout).__name__}"
            + ("" if leading else f" without '{protocol.LEADING_RANK}'")
        )
    layer_ranks = sorted({m.rank for m in view.layout.modules})
    if len(layer_ranks) != 1:
        raise ProtocolError(
            f"'{PRUNE_GAMMA}' prunes one rank per model; the model's "
            f"LoRA layers have ranks {layer_ranks}"
        )
    rank = layer_ranks[0]
    keep = pruned_rank(rank, gamma)
    factors = _tail_factors(view, keep) if keep < rank else []
    with torch.no_grad():
        before = float(_tail_norm_of(factors, torch.float64))
    pruning = RankPruning(gamma=gamma, lam=lam, rank=rank, keep=keep, before=before)
    if not factors or lam == 0:
        return pruning, None
    return pruning, lambda: lam * _tail_norm_of(factors, None)
