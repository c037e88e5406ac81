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
from fedlr.linalg.qrmix import (
    QRMIX_FORMS,
    ClientEigen,
    fc_flatten,
    fc_hessian_eigenpairs,
    fc_hessian_matvec,
    fc_unflatten,
    qrmix_update,
    subspace_iteration,
)

__all__ = [
    "QRMIX_FORMS",
    "ClientEigen",
    "factored_frobenius_norm",
    "fc_flatten",
    "fc_hessian_eigenpairs",
    "fc_hessian_matvec",
    "fc_unflatten",
    "fold_residual",
    "mean_of_products_factors",
    "normalise_weights",
    "qrmix_update",
    "residual_factors",
    "subspace_iteration",
    "weighted_mean",
]
