"""The server's side of secure aggregation: SecAgg+ stages over the Grid.

Flower 1.41 runs SecAgg+ only inside the legacy ``SecAggPlusWorkflow``
(a ``LegacyContext``, ``configure_fit`` / ``aggregate_fit`` and FitIns
records). fedlr's rounds are Message-API rounds
(:meth:`~fedlr.strategies.base.FedLRStrategy.run_round`), so
:class:`SecAggPlusExchange` drives the same four stages over the same
``Grid`` with the same messages and Flower's own primitives (Shamir
``combine_shares``, ECDH ``generate_shared_key``, ``pseudo_rand_gen`` masks,
``dequantize``), in place of the round's plain send and receive:

0. *setup*: the protocol's parameters to the sampled nodes; their two public
   keys back.
1. *share keys*: each node's neighbours' public keys out; its encrypted
   shares of its mask seed and first secret key back.
2. *collect masked vectors*: the strategy's train instruction plus the shares
   addressed to the node; the masked, quantised summands back (see
   :mod:`fedlr.client_apps.secagg`), with the node's MetricRecord and a
   manifest in plain. A reply that is an error, or whose manifest, masked
   vector or weight is not what the round expects, is dropped with a logged
   reason, and the node is treated as dropped out.
3. *unmask*: the surviving nodes send the shares of their neighbours' mask
   seeds (survivors) and first secret keys (dropouts); the server removes
   every mask and dequantises the sum.

The strategy then aggregates as usual: each surviving node's reply carries
its own plain metrics and, in place of its arrays, the secure means
(:func:`fedlr.privacy.secagg.unflatten_sums`). A sum-only method's
aggregation of ``k`` copies of the means equals its aggregation of the ``k``
clients' arrays (up to the quantisation bound). Dropouts at any stage are
tolerated while every node keeps ``threshold`` live neighbours; otherwise
the round has no replies.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any, cast

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
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
)

from fedlr import protocol
from fedlr.client_apps.secagg import (
    CLIPPING_RANGE,
    FEDLR_RECORD,
    MANIFEST_RECORD,
    WEIGHT_SCALE,
    WEIGHTED_RECORD,
)
from fedlr.errors import ReplyValidationError, SecureAggregationError
from fedlr.flower.records import record_nbytes
from fedlr.privacy.secagg import (
    MODULUS_RANGE,
    SecAggSettings,
    Summand,
    check_eligible,
    mean_error_bound,
    unflatten_sums,
)
from fedlr.strategies.base import FedLRStrategy
from fedlr.strategies.registry import MethodConfig, available_methods, get_method

__all__ = [
    "SECAGG_COLUMNS",
    "SecAggPlusExchange",
    "payload_nbytes",
    "secure_exchange",
]

SECAGG_COLUMNS = ("secagg-bound", "secagg-clipped")
"""``results.csv`` columns of a secure run: the round's error bound per entry
of the weighted mean, and the summand entries the clipping range cut."""

Masked = list[np.ndarray[Any, Any]]


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
class _Round:
    """One round's protocol state (Flower's ``WorkflowState``, by node id)."""

    number: int
    sampled: list[int]
    shares: int
    threshold: int
    neighbours: dict[int, set[int]] = field(default_factory=dict)
    public_keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    key_holders: set[int] = field(default_factory=set)
    forward: dict[int, tuple[list[int], list[bytes]]] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)


def secure_exchange(
    method: MethodConfig, strategy: FedLRStrategy, nodes: int
) -> SecAggPlusExchange | None:
    """The run's SecAgg+ exchange, or ``None`` without ``secure-aggregation``.

    Raises
    ------
    SecureAggregationError
        For a method that is not sum-only, a robust rule or client-level DP
        (both read each client's update), a federation whose rounds sample
        fewer than 2 nodes, or no known weight scale (``max-num-examples``).
    """
    config = method.run
    if not config.secure_aggregation:
        return None
    eligible = [m for m in available_methods() if get_method(m).traits.sum_only]
    check_eligible(
        method.spec.name,
        method.spec.traits.sum_only,
        eligible,
        robust=config.robust,
        max_client_weight=config.max_client_weight,
    )
    if config.privacy.client_dp is not None:
        raise SecureAggregationError(
            "client-level DP clips each client's update on the server, which "
            "secure-aggregation hides: set client-dp-clip=0 (DP-SGD on the "
            "clients composes with it)"
        )
    sampled = max(int(nodes * config.fraction_train), 1)
    settings = config.secagg
    settings.shares_and_threshold(sampled)  # refuses < 2 or too many clients
    if strategy.max_num_examples is None:
        raise SecureAggregationError(
            "secure aggregation needs the largest num-examples a client may "
            "claim (the weight scale): set max-num-examples"
        )
    return SecAggPlusExchange(settings, strategy, seed=config.seed)


class SecAggPlusExchange:
    """A train round's send-and-receive through SecAgg+ (see the module doc).

    Parameters
    ----------
    settings : SecAggSettings
    strategy : FedLRStrategy
        The round's strategy: its reply shapes and extra records (the
        manifest a reply must carry), its ``arrayrecord_key`` (the record
        weighted by examples), its ``max_num_examples`` (the weight scale
        ``s``) and its reply-weight check.
    seed : int
        Seeds the neighbour graph of each round (with the round number).
    """

    def __init__(
        self, settings: SecAggSettings, strategy: FedLRStrategy, *, seed: int
    ) -> None:
        self.settings = settings
        self.strategy = strategy
        self.seed = seed
        self.last_stats: dict[str, float] = {}
        """The last round's ``bytes-up``, ``bytes-down``, ``seconds``,
        ``clients``, ``secagg-bound`` and ``secagg-clipped``."""

    def row(self) -> dict[str, float]:
        """The last round's ``results.csv`` values: the bytes that travelled
        (every stage, keys and shares included), the error bound and the
        clipped entries; the Frobenius gaps are not measurable (they need
        each client's factors)."""
        stats = self.last_stats
        return {
            "bytes-up": stats.get("bytes-up", math.nan),
            "bytes-down": stats.get("bytes-down", math.nan),
            "secagg-bound": stats.get("secagg-bound", math.nan),
            "secagg-clipped": stats.get("secagg-clipped", math.nan),
            "frobenius-gap": math.nan,
            "relative-gap": math.nan,
        }

    # ------------------------------------------------------------ the round
    def __call__(
        self, grid: Grid, messages: Iterable[Message], timeout: float | None
    ) -> list[Message]:
        """Run the four stages for the strategy's train ``messages``.

        Returns
        -------
        list of Message
            One reply per node whose masked vector made it into the sum: its
            plain records and the secure means as its arrays. Empty when the
            protocol could not finish (too few live neighbours).

        Raises
        ------
        SecureAggregationError
            If the round samples fewer than 2 nodes or more than the
            quantisation range lets the sum hold.
        """
        started = time.perf_counter()
        instructions = {int(m.metadata.dst_node_id): m for m in messages}
        sampled = sorted(instructions)
        shares, threshold = self.settings.shares_and_threshold(len(sampled))
        first = next(iter(instructions.values()))
        config = first.content.config_records.get(protocol.CONFIG, ConfigRecord())
        number = int(cast(int, config.get(protocol.SERVER_ROUND, 0)))
        state = _Round(number, sampled, shares, threshold)
        state.stats = {"bytes-up": 0.0, "bytes-down": 0.0}
        self._neighbourhoods(state)
        replies: list[Message] = []
        active = self._setup(grid, state, timeout)
        if self._enough(state, active, "setup"):
            active = self._share_keys(grid, state, active, timeout)
            if self._enough(state, active, "share keys"):
                collected = self._collect(grid, state, instructions, active, timeout)
                if collected is not None:
                    replies = self._unmask(grid, state, collected, timeout)
        state.stats["seconds"] = time.perf_counter() - started
        state.stats["clients"] = float(len(replies))
        self.last_stats = dict(state.stats)
        log(
            INFO,
            "round %d: secure aggregation of %d of %d clients: %.0f bytes up, "
            "%.0f down, %.2f s, bound %.3g per entry, %d entries clipped",
            number,
            len(replies),
            len(sampled),
            state.stats["bytes-up"],
            state.stats["bytes-down"],
            state.stats["seconds"],
            state.stats.get("secagg-bound", float("nan")),
            int(state.stats.get("secagg-clipped", 0)),
        )
        return replies

    def _neighbourhoods(self, state: _Round) -> None:
        """SecAgg+'s ring: each node and its ``shares // 2`` nodes either side."""
        order = list(state.sampled)
        random.Random(self.seed * 1_000_003 + state.number).shuffle(order)
        half = state.shares // 2
        k = len(order)
        state.neighbours = {
            nid: {order[(i + offset) % k] for offset in range(-half, half + 1)}
            for i, nid in enumerate(order)
        }

    def _enough(self, state: _Round, active: set[int], stage: str) -> bool:
        """Every live node still has ``threshold`` live neighbours."""
        short = [
            n for n in active if len(state.neighbours[n] & active) < state.threshold
        ]
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
        state: _Round,
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
        for reply in grid.send_and_receive(out, timeout=timeout):
            node = int(reply.metadata.src_node_id)
            if node not in contents or node in got or node in failed:
                continue
            if reply.has_error():
                failed.add(node)
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
    def _setup(self, grid: Grid, state: _Round, timeout: float | None) -> set[int]:
        settings = self.settings
        setup = ConfigRecord(
            {
                Key.STAGE: Stage.SETUP,
                Key.SAMPLE_NUMBER: len(state.sampled),
                Key.SHARE_NUMBER: state.shares,
                Key.THRESHOLD: state.threshold,
                Key.CLIPPING_RANGE: float(settings.clipping_range),
                Key.TARGET_RANGE: int(settings.quantization_range),
                Key.MOD_RANGE: MODULUS_RANGE,
                Key.MAX_WEIGHT: 1.0,  # fedlr weighs the summands itself
            }
        )
        contents = {
            nid: RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(dict(setup))})
            for nid in state.sampled
        }
        got = self._send(grid, state, contents, timeout, Stage.SETUP)
        for nid, reply in got.items():
            keys = reply.content.config_records[RECORD_KEY_CONFIGS]
            state.public_keys[nid] = (
                cast(bytes, keys[Key.PUBLIC_KEY_1]),
                cast(bytes, keys[Key.PUBLIC_KEY_2]),
            )
        return set(got)

    def _share_keys(
        self, grid: Grid, state: _Round, active: set[int], timeout: float | None
    ) -> set[int]:
        contents: dict[int, RecordDict] = {}
        for nid in sorted(active):
            record = ConfigRecord(
                {
                    str(n): list(state.public_keys[n])
                    for n in sorted(state.neighbours[nid] & active)
                }
            )
            record[Key.STAGE] = Stage.SHARE_KEYS
            contents[nid] = RecordDict({RECORD_KEY_CONFIGS: record})
        got = self._send(grid, state, contents, timeout, Stage.SHARE_KEYS)
        holders = set(got)
        forward: dict[int, tuple[list[int], list[bytes]]] = {
            nid: ([], []) for nid in holders
        }
        for src, reply in sorted(got.items()):
            record = reply.content.config_records[RECORD_KEY_CONFIGS]
            dsts = cast(list[int], record[Key.DESTINATION_LIST])
            texts = cast(list[bytes], record[Key.CIPHERTEXT_LIST])
            for dst, text in zip(dsts, texts, strict=True):
                if dst in forward:
                    forward[dst][0].append(src)
                    forward[dst][1].append(text)
        state.key_holders = holders
        state.forward = forward
        return holders

    def expected_manifest(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(record/key, shape)`` of every summand a reply must carry, in order."""
        strategy = self.strategy
        records: dict[str, Mapping[str, tuple[int, ...]]] = {
            strategy.arrayrecord_key: strategy.reply_shapes(),
            **strategy.reply_records(),
        }
        return [
            (f"{record}/{key}", tuple(records[record][key]))
            for record in sorted(records)
            for key in sorted(records[record])
        ]

    def _collect(
        self,
        grid: Grid,
        state: _Round,
        instructions: Mapping[int, Message],
        active: set[int],
        timeout: float | None,
    ) -> _Collected | None:
        """Stage 2: each active node's masked vector, checked, summed mod the range."""
        scale = self.strategy.max_num_examples
        if scale is None:
            raise SecureAggregationError(
                "secure aggregation needs the largest num-examples a client may "
                "claim (the weight scale): set max-num-examples"
            )
        contents = {
            nid: self._masked_instruction(state, nid, instructions[nid], float(scale))
            for nid in sorted(active)
        }
        got = self._send(grid, state, contents, timeout, Stage.COLLECT_MASKED_VECTORS)
        collected = self._sum_masked(state, got, float(scale))
        if collected is None or not self._enough(
            state, set(collected.replies), Stage.COLLECT_MASKED_VECTORS
        ):
            return None
        state.stats["secagg-clipped"] = float(collected.clipped)
        if collected.clipped:
            log(
                WARNING,
                "round %d: secure aggregation clipped %d entries at +-%g: the mean "
                "is off by more than the quantisation bound; raise "
                "secagg-clipping-range",
                state.number,
                collected.clipped,
                self.settings.clipping_range,
            )
        return collected

    def _masked_instruction(
        self, state: _Round, nid: int, instruction: Message, scale: float
    ) -> RecordDict:
        """Node ``nid``'s stage-2 content: its train instruction, its peers'
        shares, and the weight scale, weighted record and clipping range."""
        content = RecordDict(dict(instruction.content.items()))
        srcs, texts = state.forward[nid]
        content[RECORD_KEY_CONFIGS] = ConfigRecord(
            {
                Key.STAGE: Stage.COLLECT_MASKED_VECTORS,
                Key.CIPHERTEXT_LIST: list(texts),
                Key.SOURCE_LIST: list(srcs),
            }
        )
        content[FEDLR_RECORD] = ConfigRecord(
            {
                WEIGHT_SCALE: scale,
                WEIGHTED_RECORD: self.strategy.arrayrecord_key,
                CLIPPING_RANGE: float(self.settings.clipping_range),
            }
        )
        return content

    def _sum_masked(
        self, state: _Round, got: Mapping[int, Message], scale: float
    ) -> _Collected | None:
        """The checked replies' masked sum (mod the range); a bad reply is
        dropped with its reason. ``None`` when no reply is left."""
        expected = self.expected_manifest()
        manifest: list[Summand] | None = None
        total: Masked | None = None
        kept: dict[int, Message] = {}
        weights: dict[int, float] = {}
        clipped = 0
        for nid, reply in sorted(got.items()):
            try:
                summands, masked, examples, cut = self._check_masked(
                    nid, reply, expected, scale
                )
                if manifest is not None and summands != manifest:
                    raise ReplyValidationError(nid, "its summands' dtypes differ")
            except ReplyValidationError as exc:
                log(WARNING, "round %d: dropped a reply: %s", state.number, exc)
                continue
            except Exception as exc:  # untrusted input: never crash
                log(
                    WARNING,
                    "round %d: dropped a reply: node %d: %s: %s",
                    state.number,
                    nid,
                    type(exc).__name__,
                    exc,
                )
                continue
            manifest = summands
            total = masked if total is None else parameters_addition(total, masked)
            kept[nid] = reply
            weights[nid] = examples / scale
            clipped += cut
        if total is None or manifest is None:
            return None
        masked_sum = parameters_mod(total, MODULUS_RANGE)
        return _Collected(kept, weights, manifest, masked_sum, clipped)

    def _check_masked(
        self,
        nid: int,
        reply: Message,
        expected: list[tuple[str, tuple[int, ...]]],
        scale: float,
    ) -> tuple[list[Summand], Masked, int, int]:
        """A masked-vector reply's manifest, vector, weight and clipped count.

        Raises
        ------
        ReplyValidationError
            If the manifest is not the expected one, the vector's shapes differ
            from it, or the weight is missing, not positive or above ``scale``.
        """
        content = reply.content
        record = content.config_records[MANIFEST_RECORD]
        names = cast(list[str], record["names"])
        ndims = cast(list[int], record["ndims"])
        flat = cast(list[int], record["shapes"])
        dtypes = cast(list[str], record["dtypes"])
        shapes: list[tuple[int, ...]] = []
        at = 0
        for n in ndims:
            shapes.append(tuple(int(d) for d in flat[at : at + n]))
            at += n
        got = list(zip(names, shapes, strict=True))
        if got != expected:
            missing = sorted({n for n, _ in expected} - set(names))
            extra = sorted(set(names) - {n for n, _ in expected})
            raise ReplyValidationError(
                nid,
                f"its summands are not the round's (missing {missing[:3]}, "
                f"unexpected {extra[:3]}, or shapes differ)",
            )
        if any(d not in ("float16", "float32", "float64") for d in dtypes):
            raise ReplyValidationError(nid, f"non-float summands {sorted(set(dtypes))}")
        _, examples = self.strategy.reply_weight(nid, content)
        if examples > scale:
            raise ReplyValidationError(
                nid, f"num-examples {examples} exceeds the weight scale {scale:g}"
            )
        vector = cast(
            list[bytes],
            content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS],
        )
        masked = [bytes_to_ndarray(b) for b in vector]
        want = [(1,), *shapes]
        if [tuple(a.shape) for a in masked] != want or any(
            a.dtype.kind not in "iu" for a in masked
        ):
            raise ReplyValidationError(nid, "its masked vector is not the manifest's")
        summands = []
        for (name, shape), dtype in zip(got, dtypes, strict=True):
            record_name, key = name.split("/", 1)
            summands.append(Summand(record_name, key, shape, dtype))
        return summands, masked, examples, int(cast(int, record["clipped"]))

    def _unmask(
        self,
        grid: Grid,
        state: _Round,
        collected: _Collected,
        timeout: float | None,
    ) -> list[Message]:
        alive = set(collected.replies)
        dead = state.key_holders - alive
        shares = self._ask_shares(grid, state, alive, dead, timeout)
        short = sorted(n for n, s in shares.items() if len(s) < state.threshold)
        if short:
            log(
                WARNING,
                "round %d: secure aggregation cannot unmask: fewer than %d shares "
                "of nodes %s; the round has no replies",
                state.number,
                state.threshold,
                short,
            )
            return []
        vector = _remove_masks(state, collected.masked, shares, alive, dead)
        settings = self.settings
        factor, quantised = factor_extract(vector)
        k = len(alive)
        if int(factor) != k * settings.quantization_range:
            log(
                WARNING,
                "round %d: secure aggregation's weight sum %d is not %d x %d: a "
                "mask was not removed; the round has no replies",
                state.number,
                int(factor),
                k,
                settings.quantization_range,
            )
            return []
        offset = (k - 1) * settings.clipping_range
        sums = [
            a - offset
            for a in dequantize(
                quantised, settings.clipping_range, settings.quantization_range
            )
        ]
        weights = [collected.weights[n] for n in sorted(alive)]
        means = unflatten_sums(
            collected.manifest,
            sums,
            weighted=self.strategy.arrayrecord_key,
            total_weight=float(sum(weights)),
            clients=k,
        )
        state.stats["secagg-bound"] = mean_error_bound(settings, weights)
        return [_with_means(collected.replies[nid], means) for nid in sorted(alive)]

    def _ask_shares(
        self,
        grid: Grid,
        state: _Round,
        alive: set[int],
        dead: set[int],
        timeout: float | None,
    ) -> dict[int, list[bytes]]:
        """Stage 3's exchange: each survivor's shares, by the node they belong to
        (a survivor's private-mask seed, a dropout's key)."""
        contents: dict[int, RecordDict] = {}
        for nid in sorted(alive):
            near = state.neighbours[nid]
            contents[nid] = RecordDict(
                {
                    RECORD_KEY_CONFIGS: ConfigRecord(
                        {
                            Key.STAGE: Stage.UNMASK,
                            Key.ACTIVE_NODE_ID_LIST: sorted(near & alive),
                            Key.DEAD_NODE_ID_LIST: sorted(near & dead),
                        }
                    )
                }
            )
        got = self._send(grid, state, contents, timeout, Stage.UNMASK)
        shares: dict[int, list[bytes]] = {nid: [] for nid in alive | dead}
        for reply in got.values():
            record = reply.content.config_records[RECORD_KEY_CONFIGS]
            owners = cast(list[int], record[Key.NODE_ID_LIST])
            pieces = cast(list[bytes], record[Key.SHARE_LIST])
            for owner, piece in zip(owners, pieces, strict=True):
                if owner in shares:
                    shares[owner].append(piece)
        return shares


def _remove_masks(
    state: _Round,
    masked: Masked,
    shares: Mapping[int, list[bytes]],
    alive: set[int],
    dead: set[int],
) -> Masked:
    """The masked sum without its masks: the survivors' private masks, then the
    survivors' pairwise masks with the dropouts (from the dropouts' keys)."""
    vector = masked
    shapes = [tuple(a.shape) for a in vector]
    for nid in sorted(alive):  # 1. private masks of the survivors
        seed = combine_shares(shares[nid])
        vector = parameters_subtraction(
            vector, pseudo_rand_gen(seed, MODULUS_RANGE, shapes)
        )
    for nid in sorted(dead):  # 2. survivors' pairwise masks with dropouts
        secret = bytes_to_private_key(combine_shares(shares[nid]))
        for other in sorted((state.neighbours[nid] & alive) - {nid}):
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
class _Collected:
    """Stage 2's outcome: kept replies, weights ``n_i / s``, manifest, masked
    sum, and the number of entries the clients clipped."""

    replies: dict[int, Message]
    weights: dict[int, float]
    manifest: list[Summand]
    masked: Masked
    clipped: int = 0


def _with_means(
    reply: Message, means: Mapping[str, Mapping[str, np.ndarray[Any, Any]]]
) -> Message:
    """``reply`` with its secure-aggregation records replaced by the means."""
    content = RecordDict(
        {
            name: record
            for name, record in reply.content.items()
            if name not in (RECORD_KEY_CONFIGS, MANIFEST_RECORD)
            and not isinstance(record, ArrayRecord)
        }
    )
    for name, arrays in means.items():
        content[name] = ArrayRecord(
            {
                key: Array.from_numpy_ndarray(np.ascontiguousarray(value))
                for key, value in arrays.items()
            }
        )
    reply.content = content
    return reply
