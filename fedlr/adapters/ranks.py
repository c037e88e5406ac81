"""Heterogeneous LoRA ranks: the tensor rules both sides apply.

The instruction keys that switch these rules on are named elsewhere
(``leading-rank`` in :mod:`fedlr.wire.protocol`, ``fold-tail`` and
``prune-gamma`` with the client features that read them); the math lives
here, on layouts and tensors, with no Flower import:

* :func:`leading_rank`: a node of rank ``r`` keeps the leading ``r``
  components of wider factors, rescaled;
* :func:`fold_tail`: the components it cut, added to its base weights;
* :func:`pruned_rank`: the rank HetLoRA's self-pruning keeps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from fedlr.adapters.roles import AdapterLayout
from fedlr.errors import ProtocolError

__all__ = ["fold_tail", "leading_rank", "pruned_rank"]

# The instruction keys of these rules (named where they are read: fedlr.client.pruning,
# fedlr.strategies.fedex_lora; this module stays free of Flower and of the
# strategies, so it spells them here for its messages).
FOLD_TAIL = "fold-tail"
PRUNE_GAMMA = "prune-gamma"


def leading_rank(
    layout: AdapterLayout, received: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Heterogeneous ranks: the leading ``r`` components of wider ``A``, ``B``.

    A layer of rank ``r`` sent ``A`` (R, d_in) and ``B`` (d_out, R) with
    ``R > r`` keeps ``A[:r]`` and ``B[:, :r]`` times ``sqrt(r / R)``: then
    ``(alpha / r) B A`` is the rank-``r`` leading part of ``(alpha / R) B_R A_R``.
    The rule of :data:`fedlr.wire.protocol.LEADING_RANK`: nodes apply it to what
    they receive, the server to what it sends a node of known rank.
    """
    out = dict(received)
    for m in layout.modules:
        a, b = received.get(m.a_key), received.get(m.b_key)
        wide = a.shape[0] if a is not None else b.shape[1] if b is not None else 0
        if wide <= m.rank:
            continue
        gain = math.sqrt(m.rank / wide)
        if a is not None:
            out[m.a_key] = gain * a[: m.rank]
        if b is not None:
            out[m.b_key] = gain * b[:, : m.rank]
    return out


def pruned_rank(rank: int, gamma: float) -> int:
    """The rank a node of rank ``r`` prunes itself to: ``max(1, floor(gamma r))``.

    The rule of :data:`fedlr.client.pruning.PRUNE_GAMMA` (up to a rounding allowance
    of ``1e-9``, so that ``floor(0.57 * 100)`` is 57 although ``0.57 * 100`` is
    56.99999999999999 in floating point).

    Parameters
    ----------
    rank : int
        The node's rank ``r`` >= 1.
    gamma : float
        The decay factor, in (0, 1].

    Returns
    -------
    int
        ``r'`` in ``[1, r]``; ``r' = r`` means nothing can be pruned.

    Raises
    ------
    ProtocolError
        If ``rank`` < 1 or ``gamma`` is not in (0, 1].
    """
    if rank < 1:
        raise ProtocolError(f"a LoRA rank must be >= 1, got {rank}")
    if not 0.0 < gamma <= 1.0:
        raise ProtocolError(f"'{PRUNE_GAMMA}' must be in (0, 1], got {gamma}")
    return max(1, min(rank, math.floor(gamma * rank + 1e-9)))


def fold_tail(
    layout: AdapterLayout,
    received: Mapping[str, torch.Tensor],
    base: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Heterogeneous FedEx: base weights that absorb the cut components.

    For every layer of rank ``r`` whose received ``A`` (R, d_in) and
    ``B`` (d_out, R) are wider (``R > r``), the base weight gains
    ``(alpha / R) B[:, r:] A[r:]`` (transposed where the layer stores
    ``W0`` as (d_in, d_out), ``fan_in_fan_out``), computed in float64. With
    :func:`leading_rank`'s cut, ``W0 + (alpha / r) B_r A_r`` then equals
    ``W0 + (alpha / R) B A``: the rule of
    :data:`fedlr.strategies.fedex_lora.FOLD_TAIL`, which nodes apply and the
    server's aggregation assumes.

    Parameters
    ----------
    layout : AdapterLayout
        The node's layout, at its own rank.
    received : mapping of str to torch.Tensor
        The instruction's arrays, before :func:`leading_rank`.
    base : mapping of str to torch.Tensor
        The node's base weights for this instruction.

    Returns
    -------
    dict of str to torch.Tensor
        ``base`` with the changed weights replaced (new tensors, same dtype).

    Raises
    ------
    ProtocolError
        If a layer whose components are cut lacks its ``A``, ``B`` or base
        weight.
    """
    out = dict(base)
    for m in layout.modules:
        a, b = received.get(m.a_key), received.get(m.b_key)
        if a is None and b is None:
            continue
        if a is None or b is None or m.base_key not in base:
            missing = [
                k
                for k, v in (
                    (m.a_key, a),
                    (m.b_key, b),
                    (m.base_key, base.get(m.base_key)),
                )
                if v is None
            ]
            raise ProtocolError(f"'{FOLD_TAIL}' needs {missing} of layer '{m.name}'")
        wide = int(a.shape[0])
        if wide <= m.rank:
            continue
        scale = m.scaling * m.rank / wide  # alpha / R
        left, right = m.as_stored(
            b[:, m.rank :].to(torch.float64), a[m.rank :].to(torch.float64)
        )
        weight = base[m.base_key]
        out[m.base_key] = torch.addmm(
            weight.to(torch.float64), left, right, alpha=scale
        ).to(weight.dtype)
    return out
