"""Pure torch kernels for aggregation; no Flower, no peft.

Each module holds one family of kernels with the shapes in its docstrings.
"""

from fedlr.linalg.lowrank import (
    factored_frobenius_norm,
    fold_residual,
    mean_of_products_factors,
    normalise_weights,
    residual_factors,
    weighted_mean,
)
from fedlr.linalg.svd import (
    TruncatedSVD,
    factored_svd,
    fix_signs,
    truncated_svd_of_mean,
)

__all__ = [
    "TruncatedSVD",
    "factored_frobenius_norm",
    "factored_svd",
    "fix_signs",
    "fold_residual",
    "mean_of_products_factors",
    "normalise_weights",
    "residual_factors",
    "truncated_svd_of_mean",
    "weighted_mean",
]
