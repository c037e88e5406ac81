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
    adaptive_rank,
    factored_svd,
    fix_signs,
    local_svd_factors,
    pad_factors,
    personal_change,
    require_common_rank,
    stacked_updates_svd,
    tail_fraction,
    truncate,
    truncated_svd_of_mean,
)

__all__ = [
    "QRMIX_FORMS",
    "ClientEigen",
    "TruncatedSVD",
    "adaptive_rank",
    "factored_frobenius_norm",
    "factored_svd",
    "fc_flatten",
    "fc_hessian_eigenpairs",
    "fc_hessian_matvec",
    "fc_unflatten",
    "fix_signs",
    "fold_residual",
    "local_svd_factors",
    "mean_of_products_factors",
    "normalise_weights",
    "pad_factors",
    "personal_change",
    "qrmix_update",
    "require_common_rank",
    "residual_factors",
    "stacked_updates_svd",
    "subspace_iteration",
    "tail_fraction",
    "truncate",
    "truncated_svd_of_mean",
    "weighted_mean",
]
