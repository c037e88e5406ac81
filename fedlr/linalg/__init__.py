"""Pure torch kernels for aggregation; no Flower, no peft.

Each module holds one family of kernels with the shapes in its docstrings;
this package re-exports every module's public names (its ``__all__``).
"""

from fedlr.linalg import (
    cost,
    fot,
    hetero,
    lowrank,
    qrmix,
    randomized,
    sorf,
    sorf_pair_signs,
    sorf_refit,
    streaming,
    svd,
    vera,
)
from fedlr.linalg.cost import *  # noqa: F403
from fedlr.linalg.fot import *  # noqa: F403
from fedlr.linalg.hetero import *  # noqa: F403
from fedlr.linalg.lowrank import *  # noqa: F403
from fedlr.linalg.qrmix import *  # noqa: F403
from fedlr.linalg.randomized import *  # noqa: F403
from fedlr.linalg.sorf import *  # noqa: F403
from fedlr.linalg.sorf_pair_signs import *  # noqa: F403
from fedlr.linalg.sorf_refit import *  # noqa: F403
from fedlr.linalg.streaming import *  # noqa: F403
from fedlr.linalg.svd import *  # noqa: F403
from fedlr.linalg.vera import *  # noqa: F403

__all__: list[str] = []
for _module in (
    cost,
    fot,
    hetero,
    lowrank,
    qrmix,
    randomized,
    sorf,
    sorf_pair_signs,
    sorf_refit,
    streaming,
    svd,
    vera,
):
    __all__ += _module.__all__
del _module
