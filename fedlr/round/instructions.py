"""The round's instructions: check the global arrays, sample, build per node.

:func:`train_instructions` is the whole of a strategy's ``configure_train``:
the global arrays checked against what the strategy sends
(:func:`check_arrays`), remembered with the round's values
(:func:`prepare_round`: ``lr`` decayed, the method's ``round_config``),
Flower's sampling (``FedAvg.configure_train``), then the method's one
per-node hook (``strategy.instructions``: per-node base weights, personal
factors, a control variate...). The round's ``bytes-down`` is what the
instructions carry: every ArrayRecord of every message. The evaluate
instructions (:func:`evaluate_instructions`) carry the same round values and
go through the same hook.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedlr.adapters.plugin import warn_unsaved_heads
from fedlr.adapters.roles import AdaptedModel, RoleLayout
from fedlr.errors import InitialArraysError
from fedlr.flower.records import record_nbytes
from fedlr.wire.fingerprint import check_model, fingerprint_roles, model_fingerprint
from fedlr.wire.protocol import LR, encode_roles

__all__ = [
    "bind_model",
    "check_arrays",
    "check_bound_model",
    "evaluate_instructions",
    "expected_arrays",
    "instruction_config",
    "message_nbytes",
    "note_sent",
    "prepare_round",
    "train_instructions",
    "with_records",
]


def expected_arrays(strategy: Any) -> dict[str, tuple[int, ...]] | None:
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


def initial_arrays_hint(strategy: Any) -> str:
    """What to pass as ``initial_arrays``, for :class:`InitialArraysError`."""
    roles = encode_roles(strategy.send_roles)
    ways = ["ArrayRecord(adapter_state(model, layout, strategy.send_roles))"]
    if callable(getattr(strategy, "initial_arrays", None)):
        ways.insert(0, "strategy.initial_arrays(model)")
    return (
        f"pass exactly the global arrays of send roles {roles}, e.g. "
        f"{' or '.join(ways)}, not ArrayRecord(model.state_dict())"
    )


def check_arrays(strategy: Any, arrays: ArrayRecord) -> None:
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


def instruction_config(strategy: Any, server_round: int) -> dict[str, Any]:
    """The method's ``round_config`` plus the base fingerprint (when bound):
    the values every train and evaluate instruction of the round carries."""
    config: dict[str, Any] = strategy.round_config(server_round)
    if strategy.base_fingerprint is not None:
        config = {**config, **strategy.base_fingerprint.config()}
    return config


def prepare_round(
    strategy: Any, server_round: int, arrays: ArrayRecord, config: ConfigRecord
) -> ConfigRecord:
    """Remember the round's global arrays; return the round's ConfigRecord.

    The ConfigRecord is ``config`` with ``lr`` decayed for the round
    (``lr * lr_decay ** (t - 1)``), :func:`instruction_config`'s values
    and the clients' DP-SGD settings added. :func:`train_instructions`
    calls it; so does the legacy-API
    adapter (:mod:`fedlr.strategies.legacy`), whose server reports lost
    replies as failures itself: the nodes sent to are forgotten here and only
    :func:`train_instructions` records them.
    """
    strategy._current = arrays
    strategy._sent = strategy.instructed = None
    round_config = ConfigRecord(dict(config))
    if LR in round_config:
        lr = float(cast(float, round_config[LR]))
        round_config[LR] = lr * strategy.lr_decay ** (server_round - 1)
    for key, value in instruction_config(strategy, server_round).items():
        round_config[key] = value
    if strategy.privacy.dp_sgd is not None:  # the clients' DP-SGD settings
        for key, value in strategy.privacy.dp_sgd.instruction().items():
            round_config[key] = value
    return round_config


def note_sent(strategy: Any, arrays: ArrayRecord, count: int) -> None:
    """Count the round's downlink as ``count`` copies of ``arrays`` and
    remember how many nodes were sent an instruction (``instructed``,
    client-level DP's denominator ``m``, kept whatever the replies)."""
    strategy._bytes_down = record_nbytes(arrays) * count
    strategy.instructed = int(count)


def message_nbytes(message: Message) -> int:
    """Serialised bytes of every ArrayRecord a message carries."""
    return sum(record_nbytes(r) for r in message.content.array_records.values())


def train_instructions(
    strategy: Any,
    server_round: int,
    arrays: ArrayRecord,
    config: ConfigRecord,
    grid: Grid,
) -> list[Message]:
    """A strategy's ``configure_train``: check, remember, sample, build per node.

    The sampled node ids are remembered: the reply step reports the ones
    that do not reply as dropped. ``bytes-down`` is the ArrayRecords of
    every instruction sent.

    Raises
    ------
    InitialArraysError
        If ``arrays`` are not the ones the strategy sends, before any
        instruction goes out.
    """
    check_arrays(strategy, arrays)
    round_config = prepare_round(strategy, server_round, arrays, config)
    strategy.nodes_sampled_from = len(list(grid.get_node_ids()))
    messages = list(
        FedAvg.configure_train(strategy, server_round, arrays, round_config, grid)
    )
    strategy.instructed = len(messages)  # client-level DP's m, whatever replies
    messages = list(strategy.instructions(server_round, messages, arrays, train=True))
    strategy._bytes_down = sum(message_nbytes(m) for m in messages)
    strategy._sent = [int(m.metadata.dst_node_id) for m in messages]
    strategy.server_instruction = messages[0] if messages else None
    return messages


def evaluate_instructions(
    strategy: Any,
    server_round: int,
    arrays: ArrayRecord,
    config: ConfigRecord,
    grid: Grid,
) -> list[Message]:
    """A strategy's ``configure_evaluate``: FedAvg's evaluate instructions
    with the round's values (:func:`instruction_config`, so a client rebuilds
    its adapter at the shape of ``arrays``), through the method's per-node
    hook. Nothing is sent when ``fraction_evaluate`` is 0."""
    eval_config = ConfigRecord(dict(config))
    for key, value in instruction_config(strategy, server_round).items():
        eval_config[key] = value
    messages = list(
        FedAvg.configure_evaluate(strategy, server_round, arrays, eval_config, grid)
    )
    if not messages:
        return messages
    return list(strategy.instructions(server_round, messages, arrays, train=False))


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


def bind_model(strategy: Any, view: AdaptedModel) -> None:
    """Plug-in use (``for_model``): fingerprint the server's model.

    Sets ``strategy.base_fingerprint``, the frozen base weights of every
    adapted layer and the adapter factors that never travel, as built
    (:mod:`fedlr.wire.fingerprint`), sent with every instruction, and warns about
    a task head fedlr would never send
    (:func:`~fedlr.adapters.plugin.warn_unsaved_heads`).
    """
    roles = fingerprint_roles(
        view.layout,
        strategy.send_roles,
        strategy.train_roles,
        getattr(strategy, "keep_roles", ()),
    )
    strategy.base_fingerprint = model_fingerprint(view, roles)
    warn_unsaved_heads(view)


def check_bound_model(strategy: Any, view: AdaptedModel, *, what: str) -> None:
    """Plug-in use (``initial_arrays``, ``load_into``): ``view`` was built
    like the model ``strategy`` was made for.

    Raises
    ------
    BaseMismatchError
        If its frozen weights differ from the strategy's ``base_fingerprint``.
    """
    check_model(strategy.base_fingerprint, view, what=what)
    warn_unsaved_heads(view)
