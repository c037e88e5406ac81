"""SecAgg+'s refusals, shared by the launcher (before the SuperLink starts) and
the ServerApp: a method that is not sum-only, and settings the round's
sampled nodes cannot meet.
"""

from __future__ import annotations

from fedlr.privacy import distributed_dp as ddp
from fedlr.privacy.secagg import (
    check_eligible,
)
from fedlr.strategies.async_lora import AsyncLoraStrategy
from fedlr.strategies.registry import MethodConfig, available_methods, get_method

__all__ = ["check_secure_config", "check_secure_method"]


def check_secure_method(method: MethodConfig) -> None:
    """Whether the method and its robust settings can run under SecAgg+.

    Raises
    ------
    SecureAggregationError
        A method that is not sum-only, or a robust rule or weight cap.
    """
    config = method.run
    eligible = [m for m in available_methods() if get_method(m).traits.sum_only]
    check_eligible(
        method.spec.name,
        method.spec.traits.sum_only,
        eligible,
        asynchronous=issubclass(method.spec.strategy, AsyncLoraStrategy),
        robust=config.robust,
        max_client_weight=config.max_client_weight,
        max_weight_ratio=config.max_weight_ratio,
    )


def check_secure_config(method: MethodConfig, sampled: int) -> int:
    """The checks of a SecAgg+ run that need no model (the launcher runs them
    before the SuperLink starts, the ServerApp again at start-up), for rounds
    of ``sampled`` nodes; the reconstruction threshold.

    Raises
    ------
    SecureAggregationError
        :func:`check_secure_method`'s refusals, fewer than 2 sampled nodes or
        too many for the quantisation range.
    ConfigError
        Distributed client DP with a ``secagg-clipping-range`` without room
        for the noise.
    """
    check_secure_method(method)
    config = method.run
    _, threshold = config.secagg.shares_and_threshold(sampled)
    dp = config.privacy.client_dp
    if dp is not None:
        ddp.check_range(
            config.secagg.clipping_range, dp.clip, dp.noise_multiplier, threshold
        )
    return threshold
