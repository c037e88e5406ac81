"""``none``: the method's plain weighted aggregation."""

from __future__ import annotations

from fedlr.robust.registration import register_rule

register_rule(
    "none",
    summary="the method's plain weighted aggregation",
    defends="nothing numeric (validation, the `num-examples` cap and round "
    "rejection still apply)",
    startup=lambda config: "no rule",
)
