"""What FedAsync-LoRA and FedBuff-LoRA share: stale updates, staleness weights,
the asynchronous engine's options.

An asynchronous method is an ordinary LoRA strategy whose
:meth:`aggregate_updates` reads, for each update, the global model version it
was trained from (``tau``) and its staleness (``t - tau``, ``t`` the version
it is applied to): :class:`StaleUpdate`. fedlr's asynchronous engine
(:mod:`fedlr.server_apps.asynchronous`) builds them; a plain
:class:`~fedlr.wire.updates.ClientUpdate` (Flower's synchronous ``start()``,
the shared strategy tests) is a fresh update: staleness 0, trained from the
round's current state.

The staleness functions are Xie et al.'s [1]_ (section 5.2):

    constant:    s(d) = 1
    polynomial:  s(d) = (1 + d) ** (-a)
    hinge:       s(d) = 1 if d <= b else 1 / (a_h (d - b) + 1)

FedBuff's [2]_ ``1 / sqrt(1 + d)`` is the polynomial one with ``a = 0.5``.

References
----------
.. [1] Xie, Koyejo, Gupta, "Asynchronous Federated Optimization", OPT 2020
   (arXiv:1903.03934, 2019).
.. [2] Nguyen, Malik, Zhan, Yousefpour, Rabbat, Malek, Huba, "Federated
   Learning with Buffered Asynchronous Aggregation", AISTATS 2022.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from fedlr.errors import ConfigError
from fedlr.linalg.lowrank import MEAN_CHUNK_BYTES
from fedlr.options import NoOptions, option
from fedlr.strategies.base import ClientUpdate
from fedlr.strategies.lora import LoraStrategy

__all__ = [
    "STALENESS_FUNCTIONS",
    "AsyncLoraStrategy",
    "AsyncOptions",
    "StaleUpdate",
    "staleness_weight",
    "weighted_sum",
]

STALENESS_FUNCTIONS = ("polynomial", "hinge", "constant")
_COMPUTE = torch.float64


@dataclass(frozen=True)
class AsyncOptions(NoOptions):
    """The asynchronous engine's and the staleness weight's run-config keys
    (both asynchronous methods read them; docs/quickstart.md, "Running
    asynchronously")."""

    async_concurrency: int = option(
        0,
        "asynchronous methods: nodes kept training at once (0: a synchronous "
        "round's sample, `int(nodes · fraction-train)`)",
        range=">= 0",
    )
    max_staleness: int = option(
        100,
        "asynchronous methods: a reply trained from a global version more than "
        "this many versions old is dropped, with the reason logged",
        range=">= 0",
    )
    staleness_fn: str = option(
        "polynomial",
        "asynchronous methods: the staleness weight s(δ) "
        "([methods/fedasync-lora.md](methods/fedasync-lora.md))",
        choices=STALENESS_FUNCTIONS,
    )
    staleness_exponent: float = option(
        0.5,
        "the exponent a of the polynomial staleness weight (1 + δ)^(−a)",
        range=">= 0",
    )
    hinge_slope: float = option(
        10.0,
        "the slope a of the hinge staleness weight 1 / (a (δ − b) + 1)",
        range=">= 0",
    )
    hinge_threshold: int = option(
        4, "the staleness b up to which the hinge weight is 1", range=">= 0"
    )
    async_trace: str = option(
        "",
        "asynchronous methods in process: an absolute path to a CSV of node "
        "speeds (`partition-id,step-seconds,bytes-per-second`); empty: "
        "generated from `seed` and `speed-spread`",
        bad=[("traces/nodes.csv", "absolute path")],
    )
    speed_spread: float = option(
        10.0,
        "asynchronous methods in process, generated trace: the slowest node's "
        "step and transfer times over the fastest's",
        range=">= 1",
    )

    def check(self) -> None:
        """``async-trace``, when set, is an absolute path (the app runs from
        a copied bundle)."""
        super().check()
        if self.async_trace and not self.async_trace.startswith("/"):
            raise ConfigError(
                "async-trace", f"must be an absolute path, got {self.async_trace!r}"
            )


def staleness_weight(staleness: int, options: AsyncOptions) -> float:
    """``s(staleness)`` of ``options.staleness_fn`` (module docstring).

    Raises
    ------
    ValueError
        For a negative staleness.
    """
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    kind = options.staleness_fn
    if kind == "constant":
        return 1.0
    if kind == "polynomial":
        return float((1.0 + staleness) ** (-options.staleness_exponent))
    if staleness <= options.hinge_threshold:
        return 1.0
    return 1.0 / (options.hinge_slope * (staleness - options.hinge_threshold) + 1.0)


@dataclass(frozen=True)
class StaleUpdate(ClientUpdate):
    """A validated reply that was trained from global version ``version``.

    Attributes
    ----------
    version : int
        ``tau``: the global model version the node was sent.
    staleness : int
        ``t - tau``: versions applied between the instruction and this
        update's aggregation.
    base : dict of str to torch.Tensor
        ``x_tau``: the global arrays the node was sent.
    """

    version: int = 0
    staleness: int = 0
    base: dict[str, torch.Tensor] = field(default_factory=dict)


def staleness_of(update: ClientUpdate) -> int:
    """An update's staleness; 0 for a plain (synchronous) update."""
    return update.staleness if isinstance(update, StaleUpdate) else 0


def base_of(
    update: ClientUpdate, current: Mapping[str, torch.Tensor]
) -> Mapping[str, torch.Tensor]:
    """The arrays an update was trained from: its ``base``, or ``current``
    for a plain (synchronous) update."""
    if isinstance(update, StaleUpdate) and update.base:
        return update.base
    return current


def weighted_sum(
    tensors: Sequence[torch.Tensor], coefficients: torch.Tensor
) -> torch.Tensor:
    """``sum_i c_i t_i`` in float64, accumulated as
    :func:`fedlr.linalg.weighted_mean` does (the same groups, the same
    ``tensordot``), so with ``c`` that function's normalised weights the two
    are equal bit for bit.

    Parameters
    ----------
    tensors : sequence of k tensors of one shape
    coefficients : (k,) float64 tensor

    Returns
    -------
    torch.Tensor
        float64, the tensors' shape.
    """
    first = tensors[0]
    if coefficients.shape != (len(tensors),):
        raise ValueError(
            f"expected {len(tensors)} coefficients, got shape "
            f"{tuple(coefficients.shape)}"
        )
    acc = torch.zeros(first.shape, dtype=_COMPUTE, device=first.device)
    step = max(1, MEAN_CHUNK_BYTES // max(1, first.numel() * 8))
    for start in range(0, len(tensors), step):
        stacked = torch.stack(list(tensors[start : start + step])).to(_COMPUTE)
        acc.add_(torch.tensordot(coefficients[start : start + step], stacked, 1))
    return acc


class AsyncLoraStrategy(LoraStrategy):
    """A LoRA strategy fedlr's asynchronous engine runs
    (:mod:`fedlr.server_apps.asynchronous`): the clients run the plain LoRA
    round (A, B and the head, FedAvg-LoRA's), the server applies a buffer of
    :attr:`buffer_size` updates at a time, each with its staleness.

    Robust rules and client-level DP are refused (their bounds and
    accounting are per synchronous round of ``m`` sampled clients), as is
    secure aggregation (by the engine: SecAgg+ is a synchronous exchange).

    Raises
    ------
    ConfigError
        For a robust rule or client-level DP.
    """

    asynchronous: ClassVar[bool] = True
    extra_columns = ("virtual-time", "staleness-mean", "staleness-max", "dropped-stale")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.robust.active:
            raise ConfigError(
                "robust",
                f"{type(self).__name__} is asynchronous: robust rules bound a "
                "synchronous round's updates; set robust = none",
            )
        if self.privacy.client_dp is not None:
            raise ConfigError(
                "client-dp-noise",
                f"{type(self).__name__} is asynchronous: client-level DP's "
                "accountant is per synchronous round of sampled clients; turn "
                "client-level DP off (DP-SGD on the clients composes)",
            )

    @property
    def async_options(self) -> AsyncOptions:
        """The method's options, typed as the engine reads them."""
        opts = self.method_options
        if not isinstance(opts, AsyncOptions):
            raise TypeError(
                f"{type(self).__name__} needs AsyncOptions, got {type(opts).__name__}"
            )
        return opts

    @property
    def buffer_size(self) -> int:
        """Updates the engine buffers before each server update (1: FedAsync)."""
        return 1

    def staleness_report(self, updates: list[ClientUpdate]) -> dict[str, float]:
        """``staleness-mean`` and ``staleness-max`` of the applied updates."""
        values = [staleness_of(u) for u in updates]
        if not values:
            return {}
        return {
            "staleness-mean": float(sum(values)) / len(values),
            "staleness-max": float(max(values)),
        }


def with_staleness(
    update: ClientUpdate,
    *,
    version: int,
    staleness: int,
    base: Mapping[str, torch.Tensor],
) -> StaleUpdate:
    """``update`` as a :class:`StaleUpdate` (every field kept)."""
    fields = {f.name: getattr(update, f.name) for f in dataclasses.fields(ClientUpdate)}
    return StaleUpdate(**fields, version=version, staleness=staleness, base=dict(base))


def check_finite_weight(value: float, what: str) -> float:
    """``value`` if finite and >= 0 (a staleness weight, a mixing weight)."""
    if not (math.isfinite(value) and value >= 0):
        raise ArithmeticError(f"{what} must be finite and >= 0, got {value}")
    return value
