"""SORF-VeRA ClientApp payload (client kind ``sorf-vera``).

The protocol is the VeRA one (:mod:`fedlr.client_apps.vera`) with SORF-VeRA's roles:
the instruction carries ``sorf_b_real``, ``sorf_b_imag`` (frozen here),
``sorf_d_scale``, ``sorf_d_angles`` and the head; the node trains ``d_scale``,
``d_angles`` and the head and sends them back.
"""

from __future__ import annotations

from fedlr.adapters import Role
from fedlr.client_apps.vera import Handler, make_handlers
from fedlr.vera_tasks import SorfVeraOptions, build_sorf_vera_text_model

__all__ = ["evaluate_message", "train_message"]

_SORF = make_handlers(
    build_sorf_vera_text_model,
    SorfVeraOptions,
    (Role.SORF_D_SCALE, Role.SORF_D_ANGLES, Role.HEAD),
)
train_message: Handler = _SORF.train
evaluate_message: Handler = _SORF.evaluate
