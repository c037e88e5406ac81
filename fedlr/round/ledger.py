"""The server's ledger of base-weight versions for the factored downlink.

:class:`BaseLedger` numbers the base weights a strategy publishes
(:class:`~fedlr.strategies.fedex_downlink.FactoredDownlink`), keeps the
changes between versions that together weigh less than the dense weights,
records which version each node keeps (``base-held``), and plans what each
node is sent: nothing, a chain of changes, or the dense weights. The changes
themselves, their wire format and the node's side are in
:mod:`fedlr.wire.downlink`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fedlr.wire import protocol
from fedlr.wire.downlink import BaseDelta, checksum

__all__ = ["BaseLedger"]


@dataclass
class _Step:
    version: int
    deltas: dict[str, BaseDelta] | None  # None: only the dense weights reach it
    nbytes: int


def _same_objects(a: tuple[object, ...], b: tuple[object, ...] | None) -> bool:
    return b is not None and len(a) == len(b) and all(map(operator.is_, a, b))


@dataclass
class BaseLedger:
    """The server's record of base-weight versions and who holds which.

    Parameters
    ----------
    keys : list of str
        The base-weight keys, in layout order.

    Attributes
    ----------
    version : int
        The version of the current global base weights.
    checks : list of float
        Their checksums (:func:`checksum`), in ``keys`` order.
    last_change_nbytes : float or None
        Bytes of the last published change (``inf``: it reached the nodes
        only as dense weights); ``None`` before the first.
    held : dict of int to int
        The version each node said it keeps (``base-held``).
    """

    keys: list[str]
    version: int = 0
    checks: list[float] | None = None
    dense_nbytes: int = 0
    last_change_nbytes: float | None = None
    held: dict[int, int] = field(default_factory=dict)
    steps: list[_Step] = field(default_factory=list)
    # the objects the weights last adopted came from (see sync's ``source``)
    _source: tuple[object, ...] | None = field(default=None, repr=False)

    def sync(
        self,
        base: Mapping[str, torch.Tensor],
        *,
        source: Iterable[object] | None = None,
    ) -> None:
        """Adopt this round's global base weights.

        The ones :meth:`publish` recorded keep their version; any others
        (the first round, a run resumed from arrays the ledger has not seen)
        start a new version that every node is sent dense.

        ``source`` (the immutable Flower ``Array`` objects ``base`` was read
        from, in ``keys`` order) lets a second call with the very same
        objects, e.g. ``configure_evaluate`` after ``configure_train`` on the
        same arrays, skip the checksums; :meth:`publish` and
        :meth:`load_state_dict` forget it.
        """
        seen = tuple(source) if source is not None else None
        if seen is not None and _same_objects(seen, self._source):
            return
        self._source = seen
        checks = [checksum(k, base[k]) for k in self.keys]
        if self.checks is not None and checks == self.checks:
            return
        if self.checks is not None:
            self.version += 1
            self.steps.clear()
            self.held.clear()
            self.last_change_nbytes = None
        self.checks = checks
        self.dense_nbytes = sum(
            base[k].numel() * base[k].element_size() for k in self.keys
        )

    def publish(
        self, deltas: Mapping[str, BaseDelta] | None, base: Mapping[str, torch.Tensor]
    ) -> None:
        """Record the next version: ``base``, reached by ``deltas`` (or only dense)."""
        self.version += 1
        if deltas is not None and set(deltas) != set(self.keys):
            deltas = None
        nbytes = sum(d.nbytes for d in deltas.values()) if deltas is not None else 0
        self.last_change_nbytes = float(nbytes) if deltas is not None else math.inf
        self.steps.append(_Step(self.version, dict(deltas) if deltas else None, nbytes))
        # Keep the newest changes that together still weigh less than dense.
        kept: list[_Step] = []
        total = 0
        for step in reversed(self.steps):
            if step.deltas is None or total + step.nbytes >= self.dense_nbytes:
                break
            kept.append(step)
            total += step.nbytes
        self.steps = kept[::-1]
        self.checks = [checksum(k, base[k]) for k in self.keys]
        self._source = None

    def confirm(self, node: int, version: float) -> None:
        """Record that ``node`` keeps ``version``.

        Raises
        ------
        ValueError
            If ``version`` is not an integer in ``[0, self.version]``.
        """
        if not (
            math.isfinite(version)
            and version == int(version)
            and 0 <= version <= self.version
        ):
            raise ValueError(
                f"'{protocol.BASE_HELD}' must be a published version in "
                f"[0, {self.version}], got {version}"
            )
        self.held[node] = int(version)

    def forget(self, node: int) -> None:
        """The node is sent dense weights next time."""
        self.held.pop(node, None)

    def plan(self, node: int) -> list[tuple[int, dict[str, BaseDelta]]] | None:
        """The changes to send ``node`` (``[]``: it is current), or ``None``: dense."""
        held = self.held.get(node)
        if held is None or held > self.version:
            return None
        if held == self.version:
            return []
        chain = [s for s in self.steps if s.version > held]
        if (
            not chain
            or chain[0].version != held + 1
            or sum(s.nbytes for s in chain) >= self.dense_nbytes
        ):
            return None
        return [(s.version, s.deltas) for s in chain if s.deltas is not None]

    def state_dict(self) -> dict[str, Any]:
        """Versions, checks and kept changes; not :attr:`held`.

        Which node keeps which version is not saved: a run resumed from a
        checkpoint (new processes, nodes that may keep nothing) sends every
        node the dense weights once, and a rejected round, restored from this
        state, keeps what the round's replies said.
        """
        return {
            "version": self.version,
            "checks": list(self.checks) if self.checks is not None else None,
            "dense-nbytes": self.dense_nbytes,
            "last-change-nbytes": self.last_change_nbytes,
            "steps": [
                {
                    "version": s.version,
                    "nbytes": s.nbytes,
                    "deltas": {
                        k: {
                            "kind": d.kind,
                            "left": d.left,
                            "right": d.right,
                            "transposed": d.transposed,
                        }
                        for k, d in (s.deltas or {}).items()
                    },
                }
                for s in self.steps
            ],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._source = None
        self.version = int(state["version"])
        checks = state["checks"]
        self.checks = [float(c) for c in checks] if checks is not None else None
        self.dense_nbytes = int(state["dense-nbytes"])
        last = state.get("last-change-nbytes")
        self.last_change_nbytes = None if last is None else float(last)
        self.steps = [
            _Step(
                int(s["version"]),
                {
                    k: BaseDelta(
                        d["kind"],
                        d["left"],
                        d["right"],
                        bool(d.get("transposed", False)),
                    )
                    for k, d in s["deltas"].items()
                }
                or None,
                int(s["nbytes"]),
            )
            for s in state["steps"]
        ]
