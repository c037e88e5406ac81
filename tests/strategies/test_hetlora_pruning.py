"""HetLoRA's rank self-pruning (``hetlora-prune-gamma``, ``hetlora-prune-lambda``).

The client side (:func:`fedlr.client.round.apply_round`,
:func:`fedlr.client.pruning.tail_norm`)
against dense float64 formulas on a small peft model; the decision rule; the
server's acceptance of lower ranks (mocked replies); whole federations of the
tiny BERT with ranks {2, 4, 8, 16}.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict

import pandas as pd
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from peft import LoraConfig, get_peft_model

from fedlr.adapters import AdapterLayout, LoraModule, Role, parameters_by_key
from fedlr.adapters.lora import adapter_state, lora_layout
from fedlr.adapters.ranks import leading_rank, pruned_rank
from fedlr.client.pruning import PRUNE_GAMMA, PRUNE_LAMBDA, RANK_STATE
from fedlr.client.round import RankPruning, apply_round, tail_norm
from fedlr.errors import ConfigError, ProtocolError
from fedlr.flower import InProcessGrid
from fedlr.flower.records import record_to_state, state_to_record
from fedlr.launch.local import run_in_process
from fedlr.strategies.fedprox_lora import PROXIMAL_MU
from fedlr.strategies.hetero import layout_at_rank
from fedlr.strategies.hetlora import HetLoRA
from fedlr.strategies.registry import resolve
from fedlr.wire import protocol
from tests.conftest import tiny_run_config
from tests.strategies.conftest import reply

ALPHA = 8.0
F64 = torch.float64


# ------------------------------------------------------------------ a small model
class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 10)
        self.fc2 = torch.nn.Linear(10, 12)
        self.classifier = torch.nn.Linear(12, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _model(rank: int):
    torch.manual_seed(0)
    config = LoraConfig(
        r=rank,
        lora_alpha=ALPHA,
        target_modules=["fc1", "fc2"],
        modules_to_save=["classifier"],
    )
    return get_peft_model(_Net(), config)


def _randomise(model, seed: int = 1) -> None:
    """Random A and B (peft starts B at 0, whose tail has norm 0)."""
    g = torch.Generator().manual_seed(seed)
    layout = lora_layout(model)
    params = parameters_by_key(model, layout)
    with torch.no_grad():
        for m in layout.modules:
            for key in (m.a_key, m.b_key):
                params[key].copy_(torch.randn(params[key].shape, generator=g))


def _dense_tail(factors, start: int) -> torch.Tensor:
    """``sum_layers s ||B[:, start:] A[start:]||_F`` from the dense product."""
    return sum(
        s * torch.linalg.matrix_norm(b[:, start:] @ a[start:]) for s, a, b in factors
    )


def _message(content: RecordDict, node_id: int = 1000) -> Message:
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 0
    message = Message(content=content, dst_node_id=node_id, message_type="train")
    message.metadata.__dict__["_message_id"] = f"prune-{node_id}"
    return message


def _context(node_id: int = 1000) -> Context:
    return Context(
        run_id=1,
        node_id=node_id,
        node_config={"partition-id": 0, "num-partitions": 1},
        state=RecordDict(),
        run_config={},
    )


def _instruction(
    gamma: float = 0.5, lam: float = 0.3, rank: int = 8, node_id: int = 1000
) -> tuple[Message, dict[str, torch.Tensor], AdapterLayout]:
    """A HetLoRA train instruction at the global rank ``rank``, random A, B."""
    server = _model(rank)
    _randomise(server)
    layout = lora_layout(server)
    strategy = HetLoRA(
        layout=layout,
        client_ranks=(2, 4, rank),
        hetlora_prune_gamma=gamma,
        hetlora_prune_lambda=lam,
    )
    arrays = adapter_state(server, layout, strategy.send_roles)
    config = strategy.begin_round(1, state_to_record(arrays), ConfigRecord())
    config[protocol.SERVER_ROUND] = 1
    content = RecordDict(
        {protocol.ARRAYS: state_to_record(arrays), protocol.CONFIG: config}
    )
    return _message(content, node_id), arrays, layout


# ------------------------------------------------------------ (a) the regulariser
def test_tail_norm_value_and_gradient_match_dense_float64():
    model = _model(6)
    _randomise(model)
    layout = lora_layout(model)
    params = parameters_by_key(model, layout)
    value = tail_norm(model, 3)
    value.backward()
    dense = [
        (
            m.scaling,
            params[m.a_key].detach().to(F64).requires_grad_(),
            params[m.b_key].detach().to(F64).requires_grad_(),
        )
        for m in layout.modules
    ]
    want = _dense_tail(dense, 3)
    want.backward()
    assert float(value.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    assert float(tail_norm(model, 3, dtype=F64).detach()) == pytest.approx(
        float(want.detach()), rel=1e-12
    )
    for m, (_, a, b) in zip(layout.modules, dense, strict=True):
        got_a, got_b = params[m.a_key].grad, params[m.b_key].grad
        torch.testing.assert_close(got_a, a.grad.float(), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(got_b, b.grad.float(), rtol=1e-4, atol=1e-6)
        # The leading components are not in the term.
        assert float(got_a[:3].abs().max()) == 0.0
        assert float(got_b[:, :3].abs().max()) == 0.0
    assert float(tail_norm(model, 6)) == 0.0  # no layer has a component 6


def test_a_zero_tail_has_norm_zero_and_gradient_zero_not_nan():
    model = _model(4)  # peft's B = 0
    layout = lora_layout(model)
    params = parameters_by_key(model, layout)
    value = tail_norm(model, 2)
    value.backward()
    assert float(value.detach()) == 0.0
    for m in layout.modules:
        for key in (m.a_key, m.b_key):
            grad = params[key].grad
            assert grad is not None and bool(torch.isfinite(grad).all())
            assert float(grad.abs().max()) == 0.0


def test_the_penalty_is_lambda_times_the_received_tail_norm():
    """A rank-4 client of a rank-8 HetLoRA server, gamma 0.5: tail = [2, 4)."""
    instruction, arrays, layout = _instruction(gamma=0.5, lam=0.3)
    client = _model(4)
    job = apply_round(client, instruction, _context())
    assert job.pruning == RankPruning(
        gamma=0.5, lam=0.3, rank=4, keep=2, before=job.pruning.before
    )
    # Received: the leading 4 of 8 components times sqrt(4 / 8), scaling
    # alpha / 4, so the tail [2, 4) contributes (alpha / 8) B8[:, 2:4] A8[2:4].
    want = sum(
        (ALPHA / 8)
        * torch.linalg.matrix_norm(
            arrays[m.b_key].to(F64)[:, 2:4] @ arrays[m.a_key].to(F64)[2:4]
        )
        for m in layout.modules
    )
    assert job.pruning.before == pytest.approx(float(want), rel=1e-6)
    assert job.has_penalty
    penalty = job.penalty()
    assert float(penalty.detach()) == pytest.approx(0.3 * float(want), rel=1e-5)
    penalty.backward()
    view = lora_layout(client)
    params = parameters_by_key(client, view)
    for m in view.modules:
        a = params[m.a_key].detach().to(F64).requires_grad_()
        b = params[m.b_key].detach().to(F64).requires_grad_()
        (0.3 * _dense_tail([(m.scaling, a, b)], 2)).backward()
        torch.testing.assert_close(
            params[m.b_key].grad, b.grad.float(), rtol=1e-4, atol=1e-7
        )
        torch.testing.assert_close(
            params[m.a_key].grad, a.grad.float(), rtol=1e-4, atol=1e-7
        )


def test_no_pruning_term_at_lambda_zero_or_gamma_one():
    instruction, _, _ = _instruction(gamma=0.5, lam=0.0)
    job = apply_round(_model(4), instruction, _context())
    assert job.pruning is not None and job.pruning.before > 0
    assert not job.has_penalty and float(job.penalty()) == 0.0
    instruction, _, _ = _instruction(gamma=1.0, lam=0.3)
    assert PRUNE_GAMMA not in instruction.content["config"]
    job = apply_round(_model(4), instruction, _context())
    assert job.pruning is None and not job.has_penalty
    answer = job.reply(num_examples=3)
    assert protocol.RANK_PRUNED not in answer.content["metrics"]


def test_the_penalty_adds_fedprox_and_pruning_terms():
    instruction, _, _ = _instruction(gamma=0.5, lam=0.3)
    instruction.content["config"][PROXIMAL_MU] = 0.2
    client = _model(4)
    job = apply_round(client, instruction, _context())
    layout = lora_layout(client)
    params = parameters_by_key(client, layout)
    trained = [params[k] for k in layout.keys(Role.LORA_A, Role.LORA_B, Role.HEAD)]
    before = [p.detach().clone() for p in trained]
    with torch.no_grad():
        for p in trained:
            p.add_(0.01)
    moved = sum(
        float((p.detach() - q).pow(2).sum())
        for p, q in zip(trained, before, strict=True)
    )
    tail = float(tail_norm(client, 2, dtype=F64).detach())
    assert float(job.penalty().detach()) == pytest.approx(
        0.5 * 0.2 * moved + 0.3 * tail, rel=1e-5
    )


# ------------------------------------------------------------ (b) the decision
@pytest.mark.parametrize(
    ("rank", "gamma", "want"),
    [
        (16, 0.5, 8),
        (8, 0.5, 4),
        (2, 0.5, 1),
        (3, 0.5, 1),
        (1, 0.5, 1),  # the floor at 1: nothing to prune
        (5, 0.1, 1),  # floor(0.5) = 0 -> 1
        (10, 0.7, 7),
        (100, 0.57, 57),  # 0.57 * 100 = 56.99999999999999
        (16, 1.0, 16),
    ],
)
def test_pruned_rank_rule(rank, gamma, want):
    assert pruned_rank(rank, gamma) == want


@pytest.mark.parametrize(("rank", "gamma"), [(4, 0.0), (4, 1.5), (4, -0.5), (0, 0.5)])
def test_pruned_rank_refuses_bad_input(rank, gamma):
    with pytest.raises(ProtocolError):
        pruned_rank(rank, gamma)


def test_decide_prunes_only_when_the_tail_norm_went_down():
    p = RankPruning(gamma=0.5, lam=0.1, rank=8, keep=4, before=1.0)
    assert p.decide(0.999) == 4
    assert p.decide(1.0) == 8  # not down: kept
    assert p.decide(1.5) == 8
    one = RankPruning(gamma=0.5, lam=0.1, rank=1, keep=1, before=1.0)
    assert not one.can_prune and one.decide(0.0) == 1


def _scale_tail(model, start: int, factor: float) -> None:
    layout = lora_layout(model)
    params = parameters_by_key(model, layout)
    with torch.no_grad():
        for m in layout.modules:
            params[m.b_key][:, start:] *= factor


def _a_rank(message: Message, keys: tuple[str, ...] = ()) -> dict[str, int]:
    """The rank of every ``A`` of the message (``keys``, else peft's)."""
    arrays = message.content.array_records[protocol.ARRAYS]
    return {
        k: int(v.shape[0])
        for k, v in arrays.items()
        if (k in keys if keys else k.endswith("lora_A.weight"))
    }


def test_a_shrunk_tail_replies_at_the_pruned_rank_and_keeps_it():
    instruction, _, layout = _instruction(gamma=0.5, lam=0.3)
    context = _context()
    client = _model(4)
    job = apply_round(client, instruction, context)
    _scale_tail(client, 2, 0.5)  # "training" shrank the tail
    trained = adapter_state(client, lora_layout(client), (Role.LORA_A, Role.LORA_B))
    answer = job.reply(num_examples=5)
    assert answer.content["metrics"][protocol.RANK_PRUNED] == 1
    assert set(_a_rank(answer).values()) == {2}
    got = record_to_state(answer.content.array_records[protocol.ARRAYS])
    gain = math.sqrt(2 / 4)  # (alpha / 2) B' A' is the kept part of (alpha / 4) B A
    for m in layout.modules:
        torch.testing.assert_close(got[m.a_key], gain * trained[m.a_key][:2])
        torch.testing.assert_close(got[m.b_key], gain * trained[m.b_key][:, :2])
    assert context.state.config_records[RANK_STATE]["rank"] == 2

    # Next round: a model built at the node's configured rank 4 (or a shared
    # one, with rank=4) is conformed to the kept rank 2; the tail is [1, 2).
    fresh = _model(4)
    job = apply_round(fresh, _instruction()[0], context, rank=4)
    assert [(c.old_rank, c.rank) for c in job.changes] == [(4, 2), (4, 2)]
    assert (job.pruning.rank, job.pruning.keep) == (2, 1)
    # The same model object serves another node of rank 4: it gets 4 back.
    other = apply_round(fresh, _instruction(node_id=1001)[0], _context(1001), rank=4)
    assert [(c.old_rank, c.rank) for c in other.changes] == [(2, 4), (2, 4)]
    assert other.pruning.rank == 4


def test_a_grown_tail_keeps_the_rank():
    instruction, _, _ = _instruction(gamma=0.5, lam=0.3)
    context = _context()
    client = _model(4)
    job = apply_round(client, instruction, context)
    _scale_tail(client, 2, 2.0)
    answer = job.reply(num_examples=5)
    assert answer.content["metrics"][protocol.RANK_PRUNED] == 0
    assert set(_a_rank(answer).values()) == {4}
    assert RANK_STATE not in context.state.config_records


def test_a_node_that_lost_its_kept_rank_takes_the_servers():
    """The server sends a known node only its pruned rank's components."""
    instruction, arrays, layout = _instruction(gamma=0.5, lam=0.3)
    narrow = leading_rank(layout_at_rank(layout, 2), arrays)
    content = RecordDict(
        {
            protocol.ARRAYS: state_to_record(narrow),
            protocol.CONFIG: instruction.content["config"],
        }
    )
    context = _context()
    job = apply_round(_model(4), _message(content), context, rank=4)
    assert job.pruning.rank == 2
    assert context.state.config_records[RANK_STATE]["rank"] == 2


def test_a_bad_pruning_instruction_is_refused():
    instruction, _, _ = _instruction()
    config = instruction.content["config"]
    config[PRUNE_GAMMA] = 1.5
    with pytest.raises(ProtocolError, match="'prune-gamma' must be in"):
        apply_round(_model(4), instruction, _context())
    config[PRUNE_GAMMA] = 0.5
    config[PRUNE_LAMBDA] = -1.0
    with pytest.raises(ProtocolError, match="'prune-lambda' must be finite"):
        apply_round(_model(4), instruction, _context())
    config[PRUNE_LAMBDA] = 0.1
    del config[protocol.LEADING_RANK]
    with pytest.raises(ProtocolError, match="without 'leading-rank'"):
        apply_round(_model(8), instruction, _context())


# ------------------------------------------------------------ (d) the server
R = 8
D_OUT, D_IN = 12, 10
A_KEYS = ("l0.A", "l1.A")


def _layout(rank: int = R) -> AdapterLayout:
    return AdapterLayout(
        modules=(
            LoraModule("l0", "l0.A", "l0.B", "l0.W", ALPHA / rank, D_OUT, D_IN, rank),
            LoraModule("l1", "l1.A", "l1.B", "l1.W", ALPHA / rank, D_IN, D_OUT, rank),
        ),
        head_shapes={"head.w": (2, D_IN)},
    )


def _arrays(rank: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = layout_at_rank(_layout(), rank).shapes(Role.LORA_A, Role.LORA_B, Role.HEAD)
    return {k: torch.randn(*s, generator=g) for k, s in shapes.items()}


def _round(strategy, server_round, current, ranks):
    """Node ``1000 + i`` replies at ``ranks[i]``; returns messages and metrics."""
    grid = InProcessGrid(ClientApp(), num_nodes=len(ranks), run_config={})
    messages = list(
        strategy.configure_train(
            server_round,
            ArrayRecord({k: current[k] for k in strategy.send_keys()}),
            ConfigRecord(),
            grid,
        )
    )
    messages.sort(key=lambda msg: int(msg.metadata.dst_node_id))
    replies = [
        reply(
            int(msg.metadata.dst_node_id),
            _arrays(r, 10 * server_round + i),
            {"num-examples": 10},
        )
        for i, (msg, r) in enumerate(zip(messages, ranks, strict=True))
    ]
    arrays, metrics = strategy.aggregate_train(server_round, replies)
    return messages, record_to_state(arrays), metrics


def test_the_server_accepts_lower_ranks_and_drops_a_grown_one(caplog):
    strategy = HetLoRA(
        layout=_layout(),
        client_ranks=(4, R),
        hetlora_prune_gamma=0.5,
        hetlora_prune_lambda=0.1,
    )
    assert strategy.extra_columns[-2:] == ("mean-client-rank", "pruned-clients")
    config = strategy.round_config(1)
    assert (config[PRUNE_GAMMA], config[PRUNE_LAMBDA]) == (0.5, 0.1)
    current = _arrays(R, 0)
    _, current, metrics = _round(strategy, 1, current, [4, R])
    assert (metrics["clients"], metrics["dropped"]) == (2, 0)
    assert metrics["mean-client-rank"] == 6.0 and metrics["pruned-clients"] == 0
    # Round 2: node 1001 pruned 8 -> 3 (not a configured rank: accepted);
    # node 1000 replies at 8 > its 4: dropped, naming the node.
    with caplog.at_level(logging.WARNING, logger="flwr"):
        messages, current, metrics = _round(strategy, 2, current, [R, 3])
    assert _a_rank(messages[0], A_KEYS) == {"l0.A": 4, "l1.A": 4}  # its known rank
    assert (metrics["clients"], metrics["dropped"]) == (1, 1)
    assert metrics["pruned-clients"] == 1 and metrics["mean-client-rank"] == 3.0
    dropped = [m for m in caplog.messages if "dropped a reply" in m]
    assert len(dropped) == 1
    assert "node 1000" in dropped[0] and "rank 8 grew from 4" in dropped[0]
    assert strategy.node_ranks == {1000: 4, 1001: 3}
    # Round 3: node 1001 is sent its 3 components; equal ranks are no pruning.
    messages, _, metrics = _round(strategy, 3, current, [4, 3])
    assert _a_rank(messages[1], A_KEYS) == {"l0.A": 3, "l1.A": 3}
    assert (metrics["dropped"], metrics["pruned-clients"]) == (0, 0)
    # Every configured rank still has its gap column; rank 3 has none.
    assert "gap-rank-4" in metrics and "gap-rank-3" not in metrics


def test_without_pruning_only_client_ranks_are_accepted(caplog):
    strategy = HetLoRA(layout=_layout(), client_ranks=(4, R))
    assert "pruned-clients" not in strategy.extra_columns
    assert PRUNE_GAMMA not in strategy.round_config(1)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        _, _, metrics = _round(strategy, 1, _arrays(R, 0), [4, 3])
    assert metrics["dropped"] == 1 and "pruned-clients" not in metrics
    assert any("rank 3 is not one of the client ranks" in m for m in caplog.messages)


# ------------------------------------------------------------ (e) options
@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("hetlora-prune-gamma", 0.0, r"in \(0, 1\]"),
        ("hetlora-prune-gamma", 1.01, r"in \(0, 1\]"),
        ("hetlora-prune-gamma", -0.5, r"in \(0, 1\]"),
        ("hetlora-prune-gamma", float("nan"), r"in \(0, 1\]"),
        ("hetlora-prune-lambda", -0.01, "finite and >= 0"),
        ("hetlora-prune-lambda", float("inf"), "finite and >= 0"),
    ],
)
def test_bad_options_are_refused_naming_the_key(key, value, message):
    with pytest.raises(ConfigError, match=message) as info:
        resolve({"method": "hetlora", key: value})
    assert info.value.key == key and f"'{key}'" in str(info.value)
    with pytest.raises(ConfigError) as info:  # the same check by field name
        HetLoRA(layout=_layout(), **{key.replace("-", "_"): value})
    assert info.value.key == key


def test_options_reach_the_strategy():
    parsed = resolve(
        {
            "method": "hetlora",
            "client-ranks": "4,8",
            "hetlora-prune-gamma": 0.75,
            "hetlora-prune-lambda": 0.5,
        }
    )
    strategy = HetLoRA.from_run_config(
        parsed.run.replace(lora_rank=8), _layout(), parsed.options
    )
    assert (strategy.prune_gamma, strategy.prune_lambda) == (0.75, 0.5)
    assert resolve({"method": "hetlora"}).options.to_mapping() == {
        "hetlora-prune-gamma": 1.0,
        "hetlora-prune-lambda": 0.1,
    }


# ------------------------------------------------------------ (c) federations
RANKS = (2, 4, 8, 16)
FEDERATION = {"client-ranks": "2,4,8,16", "local-steps": 2}
PRUNING = {"hetlora-prune-gamma": 0.5, "hetlora-prune-lambda": 1.0}


class _Log:
    """Every round's instruction and reply rank per partition (a reply hook)."""

    def __init__(self) -> None:
        self.sent: dict[int, dict[int, int]] = defaultdict(dict)
        self.ranks: dict[int, dict[int, int]] = defaultdict(dict)
        self.pruned: dict[int, dict[int, int]] = defaultdict(dict)
        self.keys: set[str] = set()

    def __call__(self, partition: int, instruction: Message, answer: Message):
        config = instruction.content["config"]
        server_round = int(config[protocol.SERVER_ROUND])
        self.keys.update(config.keys())
        (sent,) = set(_a_rank(instruction).values())
        self.sent[server_round][partition] = sent
        if not answer.has_error():
            (rank,) = set(_a_rank(answer).values())
            self.ranks[server_round][partition] = rank
            metrics = answer.content["metrics"]
            self.pruned[server_round][partition] = int(
                metrics.get(protocol.RANK_PRUNED, -1)
            )
        return answer


def _federation(tmp_path, hook, **overrides) -> pd.DataFrame:
    config = tiny_run_config(tmp_path, method="hetlora", **{**FEDERATION, **overrides})
    return pd.read_csv(run_in_process(config, reply_hook=hook) / "results.csv")


@pytest.mark.usefixtures("assets")
def test_clients_prune_their_rank_in_a_federation(tmp_path):
    """8 nodes, two per rank: nodes of one rank share the ClientApp's model."""
    log = _Log()
    frame = _federation(
        tmp_path, log, **PRUNING, **{"num-partitions": 8, "num-server-rounds": 4}
    )
    assert frame["round"].tolist() == [1, 2, 3, 4]
    assert (frame["clients"] == 8).all() and (frame["dropped"] == 0).all()
    assert frame["accuracy"].between(0, 1).all()
    configured = {p: RANKS[p % 4] for p in range(8)}
    previous = dict(configured)
    decreases = 0
    for server_round in (1, 2, 3, 4):
        ranks, pruned = log.ranks[server_round], log.pruned[server_round]
        assert set(ranks) == set(range(8))
        for p, rank in ranks.items():
            # Sent the node's known rank (round 1: the global 16).
            sent = log.sent[server_round][p]
            assert sent == (16 if server_round == 1 else previous[p])
            if pruned[p]:
                assert rank == max(1, previous[p] // 2) < previous[p]
                decreases += 1
            else:  # a node trains at its own rank, whatever its model served
                assert rank == previous[p]
            previous[p] = rank
        row = frame.iloc[server_round - 1]
        assert row["pruned-clients"] == sum(pruned.values())
        assert row["mean-client-rank"] == pytest.approx(sum(ranks.values()) / 8)
    # B starts at 0: nothing to prune in round 1; some node prunes by round 3.
    assert frame.loc[0, "pruned-clients"] == 0
    assert frame["pruned-clients"].iloc[:3].sum() >= 1
    assert decreases == frame["pruned-clients"].sum()
    assert any(previous[p] < configured[p] for p in range(8))
    for r in RANKS:
        assert (frame[f"gap-rank-{r}"] >= 0).all()


@pytest.mark.usefixtures("assets")
def test_pruning_off_gives_todays_results(tmp_path):
    """``hetlora-prune-gamma = 1`` (with any lambda) is the run without the keys."""
    plain_log, off_log = _Log(), _Log()
    plain = _federation(tmp_path / "plain", plain_log, **{"num-partitions": 4})
    off = _federation(
        tmp_path / "off",
        off_log,
        **{"num-partitions": 4, "hetlora-prune-gamma": 1.0},
        **{"hetlora-prune-lambda": 5.0},
    )
    for log in (plain_log, off_log):
        assert PRUNE_GAMMA not in log.keys
        assert PRUNE_LAMBDA not in log.keys
    assert list(off.columns) == list(plain.columns)
    assert "pruned-clients" not in plain.columns
    timing = [c for c in plain.columns if "seconds" in c]
    pd.testing.assert_frame_equal(
        off.drop(columns=timing), plain.drop(columns=timing), check_exact=True
    )
    assert plain_log.ranks == off_log.ranks
    assert plain_log.ranks[2] == {0: 2, 1: 4, 2: 8, 3: 16}
