"""The server plan of a method: fedlr's plans, by payload kind name.

Each plan module registers its builder under its payload kind's name
(:func:`fedlr.server_apps.plans.register_plan`); this module imports fedlr's
own plan modules, by name below, and looks a kind's plan up. It sits above
them (they import :mod:`fedlr.server_apps.plans`, the shared types), and the
runner above it. A plug-in payload kind registers its plan from its own
module (imported through the run config's ``extensions``); fedlr's new
payload kind adds its plan module to the import below.

The plans are named, not discovered: a discovery of :mod:`fedlr.server_apps`
would import the runner and the apps too, which import this module.
"""

from __future__ import annotations

from fedlr.server_apps import gpse, lora, qrmix, vera
from fedlr.server_apps.plans import ServerPlan, plan_builder
from fedlr.strategies.registry import MethodConfig

__all__ = ["BUILTIN_PLANS", "build_plan", "plan_builder"]

BUILTIN_PLANS = (gpse, lora, qrmix, vera)
"""fedlr's plan modules (importing one registers its kinds' plans)."""


def build_plan(method: MethodConfig) -> ServerPlan:
    """Build the server plan of a parsed run config's method (its payload kind's)."""
    return plan_builder(method.spec.payload.name)(method)
