"""VeRA ClientApp payload (kind ``vera``): the text client with peft VeRA.

The round is :class:`~fedlr.client_apps.text.TextClient`'s. The instruction
carries ``vera_lambda_b``, ``vera_lambda_d``, the head (and, for VeRA-FedEx,
the base weights) and ``projection-seed`` / ``projection-rank``: a node
whose frozen projections were built from another seed or rank replies with
an error (:class:`~fedlr.errors.ProjectionMismatchError`) and the server
drops it. The reply echoes both in its MetricRecord. Clients train with
``vera-lr`` unless the round's ConfigRecord carries ``lr``.
"""

from __future__ import annotations

from fedlr.client_apps.text import TextClient
from fedlr.tasks.vera import VeraOptions, build_vera_text_model

__all__ = ["CLIENT", "evaluate_message", "train_message"]

CLIENT = TextClient(
    build=build_vera_text_model,
    options=VeraOptions,
    lr=lambda _, options: options.vera_lr,
)
"""The handlers of the ``vera`` payload kind."""

train_message = CLIENT.train
evaluate_message = CLIENT.evaluate
