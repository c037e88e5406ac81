"""SecAgg+'s consistency round against a server that shows nodes different
survivor sets, as the attacker writes it.

The attacker is the server: :class:`SplitServer` runs fedlr's exchange up to
the masked vectors, then tells each node its own survivor set (at the
consistency round and at unmask) and forwards whatever signatures it holds.
From the shares it collects, :func:`unmasked_sums` lists every set of nodes
whose sum it can unmask: it needs the mask seed of each node in the set and,
for each pair (a node in the set, one outside), the key of one of the two.
A sum over fewer than ``t`` nodes carries less distributed-DP noise than
planned. Without the consistency check (the guard's check patched off) the
same server unmasks the sum of 2 nodes with no colluding client; with it,
none. The nodes run fedlr's ClientApp mod around a seeded handler.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
    Key,
    Stage,
)

from fedlr.client_apps.secagg import secagg_mod
from fedlr.client_apps.secagg_guard import (
    CONSISTENCY,
    GUARD_STATE,
    SIGN_RECORD,
    SIGNATURE,
    SIGNATURES,
    SIGNERS,
    SURVIVORS,
    _Book,
)
from fedlr.errors import NoValidRepliesError
from fedlr.flower import InProcessGrid
from fedlr.flower.records import record_to_state, state_to_record
from fedlr.privacy.client_dp import ClientDpLedger
from fedlr.privacy.secagg import SecAggSettings, sign_survivors, survivor_statement
from fedlr.privacy.settings import ClientDpSettings
from fedlr.round.pipeline import run_round
from fedlr.server_apps.secagg import SecAggPlusExchange
from fedlr.server_apps.secagg_unmask import Collected, RoundState
from fedlr.strategies.fot import FedAvgContinual
from fedlr.wire import protocol

SHAPES = {"w": (4, 3), "b": (4,)}
SEED = 31
SCALE = 20
"""The weight scale (max-num-examples); partition p holds 10 + p examples."""

app = ClientApp()


def client_arrays(partition: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(900 + partition)
    return {k: 0.1 * torch.randn(s, generator=gen) for k, s in SHAPES.items()}


@app.train(mods=[secagg_mod])
def train(message: Message, context: Context) -> Message:
    partition = int(context.node_config["partition-id"])
    content = RecordDict(
        {
            "arrays": state_to_record(client_arrays(partition)),
            "metrics": MetricRecord({protocol.NUM_EXAMPLES: 10 + partition}),
        }
    )
    return Message(content, reply_to=message)


def grid_of(nodes: int, **run_config: bool | float | int | str) -> InProcessGrid:
    return InProcessGrid(app, num_nodes=nodes, run_config={"seed": SEED, **run_config})


def strategy_of() -> FedAvgContinual:
    return FedAvgContinual(
        shapes=SHAPES, lr=1.0, max_num_examples=SCALE, fraction_evaluate=0.0
    )


def zeros() -> Any:
    return state_to_record({k: torch.zeros(s) for k, s in SHAPES.items()})


# ------------------------------------------------------------------ attacker
class SplitServer(SecAggPlusExchange):
    """fedlr's exchange up to the masked vectors; then each node is told
    ``views[node]`` as the survivor set, and gets the signatures the server
    holds over that set (``forward = "same"``) or every signature it holds
    (``"all"``). ``colluder`` hands the server its signing key and shares."""

    def __init__(
        self,
        *args: Any,
        views: Callable[[list[int], int], dict[int, list[int]]],
        forward: str = "same",
        colluder: int | None = None,
        grid: InProcessGrid,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.views = views
        self.forward = forward
        self.colluder = colluder
        self.grid = grid
        self.refusals: list[str] = []
        self.seeds: dict[int, dict[int, bytes]] = {}
        self.keys: dict[int, dict[int, bytes]] = {}
        self.told: dict[int, list[int]] = {}
        self.neighbours: dict[int, set[int]] = {}

    def _unmask(
        self, grid: Any, state: RoundState, collected: Collected, timeout: Any
    ) -> list[Message]:
        alive = sorted(collected.replies)
        self.told = self.views(alive, state.threshold)
        self.neighbours = {n: set(state.forward[n][0]) | {n} for n in alive}
        signed = self._signatures(grid, state)
        contents = {}
        for nid in signed[0]:
            view = self.told[nid]
            held = self.neighbours[nid]
            pool = [(s, v, sig) for (s, v), sig in signed[1].items() if s in held]
            if self.forward == "same":
                pool = [p for p in pool if p[1] == tuple(view)]
            contents[nid] = RecordDict(
                {
                    RECORD_KEY_CONFIGS: ConfigRecord(
                        {
                            Key.STAGE: Stage.UNMASK,
                            Key.ACTIVE_NODE_ID_LIST: sorted(held & set(view)),
                            Key.DEAD_NODE_ID_LIST: sorted(held - set(view)),
                        }
                    ),
                    SIGN_RECORD: ConfigRecord(
                        {
                            SURVIVORS: list(view),
                            SIGNERS: [s for s, _, _ in pool],
                            SIGNATURES: [sig for _, _, sig in pool],
                        }
                    ),
                }
            )
        got = self._send(grid, state, contents, timeout, Stage.UNMASK)
        self.refusals += list(state.errors.values())
        for holder, reply in got.items():
            out = reply.content.config_records[RECORD_KEY_CONFIGS]
            seeds = len(contents[holder][RECORD_KEY_CONFIGS][Key.ACTIVE_NODE_ID_LIST])
            pairs = zip(out[Key.NODE_ID_LIST], out[Key.SHARE_LIST], strict=True)
            for i, (owner, share) in enumerate(pairs):
                book = self.seeds if i < seeds else self.keys
                book.setdefault(int(owner), {})[holder] = cast(bytes, share)
        if self.colluder is not None:
            self._collude()
        return []

    def _signatures(
        self, grid: Any, state: RoundState
    ) -> tuple[list[int], dict[tuple[int, tuple[int, ...]], bytes]]:
        """Each node signs the view it is told; the colluder signs every view."""
        contents = {
            nid: RecordDict(
                {
                    RECORD_KEY_CONFIGS: ConfigRecord({Key.STAGE: CONSISTENCY}),
                    SIGN_RECORD: ConfigRecord({SURVIVORS: view}),
                }
            )
            for nid, view in self.told.items()
            if nid != self.colluder
        }
        got = self._send(grid, state, contents, None, CONSISTENCY)
        self.refusals += list(state.errors.values())
        out = {
            (nid, tuple(self.told[nid])): cast(
                bytes, reply.content.config_records[SIGN_RECORD][SIGNATURE]
            )
            for nid, reply in got.items()
        }
        if self.colluder is not None:
            guard = self.grid.contexts[self.colluder].state.config_records[GUARD_STATE]
            key = cast(bytes, guard[f"{state.number}|sign-key"])
            for view in {tuple(v) for v in self.told.values()}:
                run_id = next(iter(got.values())).metadata.run_id
                statement = survivor_statement(run_id, str(state.number), view)
                out[(self.colluder, view)] = sign_survivors(key, statement)
        return sorted(got), out

    def _collude(self) -> None:
        """The colluder's own shares of every node's secrets."""
        assert self.colluder is not None
        record = self.grid.contexts[self.colluder].state.config_records
        state = record[RECORD_KEY_STATE]
        for book, name in ((self.seeds, "rd_seed_share_dict"),
                           (self.keys, "sk1_share_dict")):  # fmt: skip
            owners = cast(list[int], state[f"{name}:K"])
            shares = cast(list[bytes], state[f"{name}:V"])
            for owner, share in zip(owners, shares, strict=True):
                book.setdefault(owner, {})[self.colluder] = share

    def rebuilt(self) -> tuple[set[int], set[int]]:
        """The nodes whose mask seed, and whose key, the server rebuilt (checked
        against the secrets the nodes hold)."""
        seeds, keys = set(), set()
        for nid in self.neighbours:
            state = self.grid.contexts[nid].state.config_records[RECORD_KEY_STATE]
            for book, truth, out in ((self.seeds, "rd_seed", seeds),
                                     (self.keys, "sk1", keys)):  # fmt: skip
                try:
                    if combine_shares(list(book.get(nid, {}).values())) == state[truth]:
                        out.add(nid)
                except Exception:  # too few or no shares
                    continue
        return seeds, keys


def unmasked_sums(server: SplitServer) -> list[tuple[int, ...]]:
    """Every proper subset of the nodes whose sum the server can unmask."""
    seeds, keys = server.rebuilt()
    nodes = sorted(server.neighbours)
    found = []
    for size in range(1, len(nodes)):
        for subset in itertools.combinations(nodes, size):
            inside = set(subset)
            if not inside <= seeds:
                continue
            pairs = ((v, w) for v in inside for w in server.neighbours[v] - inside)
            if all(v in keys or w in keys for v, w in pairs):
                found.append(subset)
    return found


def split_views(target: int = 2) -> Callable[[list[int], int], dict[int, list[int]]]:
    """The attack of the issue: every node is told the first ``target`` nodes
    survived, with itself and just enough others to reach ``t``, chosen so
    that every other node is told dropped by at least ``t`` nodes."""

    def views(alive: list[int], threshold: int) -> dict[int, list[int]]:
        core = alive[:target]
        rest = [n for n in alive if n not in core]
        rng = random.Random(0)
        for _ in range(10_000):
            told = {}
            for nid in alive:
                base = sorted({*core, nid})
                pool = [n for n in rest if n != nid]
                told[nid] = sorted(base + rng.sample(pool, threshold - len(base)))
            if all(sum(w not in v for v in told.values()) >= threshold for w in rest):
                return told
        raise AssertionError("no split of the survivor sets found")

    return views


def attack(
    nodes: int,
    views: Callable[[list[int], int], dict[int, list[int]]],
    *,
    forward: str = "same",
    colluder: int | None = None,
    settings: SecAggSettings | None = None,
    dp: ClientDpSettings | None = None,
    **run_config: bool | float | int | str,
) -> SplitServer:
    grid = grid_of(nodes, **run_config)
    strategy = strategy_of()
    strategy.client_dp_ledger = ClientDpLedger()
    server = SplitServer(
        settings or SecAggSettings(),
        strategy,
        seed=SEED,
        dp=dp,
        views=views,
        forward=forward,
        colluder=colluder,
        grid=grid,
    )
    with pytest.raises(NoValidRepliesError):
        run_round(strategy, grid, 1, zeros(), ConfigRecord({}), exchange=server)
    return server


def refused(server: SplitServer, check: str) -> int:
    return sum(f"secagg-guard:{check}" in reason for reason in server.refusals)


# --------------------------------------------------------------------- tests
@pytest.mark.parametrize("nodes", [5, 7])
def test_split_survivor_sets_unmask_no_sub_sum(nodes):
    server = attack(nodes, split_views())
    assert unmasked_sums(server) == []
    assert server.rebuilt() == (set(), set())
    assert refused(server, "signature-missing") == nodes  # each view: < t signers


@pytest.mark.parametrize("nodes", [5, 7])
def test_without_the_check_the_split_unmasks_two_nodes(nodes, monkeypatch):
    """Control: the issue's attack, with the guard's consistency check off."""
    monkeypatch.setattr(_Book, "check_consistent", lambda self, *args: None)
    server = attack(nodes, split_views())
    sums = unmasked_sums(server)
    assert (1000, 1001) in sums
    threshold = SecAggSettings().shares_and_threshold(nodes)[1]
    assert min(len(s) for s in sums) < threshold  # less noise than planned


def test_signatures_over_other_sets_are_refused_as_forged():
    server = attack(5, split_views(), forward="all")
    assert unmasked_sums(server) == []
    assert refused(server, "signature-forged") == 5


def everyone(alive: list[int], threshold: int) -> dict[int, list[int]]:
    return {n: alive for n in alive}


class Twice(SplitServer):
    """Asks every node to sign a second set (one node fewer) after the first."""

    second: list[str]

    def _signatures(self, grid: Any, state: RoundState) -> Any:
        out = super()._signatures(grid, state)
        contents = {}
        for nid, view in self.told.items():
            drop = view[-1] if nid != view[-1] else view[0]
            contents[nid] = RecordDict(
                {
                    RECORD_KEY_CONFIGS: ConfigRecord({Key.STAGE: CONSISTENCY}),
                    SIGN_RECORD: ConfigRecord(
                        {SURVIVORS: [n for n in view if n != drop]}
                    ),
                }
            )
        self._send(grid, state, contents, None, CONSISTENCY)
        self.second = list(state.errors.values())
        return out


def test_a_node_signs_one_survivor_set_per_round():
    grid = grid_of(5)
    strategy = strategy_of()
    server = Twice(SecAggSettings(), strategy, seed=SEED, views=everyone, grid=grid)
    with pytest.raises(NoValidRepliesError):  # the attacker's _unmask returns []
        run_round(strategy, grid, 1, zeros(), ConfigRecord({}), exchange=server)
    assert len(server.second) == 5
    assert all("secagg-guard:survivor-set" in e for e in server.second)
    # the first set, signed by all, is still unmasked as a whole: every seed
    assert server.rebuilt() == (set(server.neighbours), set())
    assert unmasked_sums(server) == []


# ------------------------------------------------- signatures, one by one
class Tampering(InProcessGrid):
    """Rewrites the consistency record of the exchange's unmask messages."""

    def __init__(self, change: Callable[[ConfigRecord], None], nodes: int) -> None:
        super().__init__(app, num_nodes=nodes, run_config={"seed": SEED})
        self.change = change
        self.errors: list[str] = []

    def send_and_receive(self, messages, *, timeout=None):  # type: ignore[no-untyped-def]
        sent = list(messages)
        for message in sent:
            configs = message.content.config_records.get(RECORD_KEY_CONFIGS, {})
            if configs.get(Key.STAGE) == Stage.UNMASK:
                self.change(message.content.config_records[SIGN_RECORD])
        replies = list(super().send_and_receive(sent, timeout=timeout))
        self.errors += [r.error.reason for r in replies if r.has_error()]
        return replies


def honest_round(grid: InProcessGrid, nodes: int) -> dict[str, torch.Tensor]:
    strategy = strategy_of()
    exchange = SecAggPlusExchange(SecAggSettings(), strategy, seed=SEED)
    new = run_round(strategy, grid, 1, zeros(), ConfigRecord({}), exchange=exchange)
    return record_to_state(new)


def forge(record: ConfigRecord) -> None:
    texts = list(record[SIGNATURES])
    texts[0] = bytes(64)
    record[SIGNATURES] = texts


def duplicate(record: ConfigRecord) -> None:
    record[SIGNERS] = [*record[SIGNERS], record[SIGNERS][0]]
    record[SIGNATURES] = [*record[SIGNATURES], record[SIGNATURES][0]]


def missing(record: ConfigRecord) -> None:
    record[SIGNERS] = list(record[SIGNERS])[:2]
    record[SIGNATURES] = list(record[SIGNATURES])[:2]


def other_set(record: ConfigRecord) -> None:
    record[SURVIVORS] = list(record[SURVIVORS])[:-1]


@pytest.mark.parametrize(
    ("change", "check"),
    [
        (forge, "signature-forged"),
        (duplicate, "signature-duplicate"),
        (missing, "signature-missing"),
        (other_set, "survivor-set"),
    ],
)
def test_bad_signatures_are_refused_by_name(change, check):
    grid = Tampering(change, 5)
    kept = honest_round(grid, 5)  # no shares: the round is rejected
    assert all(float(v.abs().max()) == 0.0 for v in kept.values())
    assert sum(f"secagg-guard:{check}" in e for e in grid.errors) == 5
    assert len(grid.errors) == 5


@pytest.mark.parametrize("nodes", [5, 7])
def test_the_honest_protocol_still_gives_the_exact_sum(nodes):
    result = honest_round(grid_of(nodes), nodes)
    weights = [10 + p for p in range(nodes)]
    for key in SHAPES:
        exact = sum(
            w / SCALE * client_arrays(p)[key].double() for p, w in enumerate(weights)
        ) / (sum(weights) / SCALE)
        bound = SecAggSettings().step() * nodes / (sum(weights) / SCALE)
        assert float((result[key].double() - exact).abs().max()) < bound


# ------------------------------------------------------ colluders, the limit
def victim_views(alive: list[int], threshold: int) -> dict[int, list[int]]:
    """The colluder (the last node) signs every set. Group A (the victim, node
    1000, and ``t - 2`` others) is told A plus the colluder; group B (the rest)
    is told B plus the colluder, filled up to ``t`` from A without the victim:
    the victim dropped."""
    colluder, honest = alive[-1], alive[:-1]
    group_a, group_b = honest[: threshold - 1], honest[threshold - 1 :]
    fill = [n for n in group_a[1:]][: max(threshold - len(group_b) - 1, 0)]
    view_b = sorted([*group_b, colluder, *fill])
    return {
        **{n: sorted([*group_a, colluder]) for n in group_a},
        **{n: view_b for n in group_b},
    }


@pytest.mark.parametrize(("threshold", "rebuilt"), [(4, True), (5, False)])
def test_one_colluder_needs_2t_minus_n_above_1(threshold, rebuilt):
    """7 nodes, one colluding client that signs every set and hands over its
    shares: at t = 4 (2t - n = 1, not above 1 colluder) the victim's two
    secrets are rebuilt even with the check (the documented limit); at t = 5
    (2t - n = 3) group B cannot gather t signatures and they are not."""
    settings = SecAggSettings(reconstruction_threshold=float(threshold))
    server = attack(7, victim_views, colluder=1006, settings=settings)
    seeds, keys = server.rebuilt()
    assert (1000 in seeds and 1000 in keys) is rebuilt
    if not rebuilt:
        assert refused(server, "signature-missing") == 7 - threshold


# --------------------------------------------------------- distributed DP
def test_under_the_split_no_sum_with_less_noise_than_planned():
    """Distributed DP sizes each node's noise for t survivors: a sum of fewer
    than t nodes would carry less. Under the split, nothing is unmasked."""
    dp = ClientDpSettings(clip=1.0, noise_multiplier=1.0)
    run_config: dict[str, bool | float | int | str] = {
        "client-dp-clip": 1.0,
        "client-dp-noise-multiplier": 1.0,
        "secagg-clipping-range": 16.0,
    }
    for nodes in (5, 7):
        server = attack(
            nodes,
            split_views(),
            settings=SecAggSettings(clipping_range=16.0),
            dp=dp,
            **run_config,
        )
        threshold = SecAggSettings().shares_and_threshold(nodes)[1]
        assert [s for s in unmasked_sums(server) if len(s) < threshold] == []
        assert unmasked_sums(server) == []
        assert refused(server, "signature-missing") == nodes
