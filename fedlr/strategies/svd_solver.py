"""The ``svd-solver`` option of the methods whose server SVD may be randomized.

FedSpec's SVD of the mean of products and Global SVD's SVD of the stacked
updates take an exact path while it is cheap and a randomized range finder
past a size the cost model sets (:func:`fedlr.linalg.svd_of_mean`,
:func:`fedlr.linalg.updates_svd`). ``svd-solver`` makes that choice open:

``auto`` (default)
    The cost model's choice; the first time a run's strategy takes the
    randomized path it logs one line naming the layer, its size and the
    solver.
``exact``
    Always an exact path (factored QR, or the dense/Gram matrix accumulated
    in place), whatever the size: deterministic factors at a higher cost.
``randomized``
    Always the randomized path, even where the exact one is cheap.

The option is declared once (:class:`SvdSolverOptions`); each method's
options class extends it.
"""

from __future__ import annotations

from dataclasses import dataclass
from logging import INFO

from flwr.supercore import log

from fedlr.linalg import SVD_SOLVERS, TruncatedSVD
from fedlr.options import NoOptions, option, require

__all__ = ["SvdSolverChoice", "SvdSolverOptions"]


@dataclass(frozen=True)
class SvdSolverOptions(NoOptions):
    """The ``svd-solver`` key (FedSpec, Global SVD)."""

    svd_solver: str = option(
        "auto",
        "server SVD of FedSpec and Global SVD: `auto` (exact while cheap, "
        "randomized past the cost model's size, logged once), `exact` (always "
        "exact, any size) or `randomized` (always the randomized range finder; "
        "approximate factors on flat spectra, see "
        "[methods/fedspec.md](methods/fedspec.md))",
        bad=[("fast", r"one of \['auto', 'exact', 'randomized'\]")],
    )

    def check(self) -> None:
        super().check()
        require(
            self.svd_solver in SVD_SOLVERS,
            "svd-solver",
            f"must be one of {list(SVD_SOLVERS)}, got {self.svd_solver!r}",
        )


class SvdSolverChoice:
    """Mixin of a strategy with the ``svd-solver`` option.

    Gives :attr:`svd_solver` and :meth:`note_svd`, which logs the first
    randomized SVD of a run under ``auto`` (once per strategy object: one
    line per run, again after a resume).
    """

    method_options: SvdSolverOptions
    _svd_switch_logged: bool = False

    @property
    def svd_solver(self) -> str:
        """The ``svd-solver`` option: ``auto``, ``exact`` or ``randomized``."""
        return self.method_options.svd_solver

    def note_svd(
        self,
        method: str,
        layer: str,
        svd: TruncatedSVD,
        *,
        clients: int,
        rank: int,
        shape: tuple[int, int],
    ) -> None:
        """Log the first randomized SVD under ``auto``: layer, size, solver."""
        if not svd.randomized or self.svd_solver != "auto" or self._svd_switch_logged:
            return
        self._svd_switch_logged = True
        log(
            INFO,
            "%s: layer %s (%d x %d, %d clients at rank %d) is past the exact "
            "SVD's cost: the randomized SVD runs from now on where it is cheaper "
            '(svd-solver "auto"; set svd-solver = "exact" for exact factors)',
            method,
            layer,
            shape[0],
            shape[1],
            clients,
            rank,
        )
