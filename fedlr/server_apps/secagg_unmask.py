"""Stage 3 of SecAgg+ (unmasking) and the helpers of the server's stages.

:class:`UnmaskStage` (the base of
:class:`~fedlr.server_apps.secagg.SecAggPlusExchange`) sends a stage's
messages, rebuilds every secret (a garbled share is left out, its holder
logged; a key is checked against its public key), removes every mask and
dequantises the sum. No exception of Flower's primitives reaches the caller.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any, cast

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.app.message_type import MessageType
from flwr.common import bytes_to_ndarray
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import (
    generate_shared_key,
)
from flwr.common.secure_aggregation.ndarrays_arithmetic import (
    factor_extract,
    parameters_addition,
    parameters_mod,
    parameters_subtraction,
)
from flwr.common.secure_aggregation.quantization import dequantize
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    Key,
    Stage,
)
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
from flwr.serverapp import Grid
from flwr.supercore import log
from flwr.supercore.primitives.asymmetric import (
    bytes_to_private_key,
    bytes_to_public_key,
    public_key_to_bytes,
)

from fedlr.client_apps.secagg import CLIPPED, LOSS_EXAMPLES
from fedlr.client_apps.secagg_guard import (
    CONSISTENCY,
    SIGN_RECORD,
    SIGNATURE,
    SIGNATURES,
    SIGNERS,
    SURVIVORS,
)
from fedlr.errors import ReplyValidationError, SecureAggregationError
from fedlr.flower.records import record_nbytes
from fedlr.privacy.secagg import (
    MODULUS_RANGE,
    AggregateCheck,
    SecAggSettings,
    SecureScalars,
    Summand,
    mean_error_bound,
    survivor_statement,
    verify_survivors,
)
from fedlr.strategies.base import FedLRStrategy
from fedlr.wire import protocol

__all__ = [
    "Collected",
    "Masked",
    "RoundState",
    "UnmaskStage",
    "garbled_senders",
    "masked_vector",
    "payload_nbytes",
]

Masked = list[np.ndarray[Any, Any]]
_GARBLED = re.compile(r"secagg-guard:ciphertext\W+the ciphertext from node (\d+)")


def payload_nbytes(content: RecordDict) -> int:
    """Bytes a message's records carry: array data, bytes and strings, 8 per number."""
    total = 0
    for record in content.values():
        if isinstance(record, ArrayRecord):
            total += record_nbytes(record)
            continue
        for value in cast(Mapping[str, Any], record).values():
            items = value if isinstance(value, list) else [value]
            for item in items:
                if isinstance(item, bytes):
                    total += len(item)
                elif isinstance(item, str):
                    total += len(item.encode())
                else:
                    total += 8
    return total


@dataclass
class RoundState:
    """One round's protocol state (Flower's ``WorkflowState``, by node id)."""

    number: int
    sampled: list[int]
    shares: int
    threshold: int
    neighbours: dict[int, set[int]] = field(default_factory=dict)
    public_keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    signing_keys: dict[int, bytes] = field(default_factory=dict)
    """Each node's Ed25519 key of the consistency round (from its setup)."""
    key_holders: set[int] = field(default_factory=set)
    forward: dict[int, tuple[list[int], list[bytes]]] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    """The error replies' reasons of the last stage, by node."""
    failure: str | None = None
    """Why stage 3 could not unmask the sum (the round is then rejected)."""


class UnmaskStage:
    """The exchange's message plumbing and stage 3 (see the module doc)."""

    settings: SecAggSettings
    strategy: FedLRStrategy
    check: AggregateCheck
    _base: dict[str, np.ndarray[Any, Any]]
    _means: Callable[..., dict[str, dict[str, np.ndarray[Any, Any]]]]

    def _enough(self, state: RoundState, active: set[int], stage: str) -> bool:
        """Every live node still has ``threshold`` live neighbours."""
        short = [
            n for n in active if len(state.neighbours[n] & active) < state.threshold
        ]
        if len(active) < state.threshold:
            short = sorted(set(state.sampled) - active)
        if short:
            log(
                WARNING,
                "round %d: secure aggregation stopped after '%s': nodes %s have "
                "fewer than %d live neighbours; the round has no replies",
                state.number,
                stage,
                sorted(short),
                state.threshold,
            )
        return not short

    def _send(
        self,
        grid: Grid,
        state: RoundState,
        contents: Mapping[int, RecordDict],
        timeout: float | None,
        stage: str,
    ) -> dict[int, Message]:
        """Send one message per node; the non-error replies by node id."""
        out = [
            Message(
                content=content,
                dst_node_id=nid,
                message_type=MessageType.TRAIN,
                group_id=str(state.number),
            )
            for nid, content in contents.items()
        ]
        state.stats["bytes-down"] += sum(payload_nbytes(m.content) for m in out)
        got: dict[int, Message] = {}
        failed: set[int] = set()
        state.errors = {}
        for reply in grid.send_and_receive(out, timeout=timeout):
            node = int(reply.metadata.src_node_id)
            if node not in contents or node in got or node in failed:
                continue
            if reply.has_error():
                failed.add(node)
                state.errors[node] = str(reply.error.reason)
                log(
                    WARNING,
                    "round %d: node %d dropped out at secure aggregation stage "
                    "'%s': %s",
                    state.number,
                    node,
                    stage,
                    reply.error.reason,
                )
                continue
            state.stats["bytes-up"] += payload_nbytes(reply.content)
            got[node] = reply
        for node in sorted(set(contents) - set(got) - failed):
            log(
                WARNING,
                "round %d: node %d did not answer secure aggregation stage '%s'",
                state.number,
                node,
                stage,
            )
        return got

    # --------------------------------------------------------------- stages
    def _unmask(
        self,
        grid: Grid,
        state: RoundState,
        collected: Collected,
        timeout: float | None,
    ) -> list[Message]:
        """Stage 3: the secrets, the masks removed, the means and the sums.

        A sum that does not unmask (a weight sum, a scalar summand or a
        ``num-examples`` sum that no honest set of vectors gives: one client's
        tampered or replayed vector, which the sum cannot attribute) rejects
        the round with its reason (:meth:`_rejected`); the run goes on."""
        replies = self._unmasked(grid, state, collected, timeout)
        if replies or state.failure is None:
            return replies
        return self._rejected(collected, state.failure)

    def _rejected(self, collected: Collected, reason: str) -> list[Message]:
        """The kept replies carrying the round's current arrays (zeros where
        none was sent), with the rejection pending in the aggregate check:
        the strategy aggregates them, restores its state and logs the round
        rejected with ``reason``; nothing of the round is published."""
        key = self.strategy.arrayrecord_key
        means: dict[str, dict[str, np.ndarray[Any, Any]]] = {}
        for summand in collected.manifest:
            value = self._base.get(summand.key) if summand.record == key else None
            if value is None or tuple(value.shape) != summand.shape:
                value = np.zeros(summand.shape)
            means.setdefault(summand.record, {})[summand.key] = np.asarray(
                value, dtype=summand.dtype
            )
        self.check.reject(f"secure aggregation cannot unmask the sum: {reason}")
        metrics = MetricRecord({protocol.NUM_EXAMPLES: 1})
        return [
            _with_means(collected.replies[nid], means, MetricRecord(dict(metrics)))
            for nid in sorted(collected.replies)
        ]

    def _unmasked(
        self,
        grid: Grid,
        state: RoundState,
        collected: Collected,
        timeout: float | None,
    ) -> list[Message]:
        """Stage 3's work; ``[]`` with ``state.failure`` when it cannot unmask."""
        alive = set(collected.replies)
        dead = state.key_holders - alive
        signatures = self._consistency(grid, state, alive, timeout)
        if len(signatures) < state.threshold:
            return self._fail(
                state,
                f"{len(signatures)} survivors signed the survivor set (at least "
                f"t = {state.threshold} must, or no node reveals its shares)",
            )
        shares = self._ask_shares(grid, state, alive, dead, timeout, signatures)
        secrets = self._reconstruct(state, shares, alive, dead)
        if secrets is None:
            return []
        vector = _remove_masks(state, collected.masked, secrets, alive, dead)
        try:
            sums, totals, weight = self._sums(vector, collected.scalars, len(alive))
        except SecureAggregationError as exc:
            return self._fail(state, str(exc))
        return self._mean_replies(state, collected, sums, totals, weight)

    def _sums(
        self, vector: Masked, scalars: SecureScalars, k: int
    ) -> tuple[list[np.ndarray[Any, Any]], dict[str, int], float]:
        """The unmasked ``vector`` of ``k`` summands dequantised: the sums of
        the arrays, the secure scalars' totals, and the round's weight (the
        ``num-examples`` sum over the weight scale; ``k`` under DP).

        Raises
        ------
        SecureAggregationError
            If the weight sum is not ``k`` times the quantisation range, the
            scalars do not decode, or the ``num-examples`` sum is outside the
            range ``k`` honest weights give.
        """
        settings = self.settings
        factor, quantised = factor_extract(vector)
        if int(factor) != k * settings.quantization_range:
            raise SecureAggregationError(
                f"the weight sum {int(factor)} is not {k} x "
                f"{settings.quantization_range}: a mask was not removed or a "
                "masked vector was tampered with"
            )
        offset = (k - 1) * settings.clipping_range
        sums = [
            a - offset
            for a in dequantize(
                quantised, settings.clipping_range, settings.quantization_range
            )
        ]
        totals = scalars.decode(sums[-1])
        scale = float(cast(int, self.strategy.max_num_examples))
        examples = totals.get(protocol.NUM_EXAMPLES, k * scale)  # DP: not sent
        if not k <= examples <= k * scale:
            raise SecureAggregationError(
                f"the secure sum of num-examples {examples} is outside [{k}, "
                f"{k} x {scale:g}]: a client claimed a weight outside (0, "
                f"{scale:g}] (the sum cannot tell which)"
            )
        return sums[:-1], totals, examples / scale

    def _mean_replies(
        self,
        state: RoundState,
        collected: Collected,
        sums: list[np.ndarray[Any, Any]],
        totals: Mapping[str, int],
        weight: float,
    ) -> list[Message]:
        """Each survivor's reply carrying the secure means and its share of
        the round's scalars; the round's error bound and clipped entries."""
        k = len(collected.replies)
        means = self._means(state, collected.manifest, sums, weight, k)
        weighted = means.get(self.strategy.arrayrecord_key, {}).values()
        state.stats.setdefault(
            "secagg-bound", mean_error_bound(self.settings, [weight / k] * k, weighted)
        )
        state.stats["secagg-clipped"] = float(totals[CLIPPED])
        if totals[CLIPPED]:
            log(
                WARNING,
                "round %d: secure aggregation clipped %d entries at +-%g: the mean "
                "is off by more than the quantisation bound; raise "
                "secagg-clipping-range",
                state.number,
                totals[CLIPPED],
                self.settings.clipping_range,
            )
        metrics = collected.scalars.means(totals)
        metrics.setdefault(protocol.NUM_EXAMPLES, float(k))  # DP: a weight of 1
        metrics.update({m: v for m, v in state.stats.items() if "client-dp" in m})
        return [
            _with_means(collected.replies[nid], means, _metrics_share(metrics, i, k))
            for i, nid in enumerate(sorted(collected.replies))
        ]

    def _fail(self, state: RoundState, reason: str) -> list[Message]:
        log(
            WARNING,
            "round %d: secure aggregation cannot unmask: %s; the round is rejected",
            state.number,
            reason,
        )
        state.failure = reason
        return []

    def _reconstruct(
        self,
        state: RoundState,
        shares: Mapping[int, Mapping[int, bytes]],
        alive: set[int],
        dead: set[int],
    ) -> dict[int, bytes] | None:
        """Every secret the unmasking needs (survivors' mask seeds, the keys of
        dropouts some survivor masked with); a garbled share is left out with
        its holder named. ``None`` (logged) when one cannot be rebuilt."""
        secrets: dict[int, bytes] = {}
        failed: list[int] = []
        for owner in sorted(alive | dead):
            if owner in dead and not any(
                owner in state.forward.get(o, ([], []))[0] for o in alive
            ):
                continue  # no survivor masked with it

            def check(secret: bytes, owner: int = owner) -> bool:
                if owner in alive:
                    return len(secret) == 32
                public = bytes_to_private_key(secret).public_key()
                return public_key_to_bytes(public) == state.public_keys[owner][0]

            secret, garbling = _combine(shares.get(owner, {}), state.threshold, check)
            for holder in garbling:
                log(
                    WARNING,
                    "round %d: node %d sent a garbled share of node %d's %s: left out",
                    state.number,
                    holder,
                    owner,
                    "mask seed" if owner in alive else "key",
                )
            if secret is None:
                failed.append(owner)
            else:
                secrets[owner] = secret
        if failed:
            self._fail(
                state,
                f"the shares of nodes {failed} do not rebuild their secrets "
                f"(fewer than {state.threshold} shares, or garbled ones)",
            )
            return None
        return secrets

    def _consistency(
        self, grid: Grid, state: RoundState, alive: set[int], timeout: float | None
    ) -> dict[int, bytes]:
        """The consistency round: every survivor signs the survivor set ``U3``;
        the valid signatures by signer (an invalid one is left out, its node
        named)."""
        contents = {
            nid: RecordDict(
                {
                    RECORD_KEY_CONFIGS: ConfigRecord({Key.STAGE: CONSISTENCY}),
                    SIGN_RECORD: ConfigRecord({SURVIVORS: sorted(alive)}),
                }
            )
            for nid in sorted(alive)
        }
        got = self._send(grid, state, contents, timeout, CONSISTENCY)
        out: dict[int, bytes] = {}
        for nid, reply in sorted(got.items()):
            signature = reply.content.config_records.get(
                SIGN_RECORD, ConfigRecord()
            ).get(SIGNATURE)
            statement = survivor_statement(
                reply.metadata.run_id, str(state.number), alive
            )
            key = state.signing_keys.get(nid, b"")
            if isinstance(signature, bytes) and verify_survivors(
                key, statement, signature
            ):
                out[nid] = signature
            else:
                log(
                    WARNING,
                    "round %d: node %d's signature of the survivor set does not "
                    "verify: left out",
                    state.number,
                    nid,
                )
        return out

    def _ask_shares(
        self,
        grid: Grid,
        state: RoundState,
        alive: set[int],
        dead: set[int],
        timeout: float | None,
        signatures: Mapping[int, bytes],
    ) -> dict[int, dict[int, bytes]]:
        """Stage 3's exchange: each signer's shares, by the node they belong to
        and their holder (a survivor's private-mask seed, a dropout's key),
        asked only of nodes that hold them, with the signatures of the
        survivor set by the node's neighbours."""
        contents: dict[int, RecordDict] = {}
        for nid in sorted(signatures):
            held = set(state.forward.get(nid, ([], []))[0]) | {nid}
            signers = sorted(held & set(signatures))
            contents[nid] = RecordDict(
                {
                    RECORD_KEY_CONFIGS: ConfigRecord(
                        {
                            Key.STAGE: Stage.UNMASK,
                            Key.ACTIVE_NODE_ID_LIST: sorted(held & alive),
                            Key.DEAD_NODE_ID_LIST: sorted(held & dead),
                        }
                    ),
                    SIGN_RECORD: ConfigRecord(
                        {
                            SURVIVORS: sorted(alive),
                            SIGNERS: signers,
                            SIGNATURES: [signatures[n] for n in signers],
                        }
                    ),
                }
            )
        got = self._send(grid, state, contents, timeout, Stage.UNMASK)
        shares: dict[int, dict[int, bytes]] = {nid: {} for nid in alive | dead}
        for holder, reply in got.items():
            record = reply.content.config_records.get(
                RECORD_KEY_CONFIGS, ConfigRecord()
            )
            owners = record.get(Key.NODE_ID_LIST, [])
            pieces = record.get(Key.SHARE_LIST, [])
            if not isinstance(owners, list) or not isinstance(pieces, list):
                continue
            for owner, piece in zip(owners, pieces, strict=False):
                if owner in shares and isinstance(piece, bytes):
                    shares[owner][holder] = piece
        return shares


def _combine(
    pieces: Mapping[int, bytes], threshold: int, check: Callable[[bytes], bool]
) -> tuple[bytes | None, list[int]]:
    """A secret from its shares by holder, and the holder of a garbled share.

    All shares first; if they do not combine to a secret that passes
    ``check`` (Shamir's padding, the key's public key), each holder's share
    is left out in turn: the one whose absence gives a good secret is named.
    """

    def attempt(items: list[bytes]) -> bytes | None:
        try:
            secret = combine_shares(items)
            return secret if check(secret) else None
        except Exception:  # garbled shares raise many kinds of error
            return None

    if len(pieces) < threshold:
        return None, []
    secret = attempt(list(pieces.values()))
    if secret is not None:
        return secret, []
    if len(pieces) > threshold:
        for holder in sorted(pieces):
            secret = attempt([p for h, p in pieces.items() if h != holder])
            if secret is not None:
                return secret, [holder]
    return None, []


def garbled_senders(errors: Mapping[int, str]) -> dict[int, list[int]]:
    """Senders of ciphertexts that nodes' guards could not decrypt, with the
    nodes that said so."""
    out: dict[int, list[int]] = {}
    for node, reason in sorted(errors.items()):
        found = _GARBLED.search(reason)
        if found:
            out.setdefault(int(found.group(1)), []).append(node)
    return out


def masked_vector(nid: int, reply: Message, want: list[tuple[int, ...]]) -> Masked:
    """A reply's masked vector, checked against the round's shapes.

    Raises
    ------
    ReplyValidationError
        Naming the node, if the vector is missing, does not decode, or is not
        the round's shapes of integers.
    """
    record = reply.content.config_records.get(RECORD_KEY_CONFIGS)
    vector = record.get(Key.MASKED_PARAMETERS) if record is not None else None
    if not isinstance(vector, list) or not all(isinstance(b, bytes) for b in vector):
        raise ReplyValidationError(nid, "no masked vector in its reply")
    try:
        masked = [bytes_to_ndarray(cast(bytes, b)) for b in vector]
    except Exception as exc:  # untrusted bytes: never crash
        raise ReplyValidationError(
            nid, f"its masked vector does not decode: {type(exc).__name__}"
        ) from None
    if [tuple(a.shape) for a in masked] != want or any(
        a.dtype.kind not in "iu" for a in masked
    ):
        raise ReplyValidationError(nid, "its masked vector is not the round's shapes")
    return masked


def _remove_masks(
    state: RoundState,
    masked: Masked,
    secrets: Mapping[int, bytes],
    alive: set[int],
    dead: set[int],
) -> Masked:
    """The masked sum without its masks: the survivors' private masks, then the
    survivors' pairwise masks with the dropouts they masked with (those whose
    shares the server forwarded to them, from the dropouts' keys)."""
    vector = masked
    shapes = [tuple(a.shape) for a in vector]
    for nid in sorted(alive):  # 1. private masks of the survivors
        vector = parameters_subtraction(
            vector, pseudo_rand_gen(secrets[nid], MODULUS_RANGE, shapes)
        )
    for nid in sorted(dead & set(secrets)):  # 2. pairwise masks with dropouts
        secret = bytes_to_private_key(secrets[nid])
        for other in sorted(o for o in alive if nid in state.forward[o][0]):
            key = generate_shared_key(
                secret, bytes_to_public_key(state.public_keys[other][0])
            )
            mask = pseudo_rand_gen(key, MODULUS_RANGE, shapes)
            if nid > other:
                vector = parameters_addition(vector, mask)
            else:
                vector = parameters_subtraction(vector, mask)
    return parameters_mod(vector, MODULUS_RANGE)


@dataclass
class Collected:
    """Stage 2's outcome: kept replies, the round's summands, the masked sum
    and the secure scalars."""

    replies: dict[int, Message]
    manifest: list[Summand]
    masked: Masked
    scalars: SecureScalars


def _metrics_share(metrics: Mapping[str, float], i: int, k: int) -> MetricRecord:
    """Reply ``i`` of ``k``'s metrics: its share of the counts (they sum to the
    round's), the weighted means as they are."""
    out: dict[str, int | float | list[int] | list[float]] = {}
    for key in (protocol.NUM_EXAMPLES, protocol.GPSE_EXAMPLES):
        if key in metrics:
            total = int(metrics[key])
            out[key] = total // k + (1 if i < total % k else 0)
    for key, value in metrics.items():
        if (
            key not in out
            and key not in (CLIPPED, LOSS_EXAMPLES)
            and math.isfinite(value)
        ):
            out[key] = float(value)
    return MetricRecord(out)


def _with_means(
    reply: Message,
    means: Mapping[str, Mapping[str, np.ndarray[Any, Any]]],
    metrics: MetricRecord,
) -> Message:
    """``reply`` with the round's means as its arrays and ``metrics``."""
    content = RecordDict({"metrics": metrics})
    for name, arrays in means.items():
        content[name] = ArrayRecord(
            {
                key: Array.from_numpy_ndarray(np.ascontiguousarray(value))
                for key, value in arrays.items()
            }
        )
    reply.content = content
    return reply
