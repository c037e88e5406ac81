"""The server's side of secure aggregation: SecAgg+ stages over the Grid.

Flower 1.41 runs SecAgg+ only inside the legacy ``SecAggPlusWorkflow``
(a ``LegacyContext``, ``configure_fit`` / ``aggregate_fit`` and FitIns
records). fedlr's rounds are Message-API rounds
(:func:`~fedlr.round.pipeline.run_round`), so
:class:`SecAggPlusExchange` drives the same four stages over the same
``Grid`` with the same messages and Flower's own primitives (Shamir
``combine_shares``, ECDH ``generate_shared_key``, ``pseudo_rand_gen`` masks,
``dequantize``), in place of the round's plain send and receive:

0. *setup*: the protocol's parameters to the sampled nodes; their two public
   keys and their signing key back.
1. *share keys*: each node's neighbours' public keys out; its encrypted
   shares of its mask seed and first secret key back.
2. *collect masked vectors*: the strategy's train instruction plus the shares
   addressed to the node; the masked, quantised summands back (see
   :mod:`fedlr.client_apps.secagg`), the node's metrics among them
   (:class:`~fedlr.privacy.secagg.SecureScalars`): nothing in plain. A reply
   that is an error, or whose masked vector is not the shapes the round
   expects (derived from the strategy's declared shapes), is dropped with a
   logged reason naming the node, and the node is treated as dropped out;
   an error naming a ciphertext that does not decrypt names its sender.
2b. *consistency* (fedlr's, Bonawitz et al. 2017's ConsistencyCheck): each
   survivor signs the survivor set with the Ed25519 key it advertised at
   setup (forwarded to its neighbours with their other keys); a signature
   that does not verify is left out, its node named.
3. *unmask*: the survivor set and the neighbours' signatures out, the
   signers' shares back (a node reveals only for the set it signed, with
   ``t`` valid signatures: :mod:`fedlr.client_apps.secagg_guard`), the
   masks removed, the sum dequantised (:mod:`fedlr.server_apps.secagg_unmask`).

The strategy then aggregates as usual: each surviving node's reply carries
the secure means (:func:`fedlr.privacy.secagg.unflatten_sums`) and its share
of the round's sums. Dropouts at any stage are tolerated while every node
keeps ``threshold`` live neighbours; otherwise the round has no replies.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterable, Mapping
from logging import INFO, WARNING
from typing import Any, cast

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.secure_aggregation.ndarrays_arithmetic import (
    parameters_addition,
    parameters_mod,
)
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    Key,
    Stage,
)
from flwr.serverapp import Grid
from flwr.supercore import log

from fedlr.client_apps.secagg import (
    CLIPPED,
    CLIPPING_RANGE,
    DP_RELEASED,
    DP_THRESHOLD,
    FEDLR_RECORD,
    LOSS_EXAMPLES,
    SCALAR_BASE,
    SCALAR_KEYS,
    SCALAR_WEIGHTS,
    WEIGHT_SCALE,
    WEIGHTED_RECORD,
)
from fedlr.client_apps.secagg_guard import SIGN_RECORD, SIGNING_KEY
from fedlr.errors import ReplyValidationError, SecureAggregationError
from fedlr.privacy import distributed_dp as ddp
from fedlr.privacy.client_dp import CLIENT_DP_EPSILON
from fedlr.privacy.secagg import (
    MODULUS_RANGE,
    AggregateCheck,
    SecAggSettings,
    SecureScalars,
    Summand,
    unflatten_sums,
)
from fedlr.privacy.settings import ClientDpSettings
from fedlr.server_apps.secagg_checks import check_secure_config
from fedlr.server_apps.secagg_unmask import (
    Collected,
    Masked,
    RoundState,
    UnmaskStage,
    garbled_senders,
    masked_vector,
    payload_nbytes,
)
from fedlr.strategies.base import FedLRStrategy
from fedlr.strategies.registry import MethodConfig
from fedlr.wire import protocol

__all__ = [
    "SECAGG_COLUMNS",
    "SecAggPlusExchange",
    "payload_nbytes",
    "secure_exchange",
]

SECAGG_COLUMNS = ("secagg-bound", "secagg-clipped", "secagg-check")
"""``results.csv`` columns of a secure run: the round's error bound per entry
of the weighted mean, the summand entries the clipping range cut, and the
aggregate check's ratio (the round's update norm over its reference: the
recent rounds' median, or the global norm; NaN without the check)."""


def secure_exchange(
    method: MethodConfig, strategy: FedLRStrategy, nodes: int
) -> SecAggPlusExchange | None:
    """The run's SecAgg+ exchange, or ``None`` without ``secure-aggregation``.

    Raises
    ------
    SecureAggregationError
        For a method that is not sum-only, a robust rule (it reads each
        client's update), a federation whose rounds sample fewer than 2
        nodes, no known weight scale (``max-num-examples``), or, under
        client-level DP, a strategy that noises too (not built with
        ``client_dp_on_nodes``).
    PrivacyUnsupportedError, ConfigError
        Client-level DP (distributed then: the nodes clip and add noise,
        :mod:`fedlr.privacy.distributed_dp`) with extra reply records or a
        ``secagg-clipping-range`` without room for the noise.
    """
    config = method.run
    if not config.secure_aggregation:
        return None
    sampled = max(int(nodes * config.fraction_train), 1)
    settings = config.secagg
    threshold = check_secure_config(method, sampled)
    dp = config.privacy.client_dp
    if dp is not None:  # distributed client DP: the server must not noise again
        ddp.check_secure(
            dp, settings.clipping_range, threshold, strategy.replies.records()
        )
        if strategy.privacy.client_dp is not None:
            raise SecureAggregationError(
                "client-level DP under SecAgg+ is distributed: the nodes clip and "
                "noise, so the strategy must not noise again (build it with "
                "client_dp_on_nodes=True)"
            )
    return SecAggPlusExchange(settings, strategy, seed=config.seed, dp=dp)


class SecAggPlusExchange(UnmaskStage):
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
    dp : ClientDpSettings, optional
        Distributed client-level DP (:mod:`fedlr.privacy.distributed_dp`):
        the nodes clip their updates and add Skellam noise; the exchange
        publishes ``x + S / m`` and accounts in the strategy's ledger.
    """

    def __init__(
        self,
        settings: SecAggSettings,
        strategy: FedLRStrategy,
        *,
        seed: int,
        dp: ClientDpSettings | None = None,
    ) -> None:
        self.settings = settings
        self.strategy = strategy
        self.seed = seed
        self.dp = dp
        self.check: AggregateCheck = AggregateCheck(
            settings.check_ratio, settings.check_first_ratio
        )
        """The aggregate check the strategy's round runs (ratios 0: off); it
        also carries the rejection of a sum that does not unmask."""
        setattr(strategy, "aggregate_check", self.check)  # noqa: B010
        self._base: dict[str, np.ndarray[Any, Any]] = {}
        self.last_stats: dict[str, float] = {}
        """The last round's ``bytes-up``, ``bytes-down``, ``seconds``,
        ``clients``, ``secagg-bound`` and ``secagg-clipped``."""

    def row(self) -> dict[str, float]:
        """The last round's ``results.csv`` values (every stage's bytes); the
        Frobenius gaps are not measurable (they need each client's factors)."""
        keys = ["bytes-up", "bytes-down", *SECAGG_COLUMNS]
        keys += [CLIENT_DP_EPSILON] if self.dp is not None else []
        row = {key: self.last_stats.get(key, math.nan) for key in keys}
        row["secagg-check"] = self.check.last_ratio
        return {**row, "frobenius-gap": math.nan, "relative-gap": math.nan}

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
        self.check.pending = None
        instructions = {int(m.metadata.dst_node_id): m for m in messages}
        sampled = sorted(instructions)
        shares, threshold = self.settings.shares_and_threshold(len(sampled))
        first = next(iter(instructions.values()))
        config = first.content.config_records.get(protocol.CONFIG, ConfigRecord())
        number = int(cast(int, config.get(protocol.SERVER_ROUND, 0)))
        state = RoundState(number, sampled, shares, threshold)
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

    def _neighbourhoods(self, state: RoundState) -> None:
        """SecAgg+'s ring: each node and its ``shares // 2`` nodes either side."""
        order = list(state.sampled)
        random.Random(self.seed * 1_000_003 + state.number).shuffle(order)
        half = state.shares // 2
        k = len(order)
        state.neighbours = {
            nid: {order[(i + offset) % k] for offset in range(-half, half + 1)}
            for i, nid in enumerate(order)
        }

    def _setup(self, grid: Grid, state: RoundState, timeout: float | None) -> set[int]:
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
        for nid, reply in sorted(got.items()):
            keys = reply.content.config_records[RECORD_KEY_CONFIGS]
            signing = reply.content.config_records.get(SIGN_RECORD, ConfigRecord())
            key = signing.get(SIGNING_KEY)
            if not isinstance(key, bytes) or len(key) != 32:
                log(
                    WARNING,
                    "round %d: node %d advertised no signing key for the "
                    "consistency round: dropped",
                    state.number,
                    nid,
                )
                continue
            state.signing_keys[nid] = key
            state.public_keys[nid] = (
                cast(bytes, keys[Key.PUBLIC_KEY_1]),
                cast(bytes, keys[Key.PUBLIC_KEY_2]),
            )
        return set(state.signing_keys)

    def _share_keys(
        self, grid: Grid, state: RoundState, active: set[int], timeout: float | None
    ) -> set[int]:
        contents: dict[int, RecordDict] = {}
        for nid in sorted(active):
            near = sorted(state.neighbours[nid] & active)
            record = ConfigRecord({str(n): list(state.public_keys[n]) for n in near})
            record[Key.STAGE] = Stage.SHARE_KEYS
            signing = ConfigRecord({str(n): state.signing_keys[n] for n in near})
            contents[nid] = RecordDict(
                {RECORD_KEY_CONFIGS: record, SIGN_RECORD: signing}
            )
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

    def scalar_weights(self) -> dict[str, str]:
        """The round's secure scalars ``{key: weight key}``: the examples, the
        loss (weighted by examples), the clipped entries, and on FOT's GPSE
        rounds ``gpse-examples`` and each layer's weighted residual fraction.
        Under distributed client DP only the clipping counts: the nodes
        release nothing un-noised of their data (``num-examples``, the loss)."""
        if self.dp is not None:
            return {key: "" for key in DP_RELEASED}
        weights = {
            protocol.NUM_EXAMPLES: "",
            CLIPPED: "",
            LOSS_EXAMPLES: "",
            protocol.TRAIN_LOSS: LOSS_EXAMPLES,
        }
        sketches = self.strategy.replies.records().get(protocol.SKETCHES)
        if sketches:
            weights[protocol.GPSE_EXAMPLES] = ""
            for layer in sorted(sketches):
                weights[protocol.gpse_fraction_key(layer)] = protocol.GPSE_EXAMPLES
        return weights

    def _collect(
        self,
        grid: Grid,
        state: RoundState,
        instructions: Mapping[int, Message],
        active: set[int],
        timeout: float | None,
    ) -> Collected | None:
        """Stage 2: each active node's masked vector, checked, summed mod the range."""
        scale = self.strategy.max_num_examples
        if scale is None:
            raise SecureAggregationError(
                "secure aggregation needs the largest num-examples a client may "
                "claim (the weight scale): set max-num-examples"
            )
        scalars = SecureScalars.for_round(
            self.settings, len(state.sampled), self.scalar_weights()
        )
        sent = instructions[min(active)].content.array_records
        main = sent.get(self.strategy.arrayrecord_key, ArrayRecord())
        self._base = {key: main[key].numpy() for key in main}
        contents = {
            nid: self._masked_instruction(
                state, nid, instructions[nid], float(scale), scalars
            )
            for nid in sorted(active)
        }
        got = self._send(grid, state, contents, timeout, Stage.COLLECT_MASKED_VECTORS)
        garbled = garbled_senders(state.errors)
        for sender, reporters in sorted(garbled.items()):
            log(
                WARNING,
                "round %d: node %d's ciphertexts do not decrypt at nodes %s: node "
                "%d is dropped",
                state.number,
                sender,
                reporters,
                sender,
            )
            got.pop(sender, None)
        collected = self._sum_masked(state, got, instructions, scalars)
        if collected is None or not self._enough(
            state, set(collected.replies), Stage.COLLECT_MASKED_VECTORS
        ):
            return None
        return collected

    def _masked_instruction(
        self,
        state: RoundState,
        nid: int,
        instruction: Message,
        scale: float,
        scalars: SecureScalars,
    ) -> RecordDict:
        """Node ``nid``'s stage-2 content: its train instruction, its peers'
        shares, the weight scale, weighted record, clipping range and the
        secure scalars the node sums."""
        content = RecordDict(dict(instruction.content.items()))
        srcs, texts = state.forward[nid]
        content[RECORD_KEY_CONFIGS] = ConfigRecord(
            {
                Key.STAGE: Stage.COLLECT_MASKED_VECTORS,
                Key.CIPHERTEXT_LIST: list(texts),
                Key.SOURCE_LIST: list(srcs),
            }
        )
        options = ConfigRecord(
            {
                WEIGHT_SCALE: scale,
                WEIGHTED_RECORD: self.strategy.arrayrecord_key,
                CLIPPING_RANGE: float(self.settings.clipping_range),
                SCALAR_KEYS: list(scalars.keys),
                SCALAR_WEIGHTS: list(scalars.weights),
                SCALAR_BASE: scalars.base,
            }
        )
        if self.dp is not None:
            options[DP_THRESHOLD] = state.threshold
        content[FEDLR_RECORD] = options
        return content

    def round_manifest(self, instruction: Message) -> list[Summand]:
        """The summands every reply masks, in order, from the strategy's
        declared shapes (its reply shapes, then its extra records); dtypes
        from the instruction's arrays (float32 where it has none)."""
        strategy = self.strategy
        records: dict[str, Mapping[str, tuple[int, ...]]] = {
            strategy.arrayrecord_key: strategy.reply_shapes(),
            **strategy.replies.records(),
        }
        sent = instruction.content.array_records
        out = []
        for record in sorted(records):
            for key in sorted(records[record]):
                dtype = "float32"
                if record in sent and key in sent[record]:
                    dtype = str(sent[record][key].dtype)
                out.append(Summand(record, key, tuple(records[record][key]), dtype))
        return out

    def _sum_masked(
        self,
        state: RoundState,
        got: Mapping[int, Message],
        instructions: Mapping[int, Message],
        scalars: SecureScalars,
    ) -> Collected | None:
        """The checked replies' masked sum (mod the range); a bad reply is
        dropped with its reason naming the node. ``None`` when none is left."""
        if not got:
            return None
        manifest = self.round_manifest(instructions[min(got)])
        want = [(1,), *(s.shape for s in manifest), (scalars.size,)]
        total: Masked | None = None
        kept: dict[int, Message] = {}
        for nid, reply in sorted(got.items()):
            try:
                masked = masked_vector(nid, reply, want)
            except ReplyValidationError as exc:
                log(WARNING, "round %d: dropped a reply: %s", state.number, exc)
                continue
            total = masked if total is None else parameters_addition(total, masked)
            kept[nid] = reply
        if total is None:
            return None
        masked_sum = parameters_mod(total, MODULUS_RANGE)
        return Collected(kept, manifest, masked_sum, scalars)

    def _means(
        self,
        state: RoundState,
        manifest: list[Summand],
        sums: Masked,
        weight: float,
        k: int,
    ) -> dict[str, dict[str, np.ndarray[Any, Any]]]:
        """The secure means; under distributed client DP ``x + S / m``."""
        key = self.strategy.arrayrecord_key
        dp = self.dp
        if dp is None:
            return unflatten_sums(
                manifest, sums, weighted=key, total_weight=weight, clients=k
            )
        means, stats = ddp.publish(
            self._base,
            [(t.key, t.dtype) for t in manifest if t.record == key],
            sums,
            settings=dp,
            ledger=self.strategy.client_dp_ledger,
            step=self.settings.step(),
            survivors=(k, state.threshold, len(state.sampled)),
            population=self.strategy.nodes_sampled_from,
        )
        state.stats.update(stats)
        return {key: means}
