"""The node's guard against a hostile SecAgg+ server.

Flower's ``secaggplus_mod`` trusts the server's stage messages: it hands
over whatever shares an unmask request names, and it splits its secrets
into as many shares as the setup asks. :func:`secagg_guard`, a Flower mod
that :func:`fedlr.client_apps.secagg.secagg_mod` runs before Flower's, reads
every SecAgg+ stage message first and refuses (a
:class:`~fedlr.errors.SecAggGuardError` naming the check, which fedlr's
ClientApp answers with an error reply) when

* **setup**: ``share_num`` exceeds the round's sampled nodes or the node's
  ceiling ``secagg-max-shares`` (node config, default 100), or the
  reconstruction threshold is below 2, not above half of ``share_num``
  (SecAgg+'s ``t > n / 2``) or above it; the clipping, target or modulus
  range is out of bounds (``share-num``, ``threshold``, ``range``);
* **any stage**: the round was not set up, or a setting (share_num,
  threshold, clipping, target and modulus range, fedlr's clipping range)
  differs from the setup's of the round (``round``, ``settings-changed``);
* **share keys**: the neighbourhood lacks this node, holds more nodes than
  ``share_num`` or fewer than the threshold (``neighbourhood``);
* **masked vectors**: a ciphertext comes from outside the neighbourhood, or
  does not decrypt to a share from its sender for this node
  (``neighbourhood``, ``ciphertext``: the reason names the sender);
* **unmask**: a node is listed as surviving and as dropped, this node is
  listed as dropped, a node is listed twice, outside the neighbourhood or
  without a share here, more shares than ``share_num`` or fewer survivors
  than the threshold are asked (``alive-and-dead``, ``neighbourhood``,
  ``too-many-shares``), the round's unmask was already answered
  (``repeat``), or the request asks for one kind of secret (mask-seed share
  of a survivor, key share of a dropout) of a node whose other kind this
  node already revealed in the round (``both-secrets``);
* **consistency** (the ConsistencyCheck round of Bonawitz et al. 2017, run
  between the masked vectors and the unmasking): the node signs the
  survivor set ``U3`` it is told, once per round (``survivor-set``: a second,
  different set, a set without this node or with fewer than ``t`` of its
  neighbours); at unmask it reveals only for exactly the set it signed
  (``survivor-set``: another set, a dropout inside it, or no set signed) and
  only with valid signatures over that set from at least ``t`` distinct
  nodes of its neighbourhood, checked with the Ed25519 keys the neighbours
  advertised at setup (``signature-forged``: a signature that does not
  verify or a signer without an advertised key; ``signature-duplicate``: a
  signer listed twice; ``signature-missing``: fewer than ``t``).

Why the consistency round: without it a server can tell different nodes
different survivor sets and collect mask-seed shares of some nodes from one
group and key shares of their neighbours from another, which unmasks the
sum of fewer than ``t`` nodes with no colluding client. An honest node signs
one set per round, so two different sets each signed by ``t`` of the ``n``
nodes need ``2t - n`` signers that sign both: colluding clients. With every
node holding shares of every other (``secagg-num-shares = 1``), every node
that reveals was told the same ``U3`` while fewer than ``2t - n`` clients
collude; the server then learns the sum over ``U3`` (at least ``t`` nodes)
and nothing finer.

Every check is a comparison of the message's integers with what the node
kept, so a refusal costs microseconds whatever ``share_num`` asks. The
guard records what it needs (the round's settings, neighbours, share
holders, revealed shares) in ``context.state`` only after Flower's mod
answered, so a refused message leaves the node's state as it was.
"""

from __future__ import annotations

import math
from typing import Any, cast

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
    Key,
    Stage,
)
from flwr.common.secure_aggregation.secaggplus_utils import (
    share_keys_plaintext_separate,
)

from fedlr.errors import ConfigError, SecAggGuardError
from fedlr.privacy.secagg import (
    new_signing_key,
    sign_survivors,
    survivor_statement,
    verify_survivors,
)

__all__ = [
    "CONSISTENCY",
    "DEFAULT_MAX_SHARES",
    "GUARD_STATE",
    "MAX_SHARES_KEY",
    "SIGNATURE",
    "SIGNATURES",
    "SIGNERS",
    "SIGNING_KEY",
    "SIGN_RECORD",
    "SURVIVORS",
    "secagg_guard",
    "secagg_stage",
]

GUARD_STATE = "fedlr-secagg-guard"
"""ConfigRecord of ``context.state`` where the guard keeps its rounds."""
MAX_SHARES_KEY = "secagg-max-shares"
"""Node-config key: the most shares this node splits its secrets into."""
DEFAULT_MAX_SHARES = 100
KEPT_ROUNDS = 8
"""Rounds whose records the guard keeps (older ones are forgotten)."""
_SETTINGS = (Key.SHARE_NUMBER, Key.THRESHOLD, Key.CLIPPING_RANGE, Key.TARGET_RANGE,
             Key.MOD_RANGE)  # fmt: skip
_FEDLR_CLIPPING = ("fedlr-secagg", "clipping-range")
CONSISTENCY = "fedlr-consistency"
"""The consistency round's stage (between the masked vectors and the
unmasking); the guard answers it, Flower's mod never sees it."""
SIGN_RECORD = "fedlr-secagg-consistency"
"""ConfigRecord of the consistency round's data: the node's signing key in
its setup reply (``signing-key``), its neighbours' keys at share keys (by
node id), the survivor set (``survivors``) and the signatures (``signers``,
``signatures``) at unmask, the node's ``signature`` in its reply."""
SIGNING_KEY = "signing-key"
SURVIVORS = "survivors"
SIGNERS = "signers"
SIGNATURES = "signatures"
SIGNATURE = "signature"


def secagg_guard(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Check a SecAgg+ stage message before Flower's mod answers it.

    Raises
    ------
    SecAggGuardError
        Naming the check that failed (see the module doc).
    """
    configs = secagg_stage(msg)
    if configs is None:
        return call_next(msg, ctxt)
    stage = configs.get(Key.STAGE)
    record = ctxt.state.config_records.get(GUARD_STATE, ConfigRecord())
    book = _Book(record, str(msg.metadata.group_id), int(msg.metadata.dst_node_id))
    signed = msg.content.config_records.get(SIGN_RECORD, ConfigRecord())
    if stage == Stage.SETUP:
        settings = _check_setup(configs, _max_shares(ctxt))
        book.check_unchanged(dict(zip(_SETTINGS, settings, strict=True)))
    else:
        book.check_round(str(stage))
        book.check_unchanged(_stated(msg))
        if stage == CONSISTENCY:
            reply = Message(book.sign(signed, msg.metadata.run_id), reply_to=msg)
            ctxt.state.config_records[GUARD_STATE] = book.record
            return reply
        if stage == Stage.SHARE_KEYS:
            book.check_neighbourhood(configs)
            book.check_signing_keys(configs, signed)
        elif stage == Stage.COLLECT_MASKED_VECTORS:
            book.check_ciphertexts(configs, ctxt)
        elif stage == Stage.UNMASK:
            book.check_unmask(configs)
            book.check_consistent(configs, signed, msg.metadata.run_id)
    reply = call_next(msg, ctxt)
    if not reply.has_error():
        if stage == Stage.SETUP:  # the session's signing key, advertised
            public = book.set_up(settings)
            reply.content.config_records[SIGN_RECORD] = ConfigRecord(
                {SIGNING_KEY: public}
            )
        else:
            book.answered(str(stage), configs, signed)
        ctxt.state.config_records[GUARD_STATE] = book.record
    return reply


def secagg_stage(msg: Message) -> ConfigRecord | None:
    """A train message's SecAgg+ stage record (``None``: not a SecAgg+ stage)."""
    if msg.metadata.message_type != MessageType.TRAIN or not msg.has_content():
        return None
    return msg.content.config_records.get(RECORD_KEY_CONFIGS)


def _max_shares(ctxt: Context) -> int:
    raw = ctxt.node_config.get(MAX_SHARES_KEY, DEFAULT_MAX_SHARES)
    if isinstance(raw, str):
        raw = float(raw) if raw.replace(".", "", 1).isdigit() else math.nan
    value = float(cast(float, raw))
    if not (math.isfinite(value) and value == int(value) and value >= 2):
        raise ConfigError(MAX_SHARES_KEY, f"must be a whole number >= 2, got {raw}")
    return int(value)


def _integer(configs: ConfigRecord, key: str) -> int:
    value = configs.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SecAggGuardError(
            "type", f"setup '{key}' must be an integer, got {value!r}"
        )
    return value


def _check_setup(configs: ConfigRecord, ceiling: int) -> list[float]:
    """The setup's settings, refused when out of bounds."""
    sampled = _integer(configs, Key.SAMPLE_NUMBER)
    shares = _integer(configs, Key.SHARE_NUMBER)
    threshold = _integer(configs, Key.THRESHOLD)
    target = _integer(configs, Key.TARGET_RANGE)
    modulus = _integer(configs, Key.MOD_RANGE)
    clipping = configs.get(Key.CLIPPING_RANGE)
    if shares > sampled or shares > ceiling or shares < 2:
        raise SecAggGuardError(
            "share-num",
            f"share_num {shares} must be in [2, min(sampled nodes {sampled}, "
            f"{MAX_SHARES_KEY} {ceiling})]",
        )
    if threshold < 2 or 2 * threshold <= shares or threshold > shares:
        raise SecAggGuardError(
            "threshold",
            f"reconstruction threshold {threshold} must be >= 2, above half of "
            f"share_num {shares} and at most {shares}",
        )
    if (
        isinstance(clipping, bool)
        or not isinstance(clipping, float)
        or not (math.isfinite(clipping) and clipping > 0)
        or not 2 <= target <= modulus <= 2**62
    ):
        raise SecAggGuardError(
            "range",
            f"clipping range {clipping!r} must be finite and > 0, and 2 <= target "
            f"range {target} <= modulus range {modulus} <= 2**62",
        )
    return [float(shares), float(threshold), float(clipping), float(target),
            float(modulus)]  # fmt: skip


def _stated(msg: Message) -> dict[str, float]:
    """Settings a later-stage message states: Flower's keys, fedlr's clipping
    range and the threshold distributed DP sizes each node's noise share by
    (it must be the round's: a larger one would shrink every node's noise)."""
    configs = msg.content.config_records[RECORD_KEY_CONFIGS]
    fedlr = msg.content.config_records.get(_FEDLR_CLIPPING[0], ConfigRecord())
    stated = {key: configs.get(key) for key in _SETTINGS}
    stated[Key.CLIPPING_RANGE + "/fedlr"] = fedlr.get(_FEDLR_CLIPPING[1])
    stated[Key.THRESHOLD + "/fedlr"] = fedlr.get("dp-threshold")
    return {k: float(v) for k, v in stated.items() if isinstance(v, (int, float))}


def _ints(record: ConfigRecord, key: str, what: str) -> list[int]:
    """The node ids ``record[key]`` lists (none when absent), each once."""
    out = []
    for value in cast(list[Any], record.get(key, [])):
        if isinstance(value, bool) or not isinstance(value, int):
            raise SecAggGuardError("type", f"{what} must list node ids, got {value!r}")
        out.append(value)
    if len(set(out)) != len(out):
        raise SecAggGuardError("duplicate", f"{what} lists a node more than once")
    return out


class _Book:
    """The guard's records of the rounds, in a ConfigRecord of ``context.state``."""

    def __init__(self, record: ConfigRecord, round_id: str, nid: int) -> None:
        self.record = ConfigRecord(dict(record))
        self.round = round_id
        self.nid = nid

    def _get(self, name: str, default: Any) -> Any:
        return self.record.get(f"{self.round}|{name}", default)

    def _set(self, name: str, value: Any) -> None:
        self.record[f"{self.round}|{name}"] = value

    # ----------------------------------------------------------- the checks
    def check_round(self, stage: str) -> None:
        if self.record.get("session") != self.round or not self._get("settings", []):
            raise SecAggGuardError(
                "round",
                f"stage '{stage}' of round '{self.round}', which this node did not "
                f"set up (last set up: {self.record.get('session', '')!r})",
            )

    def check_unchanged(self, settings: dict[str, float]) -> None:
        kept = cast(list[float], self._get("settings", []))
        if not kept:
            return
        expected = dict(zip(_SETTINGS, kept, strict=True))
        expected[Key.CLIPPING_RANGE + "/fedlr"] = kept[2]
        expected[Key.THRESHOLD + "/fedlr"] = kept[1]
        changed = [
            f"{key} {expected[key]:g} -> {value:g}"
            for key, value in settings.items()
            if key in expected and value != expected[key]
        ]
        if changed:
            raise SecAggGuardError(
                "settings-changed",
                f"round '{self.round}' changed its settings: {', '.join(changed)}",
            )

    def check_neighbourhood(self, configs: ConfigRecord) -> None:
        shares, threshold = (int(v) for v in self._get("settings", [0, 0])[:2])
        ids = [k for k in configs if k != Key.STAGE]
        if not all(k.isdigit() for k in ids):
            raise SecAggGuardError(
                "type", "share-keys names a node id that is not a number"
            )
        near = {int(k) for k in ids}
        if self.nid not in near or not threshold <= len(near) <= shares:
            raise SecAggGuardError(
                "neighbourhood",
                f"{len(near)} neighbours (this node among them: {self.nid in near})"
                f" for share_num {shares} and threshold {threshold}",
            )

    def check_ciphertexts(self, configs: ConfigRecord, ctxt: Context) -> None:
        srcs = _ints(configs, Key.SOURCE_LIST, "source list")
        texts = cast(list[bytes], configs.get(Key.CIPHERTEXT_LIST, []))
        near = set(cast(list[int], self._get("neighbours", [])))
        outside = sorted(set(srcs) - near - {self.nid})
        if outside or len(srcs) != len(texts):
            raise SecAggGuardError(
                "neighbourhood",
                f"ciphertexts from nodes {outside[:5]} outside the neighbourhood, or "
                f"{len(texts)} ciphertexts for {len(srcs)} sources",
            )
        state = SecAggPlusState(
            **ctxt.state.config_records.get(RECORD_KEY_STATE, ConfigRecord())
        )
        for src, text in zip(srcs, texts, strict=True):
            try:
                plain = decrypt(state.ss2_dict[src], text)
                sender, dst, _, _ = share_keys_plaintext_separate(plain)
                good = sender == src and dst == self.nid
            except Exception:  # a garbled token raises many kinds of error
                good = False
            if not good:
                raise SecAggGuardError(
                    "ciphertext",
                    f"the ciphertext from node {src} does not decrypt to its share "
                    "for this node",
                    node=src,
                )

    def check_unmask(self, configs: ConfigRecord) -> None:
        active = _ints(configs, Key.ACTIVE_NODE_ID_LIST, "active")
        dead = _ints(configs, Key.DEAD_NODE_ID_LIST, "dead")
        shares, threshold = (int(v) for v in self._get("settings", [0, 0])[:2])
        both = sorted(set(active) & set(dead))
        if both or self.nid in dead:
            node = both[0] if both else self.nid
            raise SecAggGuardError(
                "alive-and-dead",
                f"node {node} is listed as dropped and as surviving (this node is "
                "answering): revealing both of its secrets unmasks it",
                node=node,
            )
        if self._get("unmasked", False):
            raise SecAggGuardError(
                "repeat", f"round '{self.round}' was already unmasked"
            )
        holders = set(cast(list[int], self._get("holders", [])))
        outside = sorted((set(active) | set(dead)) - holders)
        if outside:
            raise SecAggGuardError(
                "neighbourhood",
                f"nodes {outside[:5]} are not neighbours whose shares this node holds",
                node=outside[0],
            )
        if len(active) + len(dead) > shares or len(active) < threshold:
            raise SecAggGuardError(
                "too-many-shares",
                f"{len(active)} + {len(dead)} shares asked: at most share_num "
                f"{shares}, with at least threshold {threshold} survivors",
            )
        seeds = set(cast(list[int], self._get("rd-seed", [])))
        keys = set(cast(list[int], self._get("sk1", [])))
        twice = sorted((set(active) & keys) | (set(dead) & seeds))
        if twice:
            raise SecAggGuardError(
                "both-secrets",
                f"node {twice[0]}'s other secret was revealed in round "
                f"'{self.round}': revealing both unmasks it",
                node=twice[0],
            )

    # ----------------------------------------------------- consistency round
    def check_signing_keys(self, configs: ConfigRecord, signed: ConfigRecord) -> None:
        """Share keys: a signing key of 32 bytes for every neighbour."""
        near = {k for k in configs if k != Key.STAGE}
        bad = sorted(
            k
            for k in near
            if not isinstance(signed.get(k), bytes) or len(cast(bytes, signed[k])) != 32
        )
        own = signed.get(str(self.nid)) == self._get("sign-public", b"")
        if bad or set(signed) - near or not own:
            raise SecAggGuardError(
                "signature-forged",
                f"share keys must carry one 32-byte signing key per neighbour, "
                f"this node's own as it advertised it: nodes {bad[:5]} have none, "
                f"{sorted(set(signed) - near)[:5]} are not neighbours, own key "
                f"{'kept' if own else 'replaced'}",
            )

    def sign(self, signed: ConfigRecord, run_id: int) -> RecordDict:
        """The consistency round: this node's signature over the survivor set
        it is told (once per round; the same set again gets the same answer)."""
        if not self._get("holders", []) or self._get("unmasked", False):
            raise SecAggGuardError(
                "round",
                f"a consistency round of round '{self.round}' before the masked "
                "vectors or after the unmasking",
            )
        survivors = sorted(_ints(signed, SURVIVORS, "U3"))
        threshold = int(self._get("settings", [0, 0])[1])
        near = set(cast(list[int], self._get("holders", [])))
        told = sorted(near & set(survivors))
        kept = cast(list[int], self._get("signed", []))
        if self._get("signed-once", False) and kept != survivors:
            raise SecAggGuardError(
                "survivor-set",
                f"round '{self.round}' already signed survivors {kept[:8]}; a "
                f"node signs one set per round, not {survivors[:8]}",
            )
        if self.nid not in survivors or len(told) < threshold:
            raise SecAggGuardError(
                "survivor-set",
                f"survivors {survivors[:8]} must hold this node and at least "
                f"t = {threshold} of its neighbours (they hold {len(told)})",
            )
        statement = survivor_statement(run_id, self.round, survivors)
        signature = sign_survivors(cast(bytes, self._get("sign-key", b"")), statement)
        self._set("signed", survivors)
        self._set("signed-once", True)
        return RecordDict({SIGN_RECORD: ConfigRecord({SIGNATURE: signature})})

    def check_consistent(
        self, configs: ConfigRecord, signed: ConfigRecord, run_id: int
    ) -> None:
        """Unmask: the set this node signed, asked consistently, signed by at
        least ``t`` distinct neighbours (see the module doc)."""
        survivors = sorted(_ints(signed, SURVIVORS, "U3"))
        kept = cast(list[int], self._get("signed", []))
        active = set(cast(list[int], configs.get(Key.ACTIVE_NODE_ID_LIST, [])))
        dead = set(cast(list[int], configs.get(Key.DEAD_NODE_ID_LIST, [])))
        if not self._get("signed-once", False) or survivors != kept:
            raise SecAggGuardError(
                "survivor-set",
                f"unmask for survivors {survivors[:8]}, but this node signed "
                f"{kept[:8] if self._get('signed-once', False) else 'no set'}",
            )
        against = sorted((active - set(kept)) | (dead & set(kept)))
        if against:
            raise SecAggGuardError(
                "survivor-set",
                f"the unmask lists nodes {against[:5]} against the signed "
                "survivor set (a survivor as dropped, or a dropout as alive)",
            )
        self._check_signatures(signed, run_id, kept)

    def _check_signatures(
        self, signed: ConfigRecord, run_id: int, kept: list[int]
    ) -> None:
        """At least ``t`` distinct neighbours' valid signatures over the
        survivor set ``kept`` this node signed."""
        ids = cast(list[Any], signed.get(SIGNERS, []))
        texts = cast(list[Any], signed.get(SIGNATURES, []))
        if len(ids) != len(texts):
            raise SecAggGuardError(
                "signature-forged", f"{len(ids)} signers for {len(texts)} signatures"
            )
        if len({repr(i) for i in ids}) != len(ids):
            raise SecAggGuardError(
                "signature-duplicate", "the unmask lists a signer more than once"
            )
        peers = dict(
            zip(
                cast(list[int], self._get("peers", [])),
                cast(list[bytes], self._get("peer-keys", [])),
                strict=True,
            )
        )
        statement = survivor_statement(run_id, self.round, kept)
        for signer, text in zip(ids, texts, strict=True):
            key = peers.get(signer) if isinstance(signer, int) else None
            if (
                key is None
                or signer not in kept
                or not isinstance(text, bytes)
                or not verify_survivors(key, statement, text)
            ):
                raise SecAggGuardError(
                    "signature-forged",
                    f"the signature of node {signer!r} over the survivor set does "
                    "not verify with the key that node advertised",
                    node=signer if isinstance(signer, int) else None,
                )
        threshold = int(self._get("settings", [0, 0])[1])
        if len(ids) < threshold:
            raise SecAggGuardError(
                "signature-missing",
                f"{len(ids)} valid signatures over the survivor set: at least "
                f"t = {threshold} distinct neighbours must sign it",
            )

    # ------------------------------------------------------------ recording
    def set_up(self, settings: list[float]) -> bytes:
        """Open the round (forgetting all but the last rounds) with the
        setup's ``settings`` and a new signing key: its public half."""
        rounds = [r for r in cast(list[str], self.record.get("rounds", []))
                  if r != self.round] + [self.round]  # fmt: skip
        for old in rounds[:-KEPT_ROUNDS]:
            for key in [k for k in self.record if k.startswith(f"{old}|")]:
                del self.record[key]
        self.record["rounds"] = rounds[-KEPT_ROUNDS:]
        self.record["session"] = self.round
        private, public = new_signing_key()
        self._set("settings", settings)
        self._set("neighbours", [])
        self._set("holders", [])
        self._set("unmasked", False)
        self._set("sign-key", private)
        self._set("sign-public", public)
        self._set("signed", [])
        self._set("signed-once", False)
        return public

    def answered(self, stage: str, configs: ConfigRecord, signed: ConfigRecord) -> None:
        """Record what a later stage's answer revealed or established."""
        if stage == Stage.SHARE_KEYS:
            peers = sorted(int(k) for k in signed)
            self._set("neighbours", sorted(int(k) for k in configs if k != Key.STAGE))
            self._set("peers", peers)
            self._set("peer-keys", [cast(bytes, signed[str(n)]) for n in peers])
        elif stage == Stage.COLLECT_MASKED_VECTORS:
            srcs = cast(list[int], configs.get(Key.SOURCE_LIST, []))
            self._set("holders", sorted({*srcs, self.nid}))
        elif stage == Stage.UNMASK:
            active = cast(list[int], configs.get(Key.ACTIVE_NODE_ID_LIST, []))
            dead = cast(list[int], configs.get(Key.DEAD_NODE_ID_LIST, []))
            self._set("rd-seed", sorted({*self._get("rd-seed", []), *active}))
            self._set("sk1", sorted({*self._get("sk1", []), *dead}))
            self._set("unmasked", True)
