"""Model builders of the VeRA family on the text task.

The data side (held-out split, partitions, encoding) is
:class:`fedlr.tasks.TextTask`'s; this module builds the seeded classifier with
VeRA (through peft) or SORF-VeRA adapters on ``target-modules``. The server and
every client call the same builder, so all nodes hold the same frozen
projections.
"""

from __future__ import annotations

from fedlr.adapters.sorf_vera import SorfVeraSettings, build_sorf_vera_model
from fedlr.adapters.vera import VeraModel, VeraSettings, build_vera_model
from fedlr.config import RunConfig
from fedlr.models import build_text_classifier
from fedlr.tasks import TextTask

__all__ = ["build_sorf_vera_text_model", "build_vera_text_model"]


def build_vera_text_model(config: RunConfig) -> VeraModel:
    """The seeded classifier with peft VeRA (rank ``vera-rank``)."""
    task = TextTask(config)
    base = build_text_classifier(
        config.model, task.num_labels, config.seed, pooling=config.pooling
    )
    settings = VeraSettings(
        rank=config.vera_rank,
        projection_seed=config.projection_seed,
        d_initial=config.vera_d_initial,
        target_modules=config.targets,
    )
    return build_vera_model(base, settings)


def build_sorf_vera_text_model(config: RunConfig) -> VeraModel:
    """The seeded classifier with SORF-VeRA layers (rank ``sorf-rank``)."""
    task = TextTask(config)
    base = build_text_classifier(
        config.model, task.num_labels, config.seed, pooling=config.pooling
    )
    settings = SorfVeraSettings(
        rank=config.sorf_rank,
        projection_seed=config.projection_seed,
        d_scale_initial=config.sorf_d_scale_initial,
        target_modules=config.targets,
    )
    return build_sorf_vera_model(base, settings)
