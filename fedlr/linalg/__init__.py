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
from fedlr.linalg.sorf import (
    build_lambda_d_rot,
    decompose_orthogonal,
    fit_b,
    fit_d,
    fwht,
    gamma_apply,
    gamma_apply_t,
    givens_pair_indices,
    sorf_apply,
    sorf_apply_t,
    sorf_signs,
)
from fedlr.linalg.svd import (
    TruncatedSVD,
    factored_svd,
    fix_signs,
    truncated_svd_of_mean,
)
from fedlr.linalg.vera import fold_vera_residual, vera_residual_factors

__all__ = [
    "TruncatedSVD",
    "build_lambda_d_rot",
    "decompose_orthogonal",
    "factored_frobenius_norm",
    "factored_svd",
    "fit_b",
    "fit_d",
    "fix_signs",
    "fold_residual",
    "fold_vera_residual",
    "fwht",
    "gamma_apply",
    "gamma_apply_t",
    "givens_pair_indices",
    "mean_of_products_factors",
    "normalise_weights",
    "residual_factors",
    "sorf_apply",
    "sorf_apply_t",
    "sorf_signs",
    "truncated_svd_of_mean",
    "vera_residual_factors",
    "weighted_mean",
]
