"""The update spaces robust rules measure and move client updates in.

A method's space (:class:`UpdateSpace`): the change of the arrays a client
sends (:class:`ParameterSpace`, optionally mapped, e.g. FOT's projection off
its bases), of each adapted layer's product ``B_i A_i - B A`` from the
factors' r x r Gram blocks, never a dense d_out x d_in matrix
(:class:`ProductSpace`), or, for clients at their own LoRA ranks, the scaled
product change against the factors each was sent
(:class:`RankedProductSpace`), or their factors' change against the factors
each was sent (:class:`RankedFactorSpace`).

A LoRA method declares which of the two its aggregation works in
(:data:`AGGREGATION_SPACES`): a method that averages ``A`` and ``B`` apart
(:data:`FACTORS`) publishes ``mean(B) mean(A)``, which is not invariant under
the gauge ``(c A, B / c)`` of a factor pair, so it is measured on the factors
(a rebalanced reply has the same product, and a huge factor change); a method
whose aggregate is a function of the products alone (:data:`PRODUCT`: an SVD
of the mean of products) is measured on the products
(docs/reliability.md, "Measured where it is aggregated").
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fedlr.wire.updates import ClientUpdate

__all__ = [
    "AGGREGATION_SPACES",
    "FACTORS",
    "PRODUCT",
    "ParameterSpace",
    "ProductSpace",
    "RankedFactorSpace",
    "RankedProductSpace",
    "RecordSpace",
    "SumSpace",
    "UpdateSpace",
]

FACTORS = "factors"
"""A LoRA method that averages (or otherwise combines linearly) ``A`` and
``B`` apart: its replies are measured as the change of every array sent,
factors included (:class:`ParameterSpace`, :class:`RankedFactorSpace`)."""
PRODUCT = "product"
"""A LoRA method whose aggregate depends on each client's factors only
through its products ``B_i A_i``: measured on the products
(:class:`ProductSpace`, :class:`RankedProductSpace`)."""
AGGREGATION_SPACES = (FACTORS, PRODUCT)
"""What a LoRA strategy's ``aggregation_space`` may declare."""


_GRAM_CHUNK_BYTES = 64 * 2**20
"""Memory a chunk of the factored Gram may take (float64)."""


class UpdateSpace(ABC):
    """The space in which a method's client updates are measured and moved.

    A client's update ``u_i`` is its reply's change against the round's
    reference (the global state sent). Subclasses give the Gram matrix of
    the updates and a way to move one update towards the reference.
    """

    @abstractmethod
    def gram(self, updates: Sequence[ClientUpdate]) -> torch.Tensor:
        """``G[i, j] = <u_i, u_j>``, (k, k) float64."""

    @abstractmethod
    def norm(self, update: ClientUpdate) -> float:
        """``||u||`` of one update."""

    @abstractmethod
    def shrink(self, update: ClientUpdate, factor: float) -> ClientUpdate:
        """The update with its arrays moved to ``ref + factor * (x - ref)``."""

    linear: bool = True
    """Whether ``norm(shrink(u, g)) == g * norm(u)`` (else clipping bisects)."""

    records: tuple[RecordSpace, ...] = ()
    """The extra reply records the method aggregates, each in its own space:
    the robust rules bound each record's influence as they bound the arrays'
    (:func:`fedlr.robust.rules.robust_aggregate`). Empty: no such record."""


def _arrays_towards(
    arrays: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor],
    factor: float,
) -> dict[str, torch.Tensor]:
    """``ref + factor * (x - ref)`` per key; a key whose reference is absent or
    of another shape (never broadcast) moves from zero."""
    moved = {}
    for key, x in arrays.items():
        ref = reference.get(key)
        base = (
            ref.to(torch.float64)
            if ref is not None and ref.shape == x.shape
            else torch.zeros_like(x, dtype=torch.float64)
        )
        moved[key] = (base + factor * (x.to(torch.float64) - base)).to(x.dtype)
    return moved


def _change(x: torch.Tensor, ref: torch.Tensor | None) -> torch.Tensor:
    """``x - ref`` in float64; ``x`` itself where the reference is absent or of
    another shape (never broadcast)."""
    x64 = x.to(torch.float64)
    return (
        x64 - ref.to(torch.float64) if ref is not None and ref.shape == x.shape else x64
    )


def _flat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The arrays as one float64 vector (empty: a vector of length 0)."""
    if not parts:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([part.reshape(-1) for part in parts])


class _ByVector:
    """The Gram matrix and norms of a space whose updates are vectors
    (:meth:`vector`)."""

    def vector(self, update: ClientUpdate) -> torch.Tensor:
        raise NotImplementedError

    def gram(self, updates: Sequence[ClientUpdate]) -> torch.Tensor:
        """``G[i, j] = <u_i, u_j>``, (k, k) float64."""
        vectors = torch.stack([self.vector(u) for u in updates])
        return vectors @ vectors.T

    def norm(self, update: ClientUpdate) -> float:
        """``||u||`` of one update."""
        return float(torch.linalg.vector_norm(self.vector(update)))


class ParameterSpace(_ByVector, UpdateSpace):
    """Updates as the change of the reply's arrays, ``x_i - x_ref``.

    Parameters
    ----------
    reference : mapping of str to torch.Tensor
        The round's global state; a reply key it lacks counts from zero.
    keys : sequence of str, optional
        The reply keys measured (default: every key of the reply).
    transform : callable, optional
        ``transform(key, delta) -> tensor``, a linear map applied to each
        key's change before it is measured (FOT: the projection off the
        protected bases).
    """

    def __init__(
        self,
        reference: Mapping[str, torch.Tensor],
        keys: Sequence[str] | None = None,
        transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.reference = reference
        self.keys = None if keys is None else list(keys)
        self.transform = transform

    def vector(self, update: ClientUpdate) -> torch.Tensor:
        """The update as one float64 vector."""
        parts = []
        keys = self.keys if self.keys is not None else sorted(update.arrays)
        for key in keys:
            delta = _change(update.arrays[key], self.reference.get(key))
            if self.transform is not None:
                delta = self.transform(key, delta)
            parts.append(delta)
        return _flat(parts)

    def shrink(self, update: ClientUpdate, factor: float) -> ClientUpdate:
        keys = self.keys if self.keys is not None else list(update.arrays)
        moved = _arrays_towards(
            {k: update.arrays[k] for k in keys}, self.reference, factor
        )
        return replace(update, arrays={**update.arrays, **moved})


class ProductSpace(UpdateSpace):
    """LoRA updates as the change of each layer's product, ``B_i A_i - B A``.

    Inner products come from the factors alone: for two products,
    ``<B_1 A_1, B_2 A_2>_F = sum((B_1^T B_2) * (A_1 A_2^T))``, an r x r
    computation per pair (O(r^2 (d_in + d_out))), never a d_out x d_in matrix.
    A factor the reply does not carry (FFA-LoRA's frozen A, FedSA's kept B) is
    the reference's. Keys outside the pairs (the head) are measured as in
    :class:`ParameterSpace`. Moving an update interpolates its factors, so
    its product-space norm is not linear in the factor: clipping bisects.

    Parameters
    ----------
    reference : mapping of str to torch.Tensor
        The round's global state.
    pairs : sequence of (str, str)
        ``(a_key, b_key)`` of every adapted layer.
    """

    linear = False

    def __init__(
        self,
        reference: Mapping[str, torch.Tensor],
        pairs: Sequence[tuple[str, str]],
    ) -> None:
        self.reference = reference
        self.pairs = list(pairs)

    def _factor(self, update: ClientUpdate, key: str) -> torch.Tensor:
        value = update.arrays.get(key)
        if value is None:
            value = self.reference[key]
        return value.to(torch.float64)

    def _reference_pair(
        self, a_key: str, b_key: str
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(A, B)`` of the reference, or None when it lacks one (zero product)."""
        if a_key not in self.reference or b_key not in self.reference:
            return None
        a = self.reference[a_key].to(torch.float64)
        b = self.reference[b_key].to(torch.float64)
        if a.shape[0] != b.shape[1]:
            return None
        return a, b

    def _measurable(self, update: ClientUpdate) -> list[tuple[str, str]]:
        """Pairs whose two factors are known (sent, or in the reference)."""
        return [
            pair
            for pair in self.pairs
            if all(k in update.arrays or k in self.reference for k in pair)
        ]

    def _rest(self, update: ClientUpdate) -> ParameterSpace:
        """The reply's other arrays, and the sent factor of a pair whose other
        factor the server never sees (FedSA's kept B), as parameters."""
        paired = {k for pair in self._measurable(update) for k in pair}
        keys = sorted(k for k in update.arrays if k not in paired)
        return ParameterSpace(self.reference, keys)

    def gram(self, updates: Sequence[ClientUpdate]) -> torch.Tensor:
        k = len(updates)
        total = torch.zeros(k, k, dtype=torch.float64)
        for a_key, b_key in self._measurable(updates[0]) if updates else []:
            bs = [self._factor(u, b_key) for u in updates]
            as_ = [self._factor(u, a_key) for u in updates]
            ref = self._reference_pair(a_key, b_key)
            if ref is None:
                total += _product_gram(bs, as_)
                continue
            bs.append(ref[1])
            as_.append(ref[0])
            p = _product_gram(bs, as_)
            # <u_i, u_j> with u_i = P_i - P_ref.
            total += p[:k, :k] - p[:k, k : k + 1] - p[k : k + 1, :k] + p[k, k]
        if updates:
            total += self._rest(updates[0]).gram(updates)
        return total

    def norm(self, update: ClientUpdate) -> float:
        sq = 0.0
        for a_key, b_key in self._measurable(update):
            b, a = self._factor(update, b_key), self._factor(update, a_key)
            sq += _inner(b, a, b, a)
            ref = self._reference_pair(a_key, b_key)
            if ref is not None:
                a0, b0 = ref
                sq += -2 * _inner(b, a, b0, a0) + _inner(b0, a0, b0, a0)
        rest = self._rest(update).norm(update)
        return math.sqrt(max(sq, 0.0) + rest * rest)

    def shrink(self, update: ClientUpdate, factor: float) -> ClientUpdate:
        moved = _arrays_towards(update.arrays, self.reference, factor)
        return replace(update, arrays=moved)


class RankedProductSpace(UpdateSpace):
    """LoRA updates of clients at their own ranks: ``s_i (B_i A_i - B0_i A0_i)``.

    Client ``i`` trains rank ``r_i`` with scaling ``s_i = alpha / r_i`` from the
    factors ``B0_i``, ``A0_i`` it was sent (for the heterogeneous-rank methods,
    the leading ``r_i`` components of the global factors, rescaled); its update
    is the change of its layer's product, ``s_i (B_i A_i - B0_i A0_i)``. Each
    update is the product of stacked factors ``[s_i B_i, -s_i B0_i]`` and
    ``[A_i; A0_i]`` (rank at most ``2 r_i``), so inner products and norms come
    from ``2 r_i x 2 r_j`` Gram blocks (:func:`_product_gram`), never a dense
    d_out x d_in matrix, whatever the ranks. Other keys (the head) are
    measured as parameters against the start. Moving an update interpolates
    its factors towards the start: clipping bisects.

    Parameters
    ----------
    pairs : sequence of (str, str)
        ``(a_key, b_key)`` of every adapted layer.
    start : callable
        ``start(update) -> arrays``: the arrays the client started from, at
        its rank, by key (every key of ``pairs`` and the others it sends).
    scaling : callable
        ``scaling(update) -> s_i``.
    """

    linear = False

    def __init__(
        self,
        pairs: Sequence[tuple[str, str]],
        start: Callable[[ClientUpdate], Mapping[str, torch.Tensor]],
        scaling: Callable[[ClientUpdate], float],
    ) -> None:
        self.pairs = list(pairs)
        self.start = start
        self.scaling = scaling

    def _stacked(
        self, update: ClientUpdate, ref: Mapping[str, torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, ``([s B, -s B0], [A; A0])``, float64."""
        s = float(self.scaling(update))
        out = []
        for a_key, b_key in self.pairs:
            b = update.arrays[b_key].to(torch.float64)
            a = update.arrays[a_key].to(torch.float64)
            b0 = ref[b_key].to(torch.float64)
            a0 = ref[a_key].to(torch.float64)
            out.append((torch.cat([s * b, -s * b0], dim=1), torch.cat([a, a0], dim=0)))
        return out

    def _rest(
        self, update: ClientUpdate, ref: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """The other keys' change against the start, as one float64 vector."""
        paired = {k for pair in self.pairs for k in pair}
        return _flat(
            [
                _change(update.arrays[key], ref.get(key))
                for key in sorted(update.arrays)
                if key not in paired
            ]
        )

    def gram(self, updates: Sequence[ClientUpdate]) -> torch.Tensor:
        refs = [self.start(u) for u in updates]
        stacks = [self._stacked(u, r) for u, r in zip(updates, refs, strict=True)]
        k = len(updates)
        total = torch.zeros(k, k, dtype=torch.float64)
        for layer in range(len(self.pairs)):
            total += _product_gram(
                [s[layer][0] for s in stacks], [s[layer][1] for s in stacks]
            )
        rest = torch.stack(
            [self._rest(u, r) for u, r in zip(updates, refs, strict=True)]
        )
        return total + rest @ rest.T

    def norm(self, update: ClientUpdate) -> float:
        ref = self.start(update)
        sq = sum(_inner(b, a, b, a) for b, a in self._stacked(update, ref))
        rest = float(torch.linalg.vector_norm(self._rest(update, ref)))
        return math.sqrt(max(sq, 0.0) + rest * rest)

    def shrink(self, update: ClientUpdate, factor: float) -> ClientUpdate:
        moved = _arrays_towards(update.arrays, self.start(update), factor)
        return replace(update, arrays=moved)


class RankedFactorSpace(_ByVector, UpdateSpace):
    """Updates of clients at their own ranks as the change of every array
    against what each was sent: ``x_i - x0_i`` over all the reply's keys.

    The factor-space counterpart of :class:`RankedProductSpace` for methods
    that combine the factors themselves (HetLoRA's zero-padded means): a
    reply's factors, not only their product, are what the method publishes.
    Linear: clipping scales.

    Parameters
    ----------
    start : callable
        ``start(update) -> arrays``: the arrays the client started from, at
        its rank, by key; a key it lacks (or of another shape) counts from
        zero.
    """

    def __init__(
        self, start: Callable[[ClientUpdate], Mapping[str, torch.Tensor]]
    ) -> None:
        self.start = start

    def deltas(self, update: ClientUpdate) -> dict[str, torch.Tensor]:
        """Each key's change against the start, float64."""
        start = self.start(update)
        return {key: _change(x, start.get(key)) for key, x in update.arrays.items()}

    def vector(self, update: ClientUpdate) -> torch.Tensor:
        """The update as one float64 vector (keys in sorted order)."""
        deltas = self.deltas(update)
        return _flat([deltas[k] for k in sorted(deltas)])

    def gram(self, updates: Sequence[ClientUpdate]) -> torch.Tensor:
        """Inner products of the zero-padded changes (ranks may differ: two
        arrays of one key meet on their leading rows and columns)."""
        deltas = [self.deltas(u) for u in updates]
        k = len(deltas)
        out = torch.zeros(k, k, dtype=torch.float64)
        for i in range(k):
            for j in range(i, k):
                total = 0.0
                for key in deltas[i].keys() & deltas[j].keys():
                    x, y = deltas[i][key], deltas[j][key]
                    if x.dim() != y.dim():
                        continue
                    common = tuple(
                        slice(0, min(a, b))
                        for a, b in zip(x.shape, y.shape, strict=True)
                    )
                    total += float((x[common] * y[common]).sum())
                out[i, j] = out[j, i] = total
        return out

    def shrink(self, update: ClientUpdate, factor: float) -> ClientUpdate:
        moved = _arrays_towards(update.arrays, self.start(update), factor)
        return replace(update, arrays=moved)


class SumSpace(UpdateSpace):
    """The direct sum of spaces that move an update alike: ``<u, v> = sum_p
    <u, v>_p``.

    For a method that publishes both what is measured in one space and what
    is measured in another: a factor method that folds the mean of the
    products into the base weights (FedEx-LoRA) publishes the factors and
    the products' mean, so a reply is measured on both, and a rule bounds it
    in each. Every part must move an update the same way (towards the same
    reference: :class:`ParameterSpace` and :class:`ProductSpace` of one
    state, or :class:`RankedFactorSpace` and :class:`RankedProductSpace` of
    one start); the first one's is used. Clipping bisects.

    Parameters
    ----------
    parts : sequence of UpdateSpace
    """

    linear = False

    def __init__(self, parts: Sequence[UpdateSpace]) -> None:
        if not parts:
            raise ValueError("a sum of spaces needs at least one space")
        self.parts = list(parts)

    def gram(self, updates: Sequence[ClientUpdate]) -> torch.Tensor:
        grams = [p.gram(updates) for p in self.parts]
        return torch.stack(grams).sum(0)

    def norm(self, update: ClientUpdate) -> float:
        return math.sqrt(sum(p.norm(update) ** 2 for p in self.parts))

    def shrink(self, update: ClientUpdate, factor: float) -> ClientUpdate:
        return self.parts[0].shrink(update, factor)


class RecordSpace(_ByVector):
    """An extra reply record as an update: ``r_i - ref_i`` over its arrays.

    The robust rules measure a record (FOT's sketches, FedLEASE's router,
    SCAFFOLD-LoRA's control delta) in this space, apart from the arrays, and
    move it towards its reference (``ref + g (r - ref)``) by the factor ``g``
    the rule gives it there.

    Parameters
    ----------
    name : str
        The record's name in :attr:`ClientUpdate.extras`.
    reference : callable, optional
        ``reference(update) -> arrays``: what the record would be had the
        client not moved it (FedLEASE: its cluster's current router); a key
        it lacks counts from zero. Default: zero (a record that is itself a
        change, or a description summed over the clients).
    by_norm_clip : bool, default True
        Whether ``norm-clip`` clips the record here; False where the method
        clips it after moving it with the arrays (SCAFFOLD-LoRA's control
        delta, :meth:`~fedlr.round.replies.Replies.clips_record`).
    """

    def __init__(
        self,
        name: str,
        reference: Callable[[ClientUpdate], Mapping[str, torch.Tensor]] | None = None,
        *,
        by_norm_clip: bool = True,
    ) -> None:
        self.name = name
        self.reference = reference
        self.by_norm_clip = by_norm_clip

    def _ref(self, update: ClientUpdate) -> Mapping[str, torch.Tensor]:
        return {} if self.reference is None else self.reference(update)

    def vector(self, update: ClientUpdate) -> torch.Tensor:
        """The record's change as one float64 vector (keys sorted)."""
        record = update.extras[self.name]
        ref = self._ref(update)
        return _flat([_change(record[key], ref.get(key)) for key in sorted(record)])

    def shrink(self, update: ClientUpdate, factor: float) -> ClientUpdate:
        """The record moved to ``ref + factor (r - ref)``, its factor kept in
        :attr:`ClientUpdate.record_factors` (multiplied)."""
        moved = _arrays_towards(update.extras[self.name], self._ref(update), factor)
        g = update.record_factors.get(self.name, 1.0) * factor
        return replace(
            update,
            extras={**update.extras, self.name: moved},
            record_factors={**update.record_factors, self.name: g},
        )


def _inner(
    b1: torch.Tensor, a1: torch.Tensor, b2: torch.Tensor, a2: torch.Tensor
) -> float:
    """``<B_1 A_1, B_2 A_2>_F`` from the factors."""
    return float(((b1.T @ b2) * (a1 @ a2.T)).sum())


def _product_gram(
    bs: Sequence[torch.Tensor], as_: Sequence[torch.Tensor]
) -> torch.Tensor:
    """``G[i, j] = <B_i A_i, B_j A_j>_F`` for n factor pairs, (n, n) float64.

    Rows are computed in chunks so that no intermediate exceeds
    :data:`_GRAM_CHUNK_BYTES`; ranks may differ between pairs.
    """
    n = len(bs)
    ranks = [int(b.shape[1]) for b in bs]
    offsets = [0]
    for r in ranks:
        offsets.append(offsets[-1] + r)
    big_b = torch.cat(list(bs), dim=1)  # (d_out, sum r)
    big_a = torch.cat(list(as_), dim=0)  # (sum r, d_in)
    width = offsets[-1]
    out = torch.zeros(n, n, dtype=torch.float64)
    rows_per_chunk = max(1, _GRAM_CHUNK_BYTES // (16 * max(width, 1)))
    i = 0
    while i < n:
        j = i
        while j < n and offsets[j + 1] - offsets[i] <= rows_per_chunk:
            j += 1
        j = max(j, i + 1)
        lo, hi = offsets[i], offsets[j]
        gb = big_b[:, lo:hi].T @ big_b  # (chunk r, width)
        ga = big_a[lo:hi] @ big_a.T
        prod = gb * ga
        for row in range(i, j):
            r0, r1 = offsets[row] - lo, offsets[row + 1] - lo
            block = prod[r0:r1]
            out[row] = torch.stack(
                [block[:, offsets[c] : offsets[c + 1]].sum() for c in range(n)]
            )
        i = j
    return out
