"""Named exceptions raised by fedlr.

Every error says what was wrong (the key, the shape, the value) so that a user
can fix the input without reading the source.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``"did you mean 'x'? "`` for the choice closest to ``word``, else ``""``.

    ``fedex_lora`` finds ``fedex-lora`` (underscores read as hyphens), other
    typos the closest choice by :func:`difflib.get_close_matches`.
    """
    options = sorted(set(choices))
    hyphenated = word.replace("_", "-").lower()
    if hyphenated in options and hyphenated != word:
        return f"did you mean '{hyphenated}'? "
    close = difflib.get_close_matches(hyphenated, options, n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'? " if close else ""


class FedLRError(Exception):
    """Base class of every fedlr error."""


class ConfigError(FedLRError, ValueError):
    """A run-config value is missing, of the wrong type or out of range.

    Parameters
    ----------
    key : str
        The run-config key (kebab-case, as written in ``pyproject.toml``).
    reason : str
        What is wrong with the value.
    """

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"run-config '{key}': {reason}")


class NodeConfigError(ConfigError):
    """A node-config key is unknown, or its value of the wrong type or out of range.

    The node's own settings (``flower-supernode --node-config``, the
    simulation's nodes' file, ``run_in_process(node_config=...)``) are
    declared in :mod:`fedlr.privacy.node_policy`; an unknown key names the
    closest declared one. Raised by the node before it answers anything, and
    by the launcher before anything starts.

    Parameters
    ----------
    key : str
        The node-config key (kebab-case).
    reason : str
        What is wrong with it.
    """

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(key, reason)
        self.args = (f"node-config '{key}': {reason}",)


class LedgerError(FedLRError, RuntimeError):
    """A node's privacy ledger cannot be read, or holds an impossible entry.

    Raised by :mod:`fedlr.privacy.budget` before the node trains or answers:
    restarting the account at zero, or skipping an entry, would under-report
    what the node's data has spent, so the node answers no more until an
    operator repairs the file. The message names the file and what is wrong.
    """


class ShapeMismatchError(FedLRError, ValueError):
    """Tensors that must agree in shape do not."""


class CheckpointError(FedLRError, ValueError):
    """A checkpoint file is missing, changed since it was written, or unsafe.

    Raised before anything of the file is used: a SHA-256 that differs from
    the manifest's, or content that cannot be read without running code.
    """


class CheckpointLayoutError(CheckpointError):
    """A checkpoint's arrays do not fit the run's layout (keys, shapes, dtypes).

    Raised by ``resume-from`` before round 1, naming the first key that does
    not fit and both its shape and dtype and the run's.
    """


class CheckpointStateError(CheckpointLayoutError):
    """A checkpoint's strategy state holds a key the run's method does not keep.

    Raised by ``resume-from`` before round 1 trains (before the strategy
    loads the state), naming the key, the method and the checkpoint file.
    """


class CheckpointWriteError(FedLRError, OSError):
    """A checkpoint could not be written (no space left, no permission, I/O).

    Nothing partial is left behind and the manifest still names the previous
    checkpoint, which a ``resume-from`` continues from.

    Parameters
    ----------
    message : str
        What failed, how much space was needed and what to do.
    previous_round : int or None
        The round of the newest checkpoint the manifest still names.
    """

    def __init__(self, message: str, *, previous_round: int | None = None) -> None:
        self.previous_round = previous_round
        super().__init__(message)


class UnknownKeyError(FedLRError, KeyError):
    """A tensor key that the adapter layout does not declare."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the sentence.
        return str(self.args[0]) if self.args else ""


class ReplyValidationError(FedLRError, ValueError):
    """A client reply failed validation (keys, shapes, dtype, finiteness, metrics).

    Parameters
    ----------
    node_id : int
        The node whose reply was rejected.
    reason : str
        Why the reply was rejected.
    """

    def __init__(self, node_id: int, reason: str) -> None:
        self.node_id = node_id
        self.reason = reason
        super().__init__(f"reply from node {node_id} rejected: {reason}")


class ProtocolError(FedLRError, ValueError):
    """A message breaks fedlr's wire protocol (:mod:`fedlr.wire.protocol`).

    Raised on either side: a record with the wrong keys, shapes or values, or
    a ConfigRecord value that does not decode. On the server the strategy turns
    it into a :class:`ReplyValidationError` naming the node.
    """


class InstructionError(ProtocolError):
    """A node refuses an instruction: a value or array outside what it accepts.

    Raised before the node changes anything (its model, its ``context.state``)
    by :mod:`fedlr.client.checks`; fedlr's ClientApp answers it with an
    error reply naming the key, and the node serves the next round as before.

    Parameters
    ----------
    key : str
        The ConfigRecord key, or ``'<record>' '<array key>'`` for an array.
    reason : str
        What is wrong with it and what the node accepts.
    """

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"instruction refused: '{key}' {reason}")


class SecAggGuardError(InstructionError):
    """A node refuses a SecAgg+ stage message that would put its secrets at risk.

    Raised by :mod:`fedlr.client_apps.secagg_guard` before Flower's
    ``secaggplus_mod`` sees the message (nothing of the node's state
    changes): an unmask request that names a node both as surviving and as
    dropped or outside the neighbourhood, stage settings out of bounds or
    changed within a round, a ciphertext that does not decrypt.

    Parameters
    ----------
    check : str
        The guard's check that failed (``alive-and-dead``, ``share-num`` ...).
    reason : str
        What the message asked and what the node accepts.
    node : int, optional
        The node the refusal is about (the garbled ciphertext's sender ...).
    """

    def __init__(self, check: str, reason: str, *, node: int | None = None) -> None:
        self.check = check
        self.node = node
        super().__init__(f"secagg-guard:{check}", reason)


class FeatureRecordError(InstructionError):
    """A node refuses an extra record a client feature reads, before training.

    Raised by :func:`fedlr.client.checks.check_records` against the record's
    declaration (:attr:`fedlr.client.features.ClientFeature.receives`): the
    record is absent when the instruction needs it, or one of its arrays is
    missing, unknown, of another shape or dtype, or not finite. Nothing of
    the node's model or state has changed.

    Parameters
    ----------
    record : str
        The record's name (``hilora-tiers``).
    key : str
        The array refused, or the record's name when the record is absent.
    reason : str
        What is wrong and what the node expected.
    """

    def __init__(self, record: str, key: str, reason: str) -> None:
        self.record = record
        super().__init__(key, reason)


class BaseOutOfSyncError(ProtocolError):
    """A node cannot rebuild the base weights a FedEx instruction needs.

    It keeps none (its state was lost), older ones than the changes sent start
    from, or its result fails the server's checksum
    (:func:`fedlr.wire.downlink.receive_base`). The node's reply is an error; the
    server drops it and sends that node the dense base weights next time.
    """


class NoValidRepliesError(FedLRError, RuntimeError):
    """Fewer valid replies arrived than the strategy needs to aggregate.

    Parameters
    ----------
    server_round : int
        The round that could not be aggregated.
    received : int
        Number of valid replies.
    required : int
        Minimum number of valid replies.
    reasons : list of str
        The reasons the other replies were dropped.
    """

    def __init__(
        self, server_round: int, received: int, required: int, reasons: list[str]
    ) -> None:
        self.server_round = server_round
        self.received = received
        self.required = required
        self.reasons = reasons
        detail = "; ".join(reasons) if reasons else "no replies arrived"
        super().__init__(
            f"round {server_round}: {received} valid replies, {required} required "
            f"({detail})"
        )


class ServerUpdateError(FedLRError, RuntimeError):
    """The server's own update of a round failed (:mod:`fedlr.robust.server_update`).

    Its training raised, its reply is not valid, or its loss is not finite;
    the message names the server, never a node. The round runs without it
    (:class:`fedlr.round.protect.OwnUpdate`).

    Parameters
    ----------
    reason : str
        What went wrong.
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"the server's own update failed: {reason}")


class UnknownMethodError(FedLRError, KeyError):
    """The requested aggregation method is not registered."""

    def __init__(self, name: str, known: list[str]) -> None:
        self.name = name
        self.known = known
        super().__init__(
            f"unknown method '{name}'; {did_you_mean(name, known)}"
            f"known methods: {', '.join(known)}"
        )

    def __str__(self) -> str:  # KeyError quotes its argument; keep the sentence.
        return str(self.args[0])


class RankMismatchError(FedLRError, ValueError):
    """Clients replied with LoRA factors of different ranks where one is required.

    Parameters
    ----------
    layer : str
        The adapted layer whose factors disagree.
    shapes : mapping of str to (tuple of int, tuple of int)
        Client name -> shapes of its ``B`` (d_out, r) and ``A`` (r, d_in).
    """

    def __init__(
        self, layer: str, shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
    ) -> None:
        self.layer = layer
        self.shapes = shapes
        detail = ", ".join(
            f"{client}: B {b} A {a}" for client, (b, a) in shapes.items()
        )
        super().__init__(
            f"layer '{layer}': clients replied with different LoRA ranks ({detail}); "
            "this method aggregates factors of one rank"
        )


class DeploymentError(FedLRError, ValueError):
    """A deployment input (certificate host, key name, SuperLink address) is invalid."""


class BaseMismatchError(FedLRError, ValueError):
    """A model's frozen weights differ from those of the strategy's model.

    Plug-in use: every node and the server must build the same model (same
    seed, same checkpoint); the strategy sends a fingerprint of the frozen
    base weights of every adapted layer (and of adapter factors that never
    travel, FFA-LoRA's ``A``), and :func:`fedlr.apply_round` and
    ``strategy.load_into`` refuse a model whose own differ
    (:mod:`fedlr.wire.fingerprint`).
    """


class ProjectionMismatchError(FedLRError, ValueError):
    """A node's shared random projections differ from the server's.

    VeRA-family methods rely on every node building the same frozen ``A``,
    ``B`` (and SORF signs) from the shared projection seed and rank.

    Parameters
    ----------
    expected : (int, int)
        ``(projection-seed, rank)`` the server uses.
    got : (int, int)
        ``(projection-seed, rank)`` the node built.
    """

    def __init__(self, expected: tuple[int, int], got: tuple[int, int]) -> None:
        self.expected = expected
        self.got = got
        super().__init__(
            f"projection mismatch: server uses projection-seed {expected[0]} and "
            f"rank {expected[1]}, this node built projection-seed {got[0]} and "
            f"rank {got[1]}"
        )


class RecordError(FedLRError):
    """A message record, or a value in a ConfigRecord, is missing or mistyped.

    Raised as :class:`RecordMissingError` or :class:`RecordTypeError`.

    Parameters
    ----------
    name : str
        The record name (in a message's ``RecordDict``) or ConfigRecord key.
    reason : str
        What is wrong, naming the record or key and what was found.
    """

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.reason = reason
        super().__init__(reason)

    def __str__(self) -> str:  # KeyError quotes its argument; keep the sentence.
        return self.reason


class RecordMissingError(RecordError, KeyError):
    """A message has no record of that name, or a ConfigRecord no such key."""


class RecordTypeError(RecordError, TypeError):
    """A record is of another kind, or a ConfigRecord value of another type."""


class UnsupportedModelError(FedLRError, TypeError):
    """A model that fedlr's plug-in helpers cannot adapt.

    The helpers (:mod:`fedlr.client.round`, a strategy's ``for_model``,
    ``initial_arrays`` and ``load_into``) take a peft ``PeftModel`` with LoRA
    (``LoraConfig``) or VeRA (``VeraConfig``) on ``nn.Linear`` or
    ``transformers`` ``Conv1D`` (GPT-2) layers, or a
    fedlr :class:`~fedlr.adapters.AdaptedModel` (e.g. SORF-VeRA's
    ``build_sorf_vera_model``). The message says what the model was and what
    was expected.
    """


class PrivacyBudgetError(FedLRError, RuntimeError):
    """A node refuses to train: the round would spend more than ``dp-epsilon``.

    Raised on the client (:mod:`fedlr.privacy.dp_sgd`); its reply is an error
    naming the budget, which the server drops with that reason.
    """


class NodePolicyError(InstructionError):
    """A node refuses an instruction that its own configuration forbids.

    The node's privacy limits (``dp-required``, ``dp-epsilon-budget``,
    ``dp-delta``, ``dp-max-grad-norm``, ``secure-aggregation-required``) are
    set by the node's operator (``--node-config``, or the simulation's node
    config file), never by the server; an instruction may tighten them, never
    loosen them (:mod:`fedlr.privacy.node_policy`). The reason names the key
    and the node's limit; the node's state is unchanged.
    """


class PrivacyUnsupportedError(FedLRError, ValueError):
    """Differential privacy asked of a model or method that cannot have it.

    Sample-level DP-SGD serves LoRA adapters (``nn.Linear`` and GPT-2
    ``Conv1D`` targets); client-level DP serves sum-only methods. The message
    names the option and what to use instead.
    """


class SecureAggregationError(FedLRError, ValueError):
    """Secure aggregation (SecAgg+) asked of a method or round that cannot have it.

    Raised before round 1 for a method whose server reads single clients'
    arrays (not ``sum_only``) or a robust rule; at a round, for fewer than 2
    clients or more than the quantisation range lets the sum hold. The
    message says why and what to change.
    """


class InitialArraysError(FedLRError, ValueError):
    """The global arrays given to a strategy are not the ones it sends.

    Raised by ``configure_train`` before any instruction goes out, so
    ``Strategy.start(initial_arrays=...)`` fails before round 1 instead of
    after the clients trained on the wrong arrays.

    Parameters
    ----------
    strategy : str
        The strategy's class name.
    missing : list of str
        Keys the strategy sends that the arrays lack.
    unexpected : list of str
        Keys of the arrays the strategy does not send.
    shapes : mapping of str to (tuple of int, tuple of int)
        Key -> (shape given, shape expected) where they differ.
    hint : str
        What to pass instead.
    """

    def __init__(
        self,
        strategy: str,
        *,
        missing: list[str],
        unexpected: list[str],
        shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]],
        hint: str,
    ) -> None:
        self.strategy = strategy
        self.missing = missing
        self.unexpected = unexpected
        self.shapes = shapes
        self.hint = hint
        problems = []
        if missing:
            problems.append(f"{len(missing)} missing {missing[:3]}")
        if unexpected:
            problems.append(f"{len(unexpected)} unexpected {unexpected[:3]}")
        if shapes:
            detail = ", ".join(
                f"'{key}' {got} (expected {want})"
                for key, (got, want) in list(shapes.items())[:3]
            )
            problems.append(f"{len(shapes)} with another shape: {detail}")
        super().__init__(
            f"initial arrays do not match {strategy}: {'; '.join(problems)}; {hint}"
        )
