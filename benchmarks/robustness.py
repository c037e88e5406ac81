"""Robust rules against adaptive attackers on the default task, with clean costs.

``python -m benchmarks.robustness run [--out DIR] [--rounds N] [--seeds 0,1,2]
[--shard I/N] [--set 'key=value ...']``, then ``python -m benchmarks.robustness
table [--out DIR]``.

The default task (fedex-lora, MiniLM with LoRA r = 8 on polarity, Dirichlet
0.5) with five clients, in process
(:func:`fedlr.launch.local.run_in_process`), under each rule of
:data:`fedlr.robust.rules.ROBUST_RULES`. Each run is one of:

* ``clean``: five honest clients (the accuracy a rule costs without attack);
* ``absent-<m>of5``: the last ``m`` partitions never reply (their replies
  are taken out of every round): what a defence that left out exactly the
  attackers would keep, the ceiling of any rule, since the attackers' data
  are lost with them (a non-IID partition may hold most of a class);
* ``<attack>-<m>of<n>``: ``m`` partitions of ``n`` (``--clients``, five by
  default) collude, drawn per seed (:func:`attacker_partitions`; ``--placement
  last`` puts them at the last partitions, as the study did before). They train
  honestly, see every honest reply of the round (the omniscient adversary of
  the ALIE paper, :class:`Colluders`, through the in-process grid's
  ``round_hook``) and replace their replies by:

  ``sign-flip``
      their own honest update, negated (``x_ref - d``), honest example count;
  ``alie``
      "a little is enough" (Baruch et al., 2019): per coordinate, the honest
      mean minus ``z`` honest standard deviations, ``z = Phi^-1((n - s) / n)``
      with ``s = floor(n / 2 + 1) - m``, honest example count;
  ``under-the-clip``
      the negated honest mean, scaled to 0.99 of the honest median update
      norm in the method's update space (so ``norm-clip``, whose bound is the
      round's median, does not clip it), honest example count;
  ``under-the-cap``
      the negated honest mean, scaled to 0.9 of what the default update-size
      screen lets through (``screen-ratio`` times the honest median norm),
      claiming ``max-num-examples`` examples (the server's cap, the largest
      partition): the most the default bounds let one reply weigh;
  ``adaptive``
      the attack that knows the defence: the negated honest mean at 0.999 of
      the largest norm the defence keeps (:func:`adaptive_limit`), claiming
      the cap. Centred clipping clips a reply's distance to the centre, not
      its norm: past the bound its pull stays the same, so the attacker goes
      to the screen's limit, as against ``none``. Against the held-out check
      it also reads the server's own strategy and validation examples
      (:class:`CheckProbe`) and sends the largest scale whose leave-one-out
      gain ``L(S) - L(S - attackers)`` stays under 0.999 of
      ``heldout-check-margin``, so the check never leaves it out for its own
      effect.
      Against the server's own update (``server-update-share``) it reads
      the server's update of the round (:class:`ServerProbe`) and negates
      what the server would publish without it, ``(1 - s)`` times the honest
      mean plus ``s`` times the server's update; with ``clip-reference =
      "server"`` its norm is 0.999 of ``clip-ratio`` times the server's
      update norm, the largest the clip keeps.

  ``rebalance``
      their own honest reply with every adapted layer's ``A`` times
      ``c = 1e10`` and ``B`` over ``c`` (:data:`REBALANCE`): the product
      ``B A`` is unchanged, the factors a factor-averaging method publishes
      are not; honest example count;
  ``minus-server``
      minus the server's own update of the round (:class:`ServerProbe`), at
      0.999 of its norm in the method's space, claiming the cap.

Norms are measured in the space the method aggregates in, the space of the
server's screen and rules (:meth:`Colluders.attach`).

Every run is one line of ``DIR/runs*.jsonl`` (resumable: a finished run is not
run again; ``--shard I/N`` runs every N-th run starting at I, so that two
processes share the grid). ``table`` writes ``DIR/robustness.csv`` (one row
per run) and ``DIR/summary.md`` (mean ± std over seeds per rule and setting,
and each rule's clean cost against ``none``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from flwr.app import Message, MessageType, MetricRecord, RecordDict
from matplotlib.figure import Figure

from fedlr.flower.records import config_int, record_to_state, state_to_record
from fedlr.launch.compare import parse_overrides
from fedlr.launch.local import run_in_process
from fedlr.robust.screen import DEFAULT_SCREEN_RATIO
from fedlr.robust.spaces import ProductSpace, UpdateSpace
from fedlr.round.protect import HeldOutStep
from fedlr.round.state import method_state
from fedlr.server_apps.builtin_plans import build_plan
from fedlr.strategies.registry import resolve
from fedlr.wire import protocol
from fedlr.wire.updates import ClientUpdate

ATTACKS = (
    "absent",
    "sign-flip",
    "alie",
    "under-the-clip",
    "under-the-cap",
    "adaptive",
    "rebalance",
    "minus-server",
)
CEILING = "absent"
"""Not an attack: the attackers' replies are taken out (the best any rule
does is to leave out exactly them); not counted in a defence's worst case."""
NUM_CLIENTS = 5
"""Clients of a run unless ``--clients`` says otherwise."""
REBALANCE = 1e10
"""``rebalance``'s factor ``c``: it sends ``c A`` and ``B / c``."""
MINUS_SERVER_MARGIN = 0.999
CLIP_MARGIN = 0.99
SCREEN_MARGIN = 0.9
ADAPTIVE_MARGIN = 0.999
CHECK_STEPS = 8
"""Bisection steps of the check-aware scale (the kept scale is within
``2**-8`` of the largest one the check lets through)."""

DEFENCES: dict[str, dict[str, Any]] = {
    "none": {"robust": "none"},
    "norm-clip": {"robust": "norm-clip"},
    "median": {"robust": "median"},
    "clip+cap": {"robust": "norm-clip", "max-weight-ratio": 1.0},
    "clip2+cap": {"robust": "norm-clip", "clip-ratio": 2.0, "max-weight-ratio": 1.0},
    "heldout-check": {"robust": "none", "heldout-check": True},
    "centred-clip": {"robust": "centred-clip"},
    "centred-clip+cap2": {"robust": "centred-clip", "max-weight-ratio": 2.0},
    "default": {"robust": "auto"},
    "serverclip": {
        "robust": "norm-clip",
        "clip-reference": "server",
        "server-update-share": 0.5,
    },
}
"""The defences compared, by name: run-config values over the defaults (each
sets ``robust``, so a study does not depend on which rule is the default).
``heldout-check`` and ``serverclip`` (the server's own update, every client
clipped at its norm) keep the held-out split's last 128 examples for the
server: compare them with ``--set max-eval-examples=672`` so that every defence is
evaluated on the same 672 examples (polarity's held-out split has 800)."""


LEGEND = {
    "default": 'robust = "auto"\n(the default)',
    "serverclip": 'robust = "auto"\n(norm-clip at the server\'s\nupdate, share 0.5)',
}
"""The figure's name of a defence where its key is not what a user sets:
``serverclip`` is what the default ``robust = "auto"`` resolves to on the
default task (``tests/adversarial/test_server_update.py`` checks it key for
key)."""


def settings(attackers: list[tuple[int, int]]) -> list[str]:
    """The table's rows: no attacker, then every attack with each ``(m, n)``:
    ``m`` attackers of ``n`` clients."""
    return ["clean", *(f"{a} {m}/{n}" for a in ATTACKS for m, n in attackers)]


def attacker_partitions(seed: int, clients: int, m: int, placement: str) -> set[int]:
    """The attackers' partitions: ``m`` of ``clients`` drawn from ``seed``
    (``placement = "drawn"``, the study's default: a partition's data, not
    its position, decides what an attack does), or the last ``m``."""
    if placement == "last":
        return set(range(clients - m, clients))
    if placement != "drawn":
        raise ValueError(f"placement must be 'drawn' or 'last', got {placement!r}")
    draw = np.random.default_rng([seed, clients, m]).choice(clients, m, replace=False)
    return {int(p) for p in draw}


def alie_z(n: int, m: int) -> float:
    """The ALIE paper's largest undetected deviation for ``m`` of ``n``."""
    s = math.floor(n / 2 + 1) - m
    return statistics.NormalDist().inv_cdf((n - s) / n)


def _pairs(keys: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(A key, B key)`` of every adapted layer, by PEFT's key names."""
    return [
        (k, k.replace("lora_A", "lora_B"))
        for k in keys
        if "lora_A" in k and k.replace("lora_A", "lora_B") in keys
    ]


class Colluders:
    """The attackers' partitions, replacing their train replies each round.

    Norms are measured in the space the server's method aggregates in
    (``strategy.replies.space``, read by :meth:`attach` through
    ``run_in_process``'s ``observe``), the space its screen and rules use;
    unattached, in the product space.

    Parameters
    ----------
    attack : str
        One of :data:`ATTACKS`.
    attackers : set of int
        Their partition ids.
    cap : int
        The server's ``max-num-examples`` (``under-the-cap`` claims it).
    screen_ratio : float
        The server's ``screen-ratio``.
    clip_ratio : float or None
        ``adaptive``: the defence's norm-clip bound over the round's median
        update norm, or None when the defence does not clip (then the
        attacker goes to the screen's limit).
    probe : CheckProbe, optional
        ``adaptive`` against the held-out check: the server's check, which
        the attackers keep their joint leave-one-out gain under.
    server : ServerProbe, optional
        ``adaptive`` against the server's own update: the attackers negate
        the step the server would publish without them, the server's update
        included (its share ``s``: ``(1 - s)`` honest mean ``+ s`` server
        update), not the honest mean alone.
    """

    def __init__(
        self,
        attack: str,
        attackers: set[int],
        cap: int,
        screen_ratio: float,
        clip_ratio: float | None = None,
        probe: CheckProbe | None = None,
        server: ServerProbe | None = None,
    ) -> None:
        if attack not in ATTACKS:
            raise ValueError(f"attack must be one of {ATTACKS}, got {attack!r}")
        self.attack = attack
        self.attackers = attackers
        self.cap = cap
        self.screen_ratio = screen_ratio
        self.clip_ratio = clip_ratio
        self.probe = probe
        self.server = server
        self.norms: list[tuple[float, float]] = []  # (attacker, honest median)
        self.space_of: Callable[[Mapping[str, torch.Tensor]], UpdateSpace] | None = None

    def attach(self, strategy: Any) -> None:
        """Measure in the server's method's space (``observe``)."""
        self.space_of = strategy.replies.space

    def __call__(
        self, round_: list[tuple[int, Message, Message]]
    ) -> list[Message | None]:
        train = train_replies(round_)
        honest = [t for t in train if t[0] not in self.attackers]
        if not honest or len(honest) == len(train):
            return [rep for _, _, rep in round_]
        if self.attack == CEILING:  # the grid drops a None: no reply at all
            gone = {id(rep) for p, _, rep in train if p in self.attackers}
            return [None if id(rep) in gone else rep for _, _, rep in round_]
        ref = _state(honest[0][1])
        space = (
            self.space_of(ref)
            if self.space_of is not None
            else ProductSpace(ref, _pairs(ref))
        )
        deltas = [_delta(_state(rep), _state(ins)) for _, ins, rep in honest]
        keys = list(deltas[0])
        stacked = {k: torch.stack([d[k] for d in deltas]) for k in keys}
        mean = {k: v.mean(0) for k, v in stacked.items()}
        std = {k: v.std(0, unbiased=False) for k, v in stacked.items()}
        honest_norms = [space.norm(_update(ref, d)) for d in deltas]
        honest_median = statistics.median(honest_norms)
        z = alie_z(len(train), len(train) - len(honest))
        trained = {id(rep) for _, _, rep in train}
        attacking = [
            (p, ins, rep)
            for p, ins, rep in round_
            if id(rep) in trained and p in self.attackers
        ]
        plans: dict[
            int, tuple[Message, Message, dict[str, torch.Tensor], int | None]
        ] = {}
        for _, ins, rep in attacking:
            sent, own = _state(ins), _state(rep)
            claim = None
            if self.attack == "sign-flip":
                delta = {k: -d for k, d in _delta(own, sent).items()}
            elif self.attack == "rebalance":
                delta = _delta(_rebalanced(own), sent)
            elif self.attack == "minus-server":
                if self.server is None:
                    raise ValueError("minus-server needs server-update-share > 0")
                own = self.server.delta(keys)
                target = MINUS_SERVER_MARGIN * space.norm(_update(ref, own))
                delta = _scaled(space, ref, {k: -d for k, d in own.items()}, target)
                claim = self.cap
            elif self.attack == "alie":
                delta = {k: mean[k] - z * std[k] for k in keys}
            else:
                if (
                    self.attack == "adaptive"
                    and self.server is not None
                    and (self.server.clips and self.clip_ratio is not None)
                ):  # the bound is clip-ratio x the server's update norm
                    own = self.server.delta(keys)
                    target = (
                        ADAPTIVE_MARGIN
                        * self.clip_ratio
                        * space.norm(_update(ref, own))
                    )
                elif self.attack == "adaptive":
                    target = ADAPTIVE_MARGIN * adaptive_limit(
                        honest_norms,
                        len(train) - len(honest),
                        self.clip_ratio,
                        self.screen_ratio,
                    )
                else:
                    target = honest_median * (
                        CLIP_MARGIN
                        if self.attack == "under-the-clip"
                        else SCREEN_MARGIN * self.screen_ratio
                    )
                direction = {k: -mean[k] for k in keys}
                if self.attack == "adaptive" and self.server is not None:
                    s, own = self.server.share, self.server.delta(keys)
                    direction = {k: -((1 - s) * mean[k] + s * own[k]) for k in keys}
                delta = _scaled(space, ref, direction, target)
                if self.attack in ("under-the-cap", "adaptive"):
                    claim = self.cap
            plans[id(rep)] = (ins, rep, delta, claim)

        def forge_at(t: float) -> dict[int, Message]:
            """Every attacker's reply with its delta scaled by ``t``."""
            return {
                key: _forge(ins, rep, {k: t * d for k, d in delta.items()}, claim)
                for key, (ins, rep, delta, claim) in plans.items()
            }

        scale = 1.0
        if self.attack == "adaptive" and self.probe is not None and plans:
            scale = self.probe.largest_scale(train, set(plans), forge_at)
        for _, _, delta, _ in plans.values():
            sent_delta = {k: scale * d for k, d in delta.items()}
            self.norms.append((space.norm(_update(ref, sent_delta)), honest_median))
        forged = forge_at(scale)
        return [forged.get(id(rep), rep) for _, _, rep in round_]


def _rebalanced(arrays: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``arrays`` with every adapted layer's ``A`` times :data:`REBALANCE`
    and its ``B`` over it: each product ``B A`` is unchanged."""
    out = {k: v.double() for k, v in arrays.items()}
    for a, b in _pairs(arrays):
        out[a], out[b] = out[a] * REBALANCE, out[b] / REBALANCE
    return out


def train_replies(
    round_: list[tuple[int, Message, Message]],
) -> list[tuple[int, Message, Message]]:
    """The round's ``(partition, instruction, reply)`` of train instructions
    answered without an error."""
    return [
        (p, ins, rep)
        for p, ins, rep in round_
        if ins.metadata.message_type == MessageType.TRAIN and not rep.has_error()
    ]


def _forge(
    instruction: Message,
    reply: Message,
    delta: Mapping[str, torch.Tensor],
    claim: int | None,
) -> Message:
    """``reply`` with its arrays moved to ``sent + delta`` (and ``claim``),
    added in float64 and cast once (``rebalance``'s ``B / c`` is far below
    a float32 ``B``'s rounding step)."""
    sent, own = _state(instruction), _state(reply)
    arrays = {
        k: (sent.get(k, torch.zeros_like(v)).double() + delta[k]).to(v.dtype)
        if k in delta
        else v
        for k, v in own.items()
    }
    return _reply(instruction, reply, arrays, claim)


class CheckProbe:
    """The held-out check as an omniscient attacker sees it.

    :meth:`attach` it with ``run_in_process(observe=probe.attach)``: it then
    holds the server's own strategy (its reply checks, its method and the
    validation examples of its check), so the loss it computes is the one
    the check computes (:meth:`fedlr.round.protect.HeldOutStep.loss`, the
    method's state restored after each try). Models ``robust = "none"``.

    Attributes
    ----------
    gains : list of (float, float)
        Per round: the attackers' leave-one-out gain at the scale sent, and
        the check's margin.
    """

    def __init__(self) -> None:
        self.strategy: Any = None
        self.gains: list[tuple[float, float]] = []

    def attach(self, strategy: Any) -> None:
        """Read the server's strategy (``run_in_process``'s ``observe``)."""
        if strategy.heldout_check is None:
            raise ValueError("the check-aware attack needs heldout-check = true")
        if strategy.robust.active:
            raise ValueError("the check-aware attack models robust = 'none' only")
        self.strategy = strategy

    def loss(self, server_round: int, replies: list[Message]) -> float:
        """The validation loss of what the server would publish from
        ``replies`` (checked and screened as the server does)."""
        s = self.strategy
        if s is None:
            raise RuntimeError("CheckProbe.attach was not called (observe=)")
        sent = s.round
        if sent is None:
            raise RuntimeError("CheckProbe.loss called before the round began")
        current = record_to_state(sent.arrays)
        # Replies.accept's checks but screen_replies, which would use up the
        # round's record of instructed nodes before the server's own round
        updates, _ = s.replies.validate_replies(replies, sent.arrays)
        updates, *_ = s.replies.screen_update_sizes(updates, current)
        step = HeldOutStep(s.heldout_check, s)
        return step.loss(server_round, updates, current, method_state(s))

    def largest_scale(
        self,
        train: list[tuple[int, Message, Message]],
        attackers: set[int],
        forge_at: Callable[[float], dict[int, Message]],
    ) -> float:
        """The largest scale ``t`` in [0, 1] (bisection, :data:`CHECK_STEPS`)
        of the attackers' forged updates, ``forge_at(t)`` keyed by the
        ``id`` of the replies they replace (``attackers``), whose joint
        leave-one-out gain is under 0.999 of the margin (0 when none is)."""
        config = train[0][1].content.config_records[protocol.CONFIG]
        server_round = config_int(config, protocol.SERVER_ROUND)
        margin = ADAPTIVE_MARGIN * self.strategy.heldout_check.margin
        without = self.loss(
            server_round, [rep for _, _, rep in train if id(rep) not in attackers]
        )

        def gain(t: float) -> float:
            forged = forge_at(t)
            round_ = [forged.get(id(rep), rep) for _, _, rep in train]
            return self.loss(server_round, round_) - without

        best, best_gain = 1.0, gain(1.0)
        if not best_gain <= margin:
            lo, hi, best, best_gain = 0.0, 1.0, 0.0, math.nan
            for _ in range(CHECK_STEPS):
                mid = (lo + hi) / 2
                g = gain(mid)
                if g <= margin:
                    lo, best, best_gain = mid, mid, g
                else:
                    hi = mid
            if best == 0.0:
                best_gain = gain(0.0)
        self.gains.append((best_gain, margin / ADAPTIVE_MARGIN))
        return best


class ServerProbe:
    """The server's own update as an omniscient attacker sees it.

    :meth:`attach` it with ``run_in_process(observe=probe.attach)``: it then
    holds the server's strategy, and :meth:`delta` is the update the server
    adds this round (its plan trains an instruction once, so asking first
    changes nothing the server does).
    """

    def __init__(self) -> None:
        self.strategy: Any = None

    def attach(self, strategy: Any) -> None:
        """Read the server's strategy (``run_in_process``'s ``observe``)."""
        if strategy.server_update is None:
            raise ValueError("the server-aware attack needs server-update-share > 0")
        self.strategy = strategy

    @property
    def clips(self) -> bool:
        """Whether the server clips clients at its own update's norm
        (``clip-reference = "server"``)."""
        if self.strategy is None:
            raise RuntimeError("ServerProbe.attach was not called (observe=)")
        return bool(self.strategy.robust.clip_reference == "server")

    @property
    def share(self) -> float:
        """``server-update-share``."""
        if self.strategy is None:
            raise RuntimeError("ServerProbe.attach was not called (observe=)")
        return float(self.strategy.server_update.share)

    def delta(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """The server's update this round, ``keys`` of it, in float64."""
        s = self.strategy
        if s is None:
            raise RuntimeError("ServerProbe.attach was not called (observe=)")
        sent = s.round
        if sent is None or sent.instruction is None:
            raise RuntimeError("ServerProbe.delta called before a round was sent")
        instruction = sent.instruction
        reply = s.server_update.train(instruction)
        full = _delta(_state(reply), _state(instruction))
        return {k: full[k] for k in keys}


def adaptive_limit(
    honest_norms: list[float],
    attackers: int,
    clip_ratio: float | None,
    screen_ratio: float,
) -> float:
    """The largest update norm the defence lets an attacker keep.

    The attackers put their own norms above every honest one, so the
    round's lower median (the ``ceil(k / 2)``-th smallest of all ``k``
    norms, what the clip and the screen use) is the honest norms' element
    ``(k - 1) // 2`` in ascending order, the highest the attackers can
    push it. A clipping defence keeps ``clip_ratio`` times that; any other,
    what the update-size screen lets through, ``screen_ratio`` times it.
    """
    k = len(honest_norms) + attackers
    median = sorted(honest_norms)[min((k - 1) // 2, len(honest_norms) - 1)]
    return median * (clip_ratio if clip_ratio is not None else screen_ratio)


def _state(message: Message) -> dict[str, torch.Tensor]:
    return record_to_state(message.content.array_records[protocol.ARRAYS])


def _delta(
    mine: Mapping[str, torch.Tensor], sent: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    out = {}
    for key, x in mine.items():
        ref = sent.get(key)
        base = ref.double() if ref is not None and ref.shape == x.shape else 0.0
        out[key] = x.double() - base
    return out


def _update(
    ref: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor]
) -> ClientUpdate:
    """What :class:`~fedlr.robust.rules.ProductSpace` measures: the sent arrays."""
    arrays = {k: ref[k].double() + d if k in ref else d for k, d in delta.items()}
    return ClientUpdate.of_arrays(arrays)


def _scaled(
    space: UpdateSpace,
    ref: Mapping[str, torch.Tensor],
    direction: Mapping[str, torch.Tensor],
    target: float,
) -> dict[str, torch.Tensor]:
    """``t * direction`` with the update-space norm ``target`` (bisection on t:
    a factor pair's product change is not linear in t)."""

    def norm(t: float) -> float:
        return space.norm(_update(ref, {k: t * d for k, d in direction.items()}))

    hi = 1.0
    while norm(hi) < target and hi < 1e12:
        hi *= 2.0
    lo = 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if norm(mid) < target else (lo, mid)
    return {k: lo * d for k, d in direction.items()}


def _reply(
    instruction: Message,
    reply: Message,
    arrays: Mapping[str, torch.Tensor],
    claim: int | None,
) -> Message:
    records = dict(reply.content)
    records[protocol.ARRAYS] = state_to_record(dict(arrays))
    if claim is not None:
        metrics = dict(reply.content.metric_records[protocol.METRICS])
        metrics[protocol.NUM_EXAMPLES] = claim
        records[protocol.METRICS] = MetricRecord(metrics)
    return Message(RecordDict(records), reply_to=instruction)


def plan(
    seeds: list[int],
    defences: list[str] | None = None,
    attackers: tuple[int, ...] = (1, 2),
    attacks: tuple[str, ...] = ATTACKS,
    clients: int = NUM_CLIENTS,
) -> dict[str, dict[str, Any]]:
    """Every run of the study, by name (``clients`` other than five are
    named in the clean runs' names too)."""
    runs: dict[str, dict[str, Any]] = {}
    for seed in seeds:
        for defence in defences or list(DEFENCES):
            if defence not in DEFENCES:
                raise ValueError(f"defence must be one of {list(DEFENCES)}")
            base = {"defence": defence, "seed": seed, "clients": clients}
            of = "" if clients == NUM_CLIENTS else f"of{clients}-"
            runs[f"clean-{of}{defence}-seed{seed}"] = {
                **base,
                "attack": "none",
                "attackers": 0,
            }
            for attack in attacks:
                for m in attackers:
                    runs[f"{attack}-{m}of{clients}-{defence}-seed{seed}"] = {
                        **base,
                        "attack": attack,
                        "attackers": m,
                    }
    return runs


def run(args: argparse.Namespace) -> None:
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs = plan(
        [int(s) for s in args.seeds.split(",")],
        args.defences.split(",") if args.defences else None,
        tuple(int(m) for m in args.attackers.split(",")),
        tuple(args.attacks.split(",")) if args.attacks else ATTACKS,
        args.clients,
    )
    index, count = (int(x) for x in args.shard.split("/"))
    finished = {row["run"] for row in _rows(out)}
    todo = [n for i, n in enumerate(runs) if i % count == index]
    todo = [n for n in todo if n not in finished]
    print(f"robustness: {len(todo)} runs to go in shard {args.shard}", flush=True)
    done = out / f"runs-{index}.jsonl"
    for number, name in enumerate(todo, 1):
        spec = runs[name]
        defence = DEFENCES[spec["defence"]]
        clients = spec["clients"]
        config = {
            "num-partitions": clients,
            "num-server-rounds": args.rounds,
            "eval-every": args.rounds,
            "output-dir": str(out / "runs" / name),
            "seed": spec["seed"],
            **parse_overrides(args.set),
            **defence,
        }
        hook, probe, server = None, None, None
        attackers: set[int] = set()
        if spec["attack"] != "none":
            method = resolve(config)  # robust = "auto" resolved, as the server does
            largest = build_plan(method).largest_partition
            cap = method.run.max_num_examples or (largest(clients) if largest else 0)
            attackers = attacker_partitions(
                spec["seed"], clients, spec["attackers"], args.placement
            )
            clips = method.run.robust == "norm-clip"
            if spec["attack"] == "adaptive" and method.run.heldout_check:
                probe = CheckProbe()
            if (
                spec["attack"] in ("adaptive", "minus-server")
                and method.run.server_update_share > 0
            ):
                server = ServerProbe()
            hook = Colluders(
                spec["attack"],
                attackers,
                cap,
                float(config.get("screen-ratio", DEFAULT_SCREEN_RATIO)),
                float(method.run.clip_ratio) if clips else None,
                probe,
                server,
            )
        start = time.perf_counter()
        observers = [p.attach for p in (probe, server, hook) if p is not None]

        def observe(strategy: Any, observers: list[Any] = observers) -> None:
            for attach in observers:
                attach(strategy)

        run_dir = run_in_process(config, round_hook=hook, observe=observe)
        frame = pd.read_csv(run_dir / "results.csv")
        accuracy = frame["accuracy"].dropna()
        row = {
            "run": name,
            **spec,
            "robust": defence["robust"],
            "placement": args.placement,
            "attacker-partitions": sorted(attackers),
            "final-accuracy": float(accuracy.iloc[-1]),
            "accuracy-by-round": [round(float(a), 4) for a in accuracy],
            "final-loss": float(frame["loss"].dropna().iloc[-1]),
            "dropped": int(frame["dropped"].sum()),
            "rejected-rounds": int(frame["rejected-rounds"].iloc[-1]),
            "clipped": int(_column(frame, "robust-clipped")),
            "trimmed": int(_column(frame, "robust-trimmed")),
            "capped": int(_column(frame, "robust-capped")),
            "attack-norm-ratio": (
                round(statistics.mean(a / h for a, h in hook.norms), 3)
                if hook is not None and hook.norms
                else None
            ),
            "left-out": int(_column(frame, "heldout-left-out")),
            "check-gain": (
                round(statistics.mean(g for g, _ in probe.gains), 5)
                if probe is not None and probe.gains
                else None
            ),
            "device": str(frame["device"].iloc[-1]) if "device" in frame else "",
            "seconds": round(time.perf_counter() - start, 1),
        }
        with done.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        print(f"[{number}/{len(todo)}] {json.dumps(row)}", flush=True)


def _column(frame: pd.DataFrame, name: str) -> float:
    return float(frame[name].fillna(0).sum()) if name in frame else 0.0


def _rows(out: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for path in sorted(out.glob("runs-*.jsonl")):
        rows.extend(json.loads(line) for line in path.read_text().splitlines())
    return rows


def _defences(rows: pd.DataFrame) -> list[str]:
    present = set(rows["defence"])
    return [d for d in DEFENCES if d in present] + sorted(present - set(DEFENCES))


def _settings(rows: pd.DataFrame) -> list[str]:
    attackers = sorted(
        {
            (int(m), int(n))
            for m, n in zip(rows["attackers"], rows["clients"], strict=True)
            if int(m) > 0
        },
        key=lambda mn: (mn[1], mn[0]),
    )
    present = set(rows["setting"])
    return [s for s in settings(attackers) if s in present]


def _grid(rows: pd.DataFrame, cell: Callable[[pd.DataFrame], str]) -> list[str]:
    """A markdown table: one row per setting, one column per defence, ``cell``
    of the runs of that setting and defence."""
    defences = _defences(rows)
    lines = [
        "| setting | " + " | ".join(f"`{d}`" for d in defences) + " |",
        "|---|" + "---|" * len(defences),
    ]
    for setting in _settings(rows):
        at = rows[rows["setting"] == setting]
        cells = [cell(at[at["defence"] == d]) for d in defences]
        lines.append(f"| {setting} | " + " | ".join(cells) + " |")
    return lines


def _accuracy(runs: pd.DataFrame) -> str:
    acc = runs["final-accuracy"]
    if len(acc) > 1:
        return f"{acc.mean():.3f} ± {acc.std(ddof=1):.3f} ({len(acc)})"
    return f"{acc.iloc[0]:.3f} (1)" if len(acc) else "—"


def _activity(runs: pd.DataFrame) -> str:
    if not len(runs):
        return "—"
    if "left-out" in runs:  # the held-out check's, beside a rule's trims
        runs = runs.assign(trimmed=runs["trimmed"] + runs["left-out"].fillna(0))
    return " / ".join(
        f"{runs[c].mean():.1f}" if c in runs else "—"
        for c in ("clipped", "capped", "trimmed", "dropped")
    )


def verdicts(rows: pd.DataFrame) -> pd.DataFrame:
    """Per defence: its clean accuracy, its clean cost against ``none``
    (paired over seeds), and each attacked setting's mean accuracy as a
    fraction of the defence's own clean mean, with the worst attack (the
    ``absent`` ceiling is not an attack and does not count)."""
    rows = _with_setting(rows)
    clean = rows[rows["setting"] == "clean"].pivot_table(
        index="seed", columns="defence", values="final-accuracy"
    )
    out = []
    for defence in _defences(rows):
        mine = rows[rows["defence"] == defence]
        base = float(mine[mine["setting"] == "clean"]["final-accuracy"].mean())
        entry: dict[str, Any] = {"defence": defence, "clean": base}
        if "none" in clean and defence in clean:
            diff = (clean[defence] - clean["none"]).dropna()
            entry["clean-cost"] = float(-diff.mean()) if len(diff) else math.nan
        fractions = {}
        for setting in _settings(rows):
            if setting == "clean":
                continue
            acc = mine[mine["setting"] == setting]["final-accuracy"]
            if len(acc):
                fractions[setting] = float(acc.mean()) / base
        entry.update(fractions)
        attacks = [v for k, v in fractions.items() if not k.startswith(CEILING)]
        entry["worst"] = min(attacks) if attacks else math.nan
        out.append(entry)
    return pd.DataFrame(out)


def summarise(rows: pd.DataFrame) -> str:
    """Mean ± std of the final accuracy per defence and setting, the
    fractions of clean accuracy kept, and clean costs."""
    rows = _with_setting(rows)
    lines = [
        *_grid(rows, _accuracy),
        "",
        "Replies clipped / weight-capped / left out by the rule or the "
        "held-out check / dropped by the server over the run, mean over seeds:",
        "",
        *_grid(rows, _activity),
        "",
        "Attacked mean accuracy over the defence's own clean mean, and the "
        "clean cost (`none`'s clean accuracy minus the defence's, paired "
        "over seeds; positive is a loss); `absent` (the attackers never "
        "reply) is the ceiling of any rule and not in the worst case:",
        "",
    ]
    table = verdicts(rows)
    attacked = [c for c in table.columns if "/" in c]
    lines.append(
        "| defence | clean | clean cost | " + " | ".join(attacked) + " | worst |"
    )
    lines.append("|---|---|---|" + "---|" * (len(attacked) + 1))
    for _, r in table.iterrows():
        cost = r.get("clean-cost", math.nan)
        lines.append(
            f"| `{r['defence']}` | {r['clean']:.3f} | "
            + (
                f"{cost:+.3f}"
                if r["defence"] != "none"
                and isinstance(cost, float)
                and math.isfinite(cost)
                else "—"
            )
            + " | "
            + " | ".join(f"{r[c]:.0%}" if pd.notna(r[c]) else "—" for c in attacked)
            + f" | {r['worst']:.0%} |"
        )
    return "\n".join(lines) + "\n"


def per_seed(rows: pd.DataFrame, defence: str, attackers: int, clients: int) -> str:
    """One defence against ``attackers`` of ``clients``, seed by seed: each
    attack's final accuracy, its share of the same seed's clean run (and the
    replies dropped, or for ``absent`` missing), and the lowest share over
    the seeds it ran on; the attackers' drawn partitions head each seed
    (docs/results/robustness.md's drawn-partition tables)."""
    rows = rows[(rows["defence"] == defence) & (rows["clients"] == clients)]
    clean = {int(r["seed"]): r for _, r in rows[rows["attack"] == "none"].iterrows()}
    attacked = rows[(rows["attack"] != "none") & (rows["attackers"] == attackers)]
    seeds = sorted(clean)
    partitions = {
        int(r["seed"]): ", ".join(f"p{p}" for p in r["attacker-partitions"])
        for _, r in attacked.iterrows()
    }
    head = [
        f"seed {s} ({partitions[s]})" if s in partitions else f"seed {s}" for s in seeds
    ]
    lines = [
        f"| attack ({attackers} of {clients}) | "
        + " | ".join(head)
        + " | lowest share of clean |",
        "|---|" + "---|" * (len(seeds) + 1),
        "| clean | "
        + " | ".join(f"{clean[s]['final-accuracy']:.4f}" for s in seeds)
        + " | — |",
    ]
    for attack in ATTACKS:
        runs = {
            int(r["seed"]): r
            for _, r in attacked[attacked["attack"] == attack].iterrows()
        }
        if not runs:
            continue
        cells, shares = [], []
        for seed in seeds:
            if seed not in runs:
                cells.append("not run")
                continue
            run = runs[seed]
            share = run["final-accuracy"] / clean[seed]["final-accuracy"]
            shares.append(share)
            dropped = f"; dropped {int(run['dropped'])}" if run["dropped"] else ""
            cells.append(f"{run['final-accuracy']:.4f} ({share:.1%}{dropped})")
        lowest = f"{min(shares):.1%} ({len(shares)} seed{'s' * (len(shares) > 1)})"
        lines.append(f"| {attack} | " + " | ".join(cells) + f" | {lowest} |")
    return "\n".join(lines) + "\n"


def _with_setting(rows: pd.DataFrame) -> pd.DataFrame:
    rows = rows.copy()
    if "defence" not in rows:
        rows["defence"] = rows["robust"]
    rows["defence"] = rows["defence"].fillna(rows["robust"])
    rows["clients"] = (
        rows["clients"].fillna(NUM_CLIENTS) if "clients" in rows else NUM_CLIENTS
    )
    rows["setting"] = [
        "clean" if a == "none" else f"{a} {m}/{int(n)}"
        for a, m, n in zip(
            rows["attack"], rows["attackers"], rows["clients"], strict=True
        )
    ]
    return rows


def figure(rows: pd.DataFrame, title: str = "") -> Figure:
    """Final accuracy per setting, one bar per defence (mean ± std over
    seeds), from 0; a defence named as a user sets it (:data:`LEGEND`), and
    its seeds named where it ran on fewer than the study's."""
    rows = _with_setting(rows)
    defences = _defences(rows)
    seeds = {d: sorted(set(rows[rows["defence"] == d]["seed"])) for d in defences}
    every = max(len(s) for s in seeds.values())
    rows_settings = _settings(rows)
    width = 0.8 / len(defences)
    fig, ax = plt.subplots(figsize=(11, 4.6))
    for i, defence in enumerate(defences):
        means, stds = [], []
        for setting in rows_settings:
            acc = rows[(rows["setting"] == setting) & (rows["defence"] == defence)]
            means.append(acc["final-accuracy"].mean())
            stds.append(acc["final-accuracy"].std(ddof=1) if len(acc) > 1 else 0.0)
        ax.bar(
            [
                x + (i - (len(defences) - 1) / 2) * width
                for x in range(len(rows_settings))
            ],
            means,
            width,
            yerr=stds,
            capsize=2,
            label=LEGEND.get(defence, defence)
            + (
                f" (seeds {', '.join(map(str, seeds[defence]))})"
                if len(seeds[defence]) < every
                else ""
            ),
        )
    ax.axhline(0.5, color="grey", linestyle=":", linewidth=1, label="one class")
    ax.set_xticks(range(len(rows_settings)))
    ax.set_xticklabels(rows_settings, rotation=20, ha="right")
    ax.set_ylabel("final accuracy (mean ± std over seeds)")
    ax.set_ylim(0.0, max(0.8, float(rows["final-accuracy"].max()) + 0.05))
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="defence")
    ax.grid(axis="y", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def table(args: argparse.Namespace) -> None:
    out = args.out.resolve()
    rows = pd.DataFrame(_rows(out))
    if rows.empty:
        raise SystemExit(f"robustness: no finished runs under {out}")
    rows.to_csv(out / "robustness.csv", index=False)
    text = summarise(rows)
    named = _with_setting(rows)
    pairs = zip(named["attackers"], named["clients"], strict=True)
    attacked = sorted({(int(n), int(m)) for m, n in pairs if m})  # (clients, m)
    for defence in _defences(named):
        for n, m in attacked:
            text += f"\n`{defence}`, seed by seed:\n\n"
            text += per_seed(named, defence, m, n)
    (out / "summary.md").write_text(text)
    figure(rows, args.title).savefig(
        out / "robustness.png", dpi=120, bbox_inches="tight"
    )
    print(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    go = sub.add_parser("run", help="run the grid (resumable)")
    go.add_argument("--out", type=Path, default=Path("outputs/robustness"))
    go.add_argument("--rounds", type=int, default=3)
    go.add_argument("--seeds", default="0,1,2,3,4")
    go.add_argument(
        "--defences", default="", help=f"comma-separated, of {list(DEFENCES)}"
    )
    go.add_argument("--attackers", default="1", help="colluders, e.g. 1,2")
    go.add_argument("--clients", type=int, default=NUM_CLIENTS)
    go.add_argument(
        "--placement",
        choices=("drawn", "last"),
        default="drawn",
        help="the attackers' partitions: drawn per seed, or the last ones",
    )
    go.add_argument("--attacks", default="", help=f"comma-separated, of {ATTACKS}")
    go.add_argument("--shard", default="0/1", help="I/N: every N-th run from I")
    go.add_argument(
        "--set",
        nargs="*",
        default=[],
        help="extra run-config values as for flwr run: 'key=value key2=\"text\"'",
    )
    show = sub.add_parser("table", help="tabulate the finished runs")
    show.add_argument("--out", type=Path, default=Path("outputs/robustness"))
    show.add_argument("--title", default="", help="the figure's title")
    args = parser.parse_args(argv)
    (run if args.command == "run" else table)(args)


if __name__ == "__main__":
    main()
