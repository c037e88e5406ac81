"""HetLoRA's rank self-pruning on a node (:data:`fedlr.protocol.PRUNE_GAMMA`).

A node of rank ``r`` adds ``lambda`` times the norm of its tail components
``[r', r)``, ``r' = max(1, floor(gamma r))`` (:func:`tail_norm`), to its loss;
if that norm went down during training it replies at rank ``r'`` and keeps
that rank in ``context.state`` (:class:`RankPruning`;
:func:`fedlr.client.apply_round` and :meth:`fedlr.client.ClientRound.reply`
drive it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from logging import INFO, getLogger

import torch
from flwr.app import ConfigRecord, Context, RecordDict

from fedlr import protocol
from fedlr.adapters.lora import LoraModel, parameters_by_key
from fedlr.adapters.plugin import adapted
from fedlr.adapters.ranks import pruned_rank
from fedlr.adapters.roles import AdaptedModel, AdapterLayout
from fedlr.errors import ProtocolError
from fedlr.flower.records import config_float, config_int

__all__ = [
    "RankPruning",
    "node_rank",
    "pruning_settings",
    "round_pruning",
    "tail_norm",
]

_LOG = getLogger("fedlr")


@dataclass(frozen=True)
class RankPruning:
    """HetLoRA's rank self-pruning in one round (:data:`fedlr.protocol.PRUNE_GAMMA`).

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
    gamma = config_float(config, protocol.PRUNE_GAMMA, 1.0)
    if not 0.0 < gamma <= 1.0:
        raise ProtocolError(f"'{protocol.PRUNE_GAMMA}' must be in (0, 1], got {gamma}")
    lam = config_float(config, protocol.PRUNE_LAMBDA, 0.0)
    if not (math.isfinite(lam) and lam >= 0):
        raise ProtocolError(
            f"'{protocol.PRUNE_LAMBDA}' must be finite and >= 0, got {lam}"
        )
    return gamma, lam


def _kept_rank(context: Context) -> int | None:
    """The rank this node pruned itself to (``context.state``), if any."""
    record = context.state.config_records.get(protocol.RANK_STATE)
    if record is None or "rank" not in record:
        return None
    return config_int(record, "rank")


def _received_width(layout: AdapterLayout, content: RecordDict) -> int | None:
    """The rank of the instruction's first ``A`` (else ``B``), if it has one."""
    record = content.array_records.get(protocol.ARRAYS)
    if record is None or not layout.modules:
        return None
    m = layout.modules[0]
    if m.a_key in record and len(record[m.a_key].shape) == 2:
        return int(record[m.a_key].shape[0])
    if m.b_key in record and len(record[m.b_key].shape) == 2:
        return int(record[m.b_key].shape[1])
    return None


def node_rank(
    view: LoraModel,
    config: ConfigRecord,
    content: RecordDict,
    context: Context,
    rank: int | None,
    leading: bool,
    pruning: bool,
) -> int | None:
    """The rank the node's model takes this round, unless ``lora-rank`` says.

    Heterogeneous ranks: the rank the node pruned itself to, else ``rank``
    (else the model's). With pruning, a narrower instruction than that rank
    means the server knows the node at a pruned rank that the node's state
    lost (a restarted node, a resumed run): the node takes it and keeps it.
    """
    if protocol.LORA_RANK in config:
        return None
    kept = _kept_rank(context) if leading else None
    target = kept if kept is not None else rank
    if leading and pruning:
        width = _received_width(view.layout, content)
        own = target if target is not None else max(m.rank for m in view.layout.modules)
        if width is not None and 1 <= width < own:
            _LOG.log(
                INFO,
                "node %s: the server sends rank %d, below the node's %d: it "
                "knows the node at a pruned rank; training at rank %d",
                context.node_id,
                width,
                own,
                width,
            )
            context.state[protocol.RANK_STATE] = ConfigRecord({"rank": width})
            target = width
    return target


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
            f"'{protocol.PRUNE_GAMMA}' prunes the rank of a LoRA model under "
            f"'{protocol.LEADING_RANK}' (heterogeneous ranks); got a "
            f"{type(view.layout).__name__}"
            + ("" if leading else f" without '{protocol.LEADING_RANK}'")
        )
    layer_ranks = sorted({m.rank for m in view.layout.modules})
    if len(layer_ranks) != 1:
        raise ProtocolError(
            f"'{protocol.PRUNE_GAMMA}' prunes one rank per model; the model's "
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
