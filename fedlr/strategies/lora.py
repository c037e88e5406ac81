"""Shared base of the LoRA strategies: declared roles, means, Frobenius gap."""

from __future__ import annotations

import math
from logging import INFO
from typing import Any, ClassVar, Self

from flwr.supercore import log

from fedlr.adapters.roles import AdapterLayout, Role
from fedlr.config import RunConfig
from fedlr.linalg import (
    factored_frobenius_norm,
    mean_of_products_factors,
    residual_factors,
)
from fedlr.options import Options
from fedlr.strategies.base import ClientUpdate, FedLRStrategy, RoundReport

__all__ = ["LoraStrategy"]


class LoraStrategy(FedLRStrategy):
    """A strategy over LoRA adapters described by an :class:`AdapterLayout`.

    Class attributes declare the protocol: ``send_roles`` are the roles of the
    global arrays sent to clients, ``train_roles`` those clients train and send
    back (told to the ClientApp as ``train-roles`` in the ConfigRecord).

    Parameters
    ----------
    layout : AdapterLayout
        Roles, keys, shapes and scalings of the adapted model.
    **kwargs
        Other parameters: see :class:`~fedlr.strategies.base.FedLRStrategy`.
    """

    send_roles: ClassVar[tuple[Role, ...]] = (Role.LORA_A, Role.LORA_B, Role.HEAD)
    train_roles: ClassVar[tuple[Role, ...]] = (Role.LORA_A, Role.LORA_B, Role.HEAD)

    def __init__(self, *, layout: AdapterLayout, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.layout = layout

    @classmethod
    def from_run_config(
        cls,
        config: RunConfig,
        layout: AdapterLayout,
        options: Options | None = None,
    ) -> Self:
        """Build from the run config's common keys and the method's options.

        Parameters
        ----------
        config : RunConfig
        layout : AdapterLayout
        options : Options, optional
            The method's registered options (:meth:`strategy_kwargs` reads
            them); ``None``: their defaults.
        """
        return cls(
            layout=layout,
            **cls.base_options(config),
            **cls.strategy_kwargs(config, options),
        )

    @classmethod
    def strategy_kwargs(
        cls, config: RunConfig, options: Options | None
    ) -> dict[str, Any]:
        """Constructor arguments of the method's own (none here)."""
        return {}

    def summary(self) -> None:
        """Log the settings, then FedAvg's."""
        log(
            INFO,
            "\t├──> %s: %d LoRA modules, rank %d, trains %s, sends %s",
            type(self).__name__,
            len(self.layout.modules),
            self.rank,
            [r.value for r in self.train_roles],
            [r.value for r in self.send_roles],
        )
        super().summary()

    @property
    def rank(self) -> int:
        """Largest LoRA rank in the layout."""
        return max(m.rank for m in self.layout.modules)

    def send_keys(self) -> list[str]:
        """Keys of the global arrays sent to clients (the initial ArrayRecord)."""
        return self.layout.keys(*self.send_roles)

    def reply_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.layout.shapes(*self.train_roles)

    def round_config(self, server_round: int) -> dict[str, Any]:
        return {"train-roles": ",".join(role.value for role in self.train_roles)}

    # ----------------------------------------------------------------- helpers
    def gap_report(self, updates: list[ClientUpdate]) -> RoundReport:
        """Frobenius gap ``||sum_i w_i B_i A_i - B_bar A_bar||_F`` per layer and total.

        The relative gap divides by ``||sum_i w_i B_i A_i||_F``. Both are computed
        from stacked factors (no dense product per client).
        """
        weights = [u.num_examples for u in updates]
        layers: dict[str, tuple[float, float]] = {}
        gap_sq = 0.0
        ideal_sq = 0.0
        for module in self.layout.modules:
            bs = [u.arrays[module.b_key] for u in updates]
            as_ = [u.arrays[module.a_key] for u in updates]
            gap = factored_frobenius_norm(*residual_factors(bs, as_, weights))
            ideal = factored_frobenius_norm(*mean_of_products_factors(bs, as_, weights))
            layers[module.name] = (gap, gap / ideal if ideal > 0 else 0.0)
            gap_sq += gap * gap
            ideal_sq += ideal * ideal
        total = math.sqrt(gap_sq)
        ideal_total = math.sqrt(ideal_sq)
        return RoundReport(
            metrics={
                "frobenius-gap": total,
                "relative-gap": total / ideal_total if ideal_total > 0 else 0.0,
                "rank": float(self.rank),
            },
            layers=layers,
        )
