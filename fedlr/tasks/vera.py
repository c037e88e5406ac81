"""Model builders of the VeRA family on the text task.

The data side (held-out split, partitions, encoding) is
:func:`fedlr.tasks.text.text_task`'s; this module builds the task's seeded model with
VeRA (through peft) or SORF-VeRA adapters on ``target-modules``. The server and
every client call the same builder, so all nodes hold the same frozen
projections.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedlr.adapters.sorf_vera import SorfVeraSettings, build_sorf_vera_model
from fedlr.adapters.vera import VeraModel, VeraSettings, build_vera_model
from fedlr.config.run import RunConfig
from fedlr.options import Options, option, require, require_finite, require_positive
from fedlr.tasks.text import text_task

__all__ = [
    "SorfVeraOptions",
    "VeraOptions",
    "build_sorf_vera_text_model",
    "build_vera_text_model",
]


def _projection_seed() -> Any:
    """``projection-seed``, declared once for both payload kinds reading it."""
    return option(
        0,
        "seed of the shared frozen A, B (and SORF signs); sent to and checked "
        "by every client; 0 … 2³² − 1",
        bad=[(-1, "must be in")],
    )


def _vera_lr() -> Any:
    """``vera-lr``, declared once for both payload kinds reading it."""
    return option(
        0.01,
        "client AdamW learning rate of the VeRA family in round 1 (decayed by "
        "`lr-decay`; `lr` is the LoRA methods'); finite and > 0",
        bad=[(0.0, "finite and > 0")],
    )


def _check_seed_and_lr(options: VeraOptions | SorfVeraOptions) -> None:
    require(
        0 <= options.projection_seed < 2**32,
        "projection-seed",
        f"must be in [0, 2**32), got {options.projection_seed}",
    )
    require_positive(options, "vera_lr", finite=True)


@dataclass(frozen=True)
class VeraOptions(Options):
    """Run-config keys of the ``vera`` payload kind (clients and server)."""

    vera_rank: int = option(
        256,
        "VeRA rank r of the shared projections (peft's default); ≥ 1",
        bad=[(0, "must be >= 1")],
    )
    projection_seed: int = _projection_seed()
    vera_d_initial: float = option(
        0.1,
        "initial entries of VeRA's d (b starts at 0); finite",
        bad=[(float("inf"), "must be finite")],
    )
    vera_lr: float = _vera_lr()

    def check(self) -> None:
        require_positive(self, "vera_rank")
        _check_seed_and_lr(self)
        require_finite(self, "vera_d_initial")


@dataclass(frozen=True)
class SorfVeraOptions(Options):
    """Run-config keys of the ``sorf-vera`` payload kind (clients and server)."""

    sorf_rank: int = option(
        16,
        "SORF-VeRA rank r: r(r−1)/2 Givens angles per layer; 1 … 64",
        bad=[(65, "must be <= 64"), (0, "must be >= 1")],
    )
    projection_seed: int = _projection_seed()
    sorf_d_scale_initial: float = option(
        0.0,
        "SORF-VeRA initial scale m of Λ_d (0: start from the pretrained model); finite",
        bad=[(float("nan"), "must be finite")],
    )
    vera_lr: float = _vera_lr()

    def check(self) -> None:
        require_positive(self, "sorf_rank")
        require(
            self.sorf_rank <= 64,
            "sorf-rank",
            f"must be <= 64 (r(r-1)/2 Givens angles), got {self.sorf_rank}",
        )
        _check_seed_and_lr(self)
        require_finite(self, "sorf_d_scale_initial")


def build_vera_text_model(config: RunConfig, options: VeraOptions) -> VeraModel:
    """The task's seeded model with peft VeRA (rank ``vera-rank``)."""
    task = text_task(config)
    base = task.build_base()
    settings = VeraSettings(
        rank=options.vera_rank,
        projection_seed=options.projection_seed,
        d_initial=options.vera_d_initial,
        target_modules=task.targets(base),
        head_modules=task.head_modules,
    )
    return build_vera_model(base, settings)


def build_sorf_vera_text_model(
    config: RunConfig, options: SorfVeraOptions
) -> VeraModel:
    """The task's seeded model with SORF-VeRA layers (rank ``sorf-rank``)."""
    task = text_task(config)
    base = task.build_base()
    settings = SorfVeraSettings(
        rank=options.sorf_rank,
        projection_seed=options.projection_seed,
        d_scale_initial=options.sorf_d_scale_initial,
        target_modules=task.targets(base),
        head_modules=task.head_modules,
    )
    return build_sorf_vera_model(base, settings)
