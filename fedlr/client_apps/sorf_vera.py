"""SORF-VeRA ClientApp payload (kind ``sorf-vera``).

The protocol is VeRA's (:mod:`fedlr.client_apps.vera`) with SORF-VeRA's
roles: the instruction carries ``sorf_b_real``, ``sorf_b_imag`` (frozen on the
node), ``sorf_d_scale``, ``sorf_d_angles`` and the head; the node trains
``d_scale``, ``d_angles`` and the head and sends them back.
"""

from __future__ import annotations

from fedlr.client_apps.text import TextClient
from fedlr.tasks.vera import SorfVeraOptions, build_sorf_vera_text_model

__all__ = ["CLIENT", "evaluate_message", "train_message"]

CLIENT = TextClient(
    build=build_sorf_vera_text_model,
    options=SorfVeraOptions,
    lr=lambda _, options: options.vera_lr,
)
"""The handlers of the ``sorf-vera`` payload kind."""

train_message = CLIENT.train
evaluate_message = CLIENT.evaluate
