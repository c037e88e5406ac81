"""The round's instructions: check the global arrays, the round's values,
each node's instruction.

A strategy's ``configure_train`` checks the global arrays against what the
strategy sends (:func:`check_arrays`), adds the round's values
(:func:`train_config`: ``lr`` decayed, the method's ``round_config``), lets
Flower's ``FedAvg`` sample, then passes the instructions through the
method's one per-node hook (:func:`train_round`: per-node base weights,
personal factors, a control variate...), which begins the round's value
(:class:`~fedlr.round.value.Round`): the arrays sent, to whom, and
``bytes-down``, every ArrayRecord of every message. The evaluate
instructions carry the same round values (:func:`with_round_values`) and go
through the same hook.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from fedlr.adapters.plugin import warn_unsaved_heads
from fedlr.adapters.roles import AdaptedModel, RoleLayout
from fedlr.errors import InitialArraysError
from fedlr.flower.records import record_nbytes
from fedlr.round.contract import RoundStrategy
from fedlr.round.value import Round
from fedlr.wire.fingerprint import (
    BaseFingerprint,
    check_model,
    fingerprint_roles,
    model_fingerprint,
)
from fedlr.wire.protocol import LR, encode_roles

__all__ = [
    "check_arrays",
    "check_bound_model",
    "expected_arrays",
    "fingerprint_model",
    "instruction_config",
    "message_nbytes",
    "train_config",
    "train_round",
    "with_records",
    "with_round_values",
]


def expected_arrays(strategy: RoundStrategy) -> dict[str, tuple[int, ...]] | None:
    """Keys and shapes of the global arrays ``strategy`` sends, if fixed.

    A strategy with a ``layout`` (:class:`~fedlr.adapters.roles.RoleLayout`)
    and ``send_roles`` sends exactly ``layout.shapes(*send_roles)``; others
    (vision FedAvg, FOT, QR-Mix: whatever model the user gives) return
    ``None`` and are not checked.
    """
    layout = getattr(strategy, "layout", None)
    if isinstance(layout, RoleLayout) and strategy.send_roles:
        return layout.shapes(*strategy.send_roles)
    return None


def initial_arrays_hint(strategy: RoundStrategy) -> str:
    """What to pass as ``initial_arrays``, for :class:`InitialArraysError`."""
    roles = encode_roles(strategy.send_roles)
    ways = ["ArrayRecord(adapter_state(model, layout, strategy.send_roles))"]
    if callable(getattr(strategy, "initial_arrays", None)):
        ways.insert(0, "strategy.initial_arrays(model)")
    return (
        f"pass exactly the global arrays of send roles {roles}, e.g. "
        f"{' or '.join(ways)}, not ArrayRecord(model.state_dict())"
    )


def check_arrays(strategy: RoundStrategy, arrays: ArrayRecord) -> None:
    """Check the global arrays' keys and shapes against :func:`expected_arrays`.

    Raises
    ------
    InitialArraysError
        Naming the missing, unexpected and mis-shaped keys and what to pass
        instead.
    """
    expected = expected_arrays(strategy)
    if expected is None:
        return
    got = {key: tuple(int(n) for n in arrays[key].shape) for key in arrays}
    shapes = {
        key: (shape, tuple(expected[key]))
        for key, shape in got.items()
        if key in expected and shape != tuple(expected[key])
    }
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    if missing or unexpected or shapes:
        raise InitialArraysError(
            type(strategy).__name__,
            missing=missing,
            unexpected=unexpected,
            shapes=shapes,
            hint=initial_arrays_hint(strategy),
        )


def instruction_config(strategy: RoundStrategy, server_round: int) -> dict[str, Any]:
    """The method's ``round_config`` plus the base fingerprint (when bound):
    the values every train and evaluate instruction of the round carries."""
    config: dict[str, Any] = strategy.round_config(server_round)
    if strategy.base_fingerprint is not None:
        config = {**config, **strategy.base_fingerprint.config()}
    return config


def with_round_values(
    strategy: RoundStrategy, server_round: int, config: ConfigRecord
) -> ConfigRecord:
    """A copy of ``config`` with :func:`instruction_config`'s values: an
    evaluate instruction's ConfigRecord (so a client rebuilds its adapter
    at the shape of the arrays it is sent)."""
    out = ConfigRecord(dict(config))
    for key, value in instruction_config(strategy, server_round).items():
        out[key] = value
    return out


def train_config(
    strategy: RoundStrategy, server_round: int, config: ConfigRecord
) -> ConfigRecord:
    """The round's train ConfigRecord: ``config`` with ``lr`` decayed for the
    round (``lr * lr_decay ** (t - 1)``), :func:`instruction_config`'s values
    and the clients' DP-SGD settings added."""
    round_config = ConfigRecord(dict(config))
    if LR in round_config:
        lr = float(cast(float, round_config[LR]))
        round_config[LR] = lr * strategy.lr_decay ** (server_round - 1)
    round_config = with_round_values(strategy, server_round, round_config)
    if strategy.privacy.dp_sgd is not None:  # the clients' DP-SGD settings
        for key, value in strategy.privacy.dp_sgd.instruction().items():
            round_config[key] = value
    return round_config


def message_nbytes(message: Message) -> int:
    """Serialised bytes of every ArrayRecord a message carries."""
    return sum(record_nbytes(r) for r in message.content.array_records.values())


def train_round(
    strategy: RoundStrategy,
    server_round: int,
    arrays: ArrayRecord,
    sampled: list[Message],
    population: int,
) -> tuple[list[Message], Round]:
    """The sampled train instructions through the method's per-node hook,
    and the round they begin: the global ``arrays``, the nodes sent an
    instruction (the reply step reports the ones that do not reply as
    dropped), how many (client-level DP's ``m``, whatever replies), the
    ``population`` sampled from and ``bytes-down``, the ArrayRecords of
    every instruction sent."""
    messages = list(strategy.instructions(server_round, sampled, arrays, train=True))
    return messages, Round(
        server_round,
        arrays,
        sent=tuple(int(m.metadata.dst_node_id) for m in messages),
        instructed=len(sampled),
        population=population,
        bytes_down=sum(message_nbytes(m) for m in messages),
        instruction=messages[0] if messages else None,
        rejected_before=strategy.rejected_rounds,
    )


def with_records(message: Message, records: Mapping[str, Any]) -> Message:
    """A copy of an instruction with ``records`` added to (or replacing
    records of) its content."""
    content = RecordDict(dict(message.content.items()))
    for name, record in records.items():
        content[name] = record
    return Message(
        content=content,
        message_type=message.metadata.message_type,
        dst_node_id=int(message.metadata.dst_node_id),
    )


def fingerprint_model(strategy: RoundStrategy, view: AdaptedModel) -> BaseFingerprint:
    """Plug-in use (``for_model``): the strategy's ``base_fingerprint`` of the
    server's model.

    The frozen base weights of every adapted layer and the adapter factors
    that never travel, as built (:mod:`fedlr.wire.fingerprint`), sent with
    every instruction; warns about a task head fedlr would never send
    (:func:`~fedlr.adapters.plugin.warn_unsaved_heads`).
    """
    roles = fingerprint_roles(
        view.layout,
        strategy.send_roles,
        strategy.train_roles,
        getattr(strategy, "keep_roles", ()),
    )
    fingerprint = model_fingerprint(view, roles)
    warn_unsaved_heads(view)
    return fingerprint


def check_bound_model(
    strategy: RoundStrategy, view: AdaptedModel, *, what: str
) -> None:
    """Plug-in use (``initial_arrays``, ``load_into``): ``view`` was built
    like the model ``strategy`` was made for.

    Raises
    ------
    BaseMismatchError
        If its frozen weights differ from the strategy's ``base_fingerprint``.
    """
    check_model(strategy.base_fingerprint, view, what=what)
    warn_unsaved_heads(view)
