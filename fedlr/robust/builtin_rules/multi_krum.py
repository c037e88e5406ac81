"""``multi-krum``: the ``m`` clients of lowest Krum score, averaged at their
own weights (El Mhamdi, Guerraoui and Rouhault, 2018), Flower's
``MultiKrum``: :func:`~fedlr.robust.builtin_rules.krum.krum_select` keeping
``m`` = ``multi-krum-keep`` clients (``0``: ``k - f``). A record of a client
that Multi-Krum does not select on the record's own Gram matrix is set to
its reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedlr.options import option
from fedlr.robust.builtin_rules.krum import KrumOptions, krum_select
from fedlr.robust.registration import (
    RobustConfig,
    register_rule,
    selected_records,
    selection_rule,
)


@dataclass(frozen=True)
class MultiKrumOptions(KrumOptions):
    """The keys of ``multi-krum``."""

    multi_krum_keep: int = option(
        0,
        "`multi-krum`: the number m of clients of lowest Krum score that are "
        "averaged (Flower's `num_nodes_to_select`); `0`: the round's clients "
        "less `krum-byzantine`",
        range=">= 0",
    )


def _select(gram: torch.Tensor, config: RobustConfig) -> list[int]:
    options = MultiKrumOptions.of(config.options)
    f = options.krum_byzantine
    keep = options.multi_krum_keep or max(len(gram) - f, 1)
    return krum_select(gram, f, keep)


def _startup(config: RobustConfig) -> str:
    options = MultiKrumOptions.of(config.options)
    keep = options.multi_krum_keep or "the round's clients less f"
    return f"Multi-Krum keeping {keep}, f = {options.krum_byzantine}"


register_rule(
    "multi-krum",
    summary="the `multi-krum-keep` clients of lowest Krum score (`0`: all but "
    "`krum-byzantine`) are averaged at their own weights (Flower's `MultiKrum`)",
    defends="up to `f` Byzantine clients of `k > 2f + 2`, keeping more honest "
    "data per round than Krum (El Mhamdi et al., 2018)",
    startup=_startup,
    apply=selection_rule(_select, lambda config: "Krum score not kept"),
    records=selected_records(_select, "Krum score on the record not kept"),
    options=MultiKrumOptions,
)
