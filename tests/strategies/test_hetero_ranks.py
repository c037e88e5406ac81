"""Federations whose clients train ranks {2, 4, 8, 16} (in process, tiny BERT).

Also FedSpec with heterogeneous ranks (:class:`fedlr.strategies.HeteroFedSpec`)
on mocked replies against dense float64.
"""

from __future__ import annotations

import logging
import math

import pandas as pd
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.clientapp import ClientApp

from fedlr.adapters import AdapterLayout, LoraModule, Role
from fedlr.adapters.ranks import fold_tail, leading_rank
from fedlr.config.run import RunConfig
from fedlr.errors import ConfigError
from fedlr.flower import InProcessGrid
from fedlr.flower.records import record_to_state, state_to_record
from fedlr.launch.local import run_in_process
from fedlr.strategies.fedex_downlink import DownlinkOptions
from fedlr.strategies.fedex_lora import FedExLoRA, HeteroFedExLoRA
from fedlr.strategies.fedspec import FedSpec, HeteroFedSpec, layout_at_rank
from fedlr.strategies.registry import available_methods, get_method
from tests.conftest import tiny_run_config
from tests.strategies.conftest import instruction, reply

RANKS = (2, 4, 8, 16)
HETERO = {"client-ranks": "2,4,8,16", "num-partitions": 4, "local-steps": 2}


def _run(tmp_path, method, reply_hook=None, **overrides):
    config = tiny_run_config(tmp_path, method=method, **{**HETERO, **overrides})
    run_dir = run_in_process(config, reply_hook=reply_hook)
    return pd.read_csv(run_dir / "results.csv")


@pytest.mark.usefixtures("assets")
@pytest.mark.parametrize(
    "method", ["flexlora", "hetlora", "flora", "fedspec", "fedex-lora"]
)
def test_every_rank_trains_and_reports(tmp_path, method):
    frame = _run(tmp_path, method, **{"num-server-rounds": 3})
    assert frame["round"].tolist() == [1, 2, 3]
    assert (frame["clients"] == 4).all() and (frame["dropped"] == 0).all()
    assert frame["accuracy"].between(0, 1).all()
    assert (frame["rank"] == 16).all()
    gaps = frame[[f"gap-rank-{r}" for r in RANKS]]
    up = frame[[f"bytes-up-rank-{r}" for r in RANKS]]
    # A client of rank r sends r (d_in + d_out) floats per layer (+ head).
    assert (up.diff(axis=1).iloc[:, 1:] > 0).all().all()
    if method == "flora":
        assert (gaps == 0).all().all() and (frame["frobenius-gap"] == 0).all()
        assert "dense-base-sends" in frame
    elif method == "fedex-lora":
        # Every node holds the mean of the client models; the adapters' part
        # of M that rank 16 cannot hold went into W0 (4 clients: rank <= 30).
        assert (gaps == 0).all().all() and (frame["frobenius-gap"] > 0).all()
        # A change of rank up to (4 + 2) 16 = 96 never beats the dense 32 x 32
        # W0: dense every round (factored changes: the next test).
        assert frame["dense-base-sends"].tolist() == [4, 4, 4]
    else:
        # Round 1: the server does not know the nodes' ranks yet and sends
        # every node rank 16; each rank's column is what its nodes received.
        first = frame.loc[0, [f"bytes-down-rank-{r}" for r in RANKS]].to_numpy()
        assert (first == frame.loc[0, "bytes-down"] / 4).all(), first
        # Round 2: each node is sent only its own rank's components.
        down = frame.loc[1, [f"bytes-down-rank-{r}" for r in RANKS]].to_numpy()
        assert (down[1:] > down[:-1]).all(), down
        assert (gaps.to_numpy() >= 0).all()
    if method in ("flexlora", "fedspec"):
        # The best rank-r approximation: larger ranks receive less error, and
        # rank 16 holds the whole mean of products (4 clients, rank <= 30,
        # but 32 x 32 layers: not exact, yet the smallest gap).
        for _, row in gaps.iterrows():
            assert list(row) == sorted(row, reverse=True)


@pytest.mark.usefixtures("assets")
def test_hetero_fedex_sends_factored_base_changes_that_nodes_apply(tmp_path):
    """Ranks {1, 2}: a change of rank <= (4 + 2) 2 = 12 is smaller than the
    32 x 32 W0, so after round 1 nodes keep W0 and receive only changes; a
    node that applied one wrongly would fail the checksum and be dropped."""
    frame = _run(
        tmp_path, "fedex-lora", **{"client-ranks": "1,2", "num-server-rounds": 3}
    )
    assert (frame["clients"] == 4).all() and (frame["dropped"] == 0).all()
    assert frame["dense-base-sends"].tolist() == [4, 0, 0]
    assert (frame["bytes-down"].iloc[1:] < frame["bytes-down"].iloc[0]).all()
    assert (frame[["gap-rank-1", "gap-rank-2"]] == 0).all().all()


@pytest.mark.usefixtures("assets")
@pytest.mark.parametrize("method", ["flexlora", "fedspec"])
def test_a_reply_at_another_rank_is_dropped(tmp_path, caplog, method):
    def wrong_rank(partition: int, instruction: Message, reply: Message) -> Message:
        if partition == 3 and not reply.has_error():
            arrays = reply.content.array_records["arrays"]
            for key in list(arrays):
                if key.endswith("lora_A.weight"):
                    arrays[key] = type(arrays[key])(arrays[key].numpy()[:3])
        return reply

    with caplog.at_level(logging.WARNING, logger="flwr"):
        frame = _run(tmp_path, method, reply_hook=wrong_rank)
    assert (frame["dropped"] == 1).all() and (frame["clients"] == 3).all()
    assert any("rank 3 is not one of the client ranks" in m for m in caplog.messages)


@pytest.mark.usefixtures("assets")
def test_a_one_rank_method_refuses_client_ranks(tmp_path):
    with pytest.raises(ConfigError, match="client-ranks") as info:
        _run(tmp_path, "fedavg-lora")
    listed = str(info.value).split("need one of ")[1].split(", ")
    ranked = [
        m for m in available_methods() if get_method(m).traits.heterogeneous_ranks
    ]
    assert listed == ranked and {"flexlora", "fedspec", "fedex-lora"} <= set(listed)


@pytest.mark.usefixtures("assets")
def test_a_reply_whose_layers_disagree_on_the_rank_is_dropped(tmp_path, caplog):
    """Layer 0 declares the node's rank 16; the last layer is cut to rank 2."""

    def mixed(partition: int, instruction: Message, reply: Message) -> Message:
        if partition == 3 and not reply.has_error():
            arrays = reply.content.array_records["arrays"]
            a_key = [k for k in arrays if k.endswith("lora_A.weight")][-1]
            b_key = a_key.replace("lora_A", "lora_B")
            arrays[a_key] = type(arrays[a_key])(arrays[a_key].numpy()[:2])
            arrays[b_key] = type(arrays[b_key])(arrays[b_key].numpy()[:, :2])
        return reply

    with caplog.at_level(logging.WARNING, logger="flwr"):
        frame = _run(tmp_path, "hetlora", reply_hook=mixed)
    assert (frame["dropped"] == 1).all()
    dropped = [m for m in caplog.messages if "dropped a reply" in m]
    assert len(dropped) == 2
    for message in dropped:
        assert "node 1003" in message and a_key_of(message).endswith("lora_A.weight")
        assert "has shape (2, 32), expected (16, 32)" in message


def a_key_of(message: str) -> str:
    """The array key a drop reason names (the second quoted string)."""
    return message.split("'")[3]


# ------------------------------------------------------------------ FedSpec
ALPHA = 16.0
F64 = torch.float64
SPEC_RANKS = (2, 4, 8)
SPEC_WEIGHTS = (10, 30, 60, 20)  # a fourth client: ranks cycle 2, 4, 8, 2


def _spec_layout(rank: int = 8) -> AdapterLayout:
    return AdapterLayout(
        modules=(
            LoraModule("l0", "l0.A", "l0.B", "l0.W", ALPHA / rank, 20, 18, rank),
            LoraModule("l1", "l1.A", "l1.B", "l1.W", ALPHA / rank, 14, 22, rank),
        ),
        head_shapes={"head.w": (2, 18)},
    )


def _spec_clients(layout: AdapterLayout, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(len(SPEC_WEIGHTS)):
        at = layout_at_rank(layout, SPEC_RANKS[i % len(SPEC_RANKS)])
        shapes = at.shapes(Role.LORA_A, Role.LORA_B, Role.HEAD)
        out.append(
            {k: torch.randn(*s, generator=g, dtype=F64) for k, s in shapes.items()}
        )
    return out


def _dense_m(clients, module) -> torch.Tensor:
    """``M = sum_i w_i (alpha / r_i) B_i A_i``, dense float64."""
    total = sum(SPEC_WEIGHTS)
    return sum(
        (w / total)
        * (ALPHA / c[module.a_key].shape[0])
        * c[module.b_key]
        @ c[module.a_key]
        for w, c in zip(SPEC_WEIGHTS, clients, strict=True)
    )


def _spec_round(strategy, current, clients, server_round=1):
    grid = InProcessGrid(ClientApp(), num_nodes=len(clients), run_config={})
    keys = strategy.send_keys()
    messages = list(
        strategy.configure_train(
            server_round,
            ArrayRecord({k: current[k] for k in keys}),
            ConfigRecord(),
            grid,
        )
    )
    # Sampling shuffles the nodes: client i is the i-th node id, every round.
    messages.sort(key=lambda msg: int(msg.metadata.dst_node_id))
    replies = [
        reply(int(msg.metadata.dst_node_id), c, {"num-examples": n})
        for msg, c, n in zip(messages, clients, SPEC_WEIGHTS, strict=True)
    ]
    arrays, metrics = strategy.aggregate_train(server_round, replies)
    return messages, record_to_state(arrays), metrics


def _best(m: torch.Tensor, r: int) -> torch.Tensor:
    u, s, vh = torch.linalg.svd(m)
    return (u[:, :r] * s[:r]) @ vh[:r]


@pytest.mark.parametrize(("threshold", "grown"), [(0.99, 8), (0.0, 10)])
def test_hetero_fedspec_each_rank_receives_the_truncated_mean(threshold, grown):
    layout = _spec_layout()
    strategy = HeteroFedSpec(
        layout=layout,
        client_ranks=SPEC_RANKS,
        fedspec_threshold=threshold,
        fedspec_max_rank=10,
    )
    assert "lora-rank" not in strategy.round_config(1)
    assert strategy.round_config(1)["leading-rank"] is True
    g = torch.Generator().manual_seed(99)
    current = {
        k: torch.randn(*s, generator=g, dtype=F64)
        for k, s in layout.shapes(Role.LORA_A, Role.LORA_B, Role.HEAD).items()
    }
    clients = _spec_clients(layout)
    _, new, metrics = _spec_round(strategy, current, clients)
    # The rank rule on the dense tail fraction at the starting rank 8.
    tails = []
    for m in layout.modules:
        sigma = torch.linalg.svdvals(_dense_m(clients, m))
        tails.append(float((sigma[8:] ** 2).sum() / (sigma**2).sum()))
    assert metrics["tail-energy"] == pytest.approx(max(tails), rel=1e-10)
    assert strategy.rank == grown and metrics["rank"] == grown
    assert strategy.rank_history == [grown]
    gaps_sq = dict.fromkeys(SPEC_RANKS, 0.0)
    global_sq = 0.0
    for m in layout.modules:
        ideal = _dense_m(clients, m)
        # The global adapter: (alpha / R) B A == M_R.
        glob = (ALPHA / grown) * new[m.b_key] @ new[m.a_key]
        scale = float(torch.linalg.matrix_norm(ideal))
        assert float(torch.linalg.matrix_norm(glob - _best(ideal, grown))) <= (
            1e-10 * scale
        )
        global_sq += float(torch.linalg.matrix_norm(ideal - glob)) ** 2
        for r in SPEC_RANKS:
            # What a node of rank r keeps (fedlr.client.round: leading_rank).
            cut = leading_rank(layout_at_rank(layout, r), new)
            received = (ALPHA / r) * cut[m.b_key] @ cut[m.a_key]
            err = float(torch.linalg.matrix_norm(received - _best(ideal, r)))
            assert err <= 1e-10 * scale
            gaps_sq[r] += float(torch.linalg.matrix_norm(ideal - received)) ** 2
    for r in SPEC_RANKS:
        assert metrics[f"gap-rank-{r}"] == pytest.approx(
            math.sqrt(gaps_sq[r]), rel=1e-9
        )
    assert metrics["frobenius-gap"] == pytest.approx(math.sqrt(global_sq), rel=1e-9)
    assert metrics["gap-rank-2"] > metrics["gap-rank-4"] > metrics["gap-rank-8"]
    assert metrics["svd-randomized"] == 0.0 and metrics["gap-estimated"] == 0.0
    # bytes up per client of each rank: r (d_in + d_out) floats per layer + head
    per_rank = sum(m.d_in + m.d_out for m in layout.modules) * 8
    up = [metrics[f"bytes-up-rank-{r}"] for r in SPEC_RANKS]
    assert up[1] - up[0] == pytest.approx(2 * per_rank)
    assert up[2] - up[1] == pytest.approx(4 * per_rank)


def test_hetero_fedspec_sends_each_known_node_its_own_rank():
    layout = _spec_layout()
    strategy = HeteroFedSpec(
        layout=layout,
        client_ranks=SPEC_RANKS,
        fedspec_threshold=0.0,
        fedspec_max_rank=12,
    )
    clients = _spec_clients(layout, seed=3)
    current = {k: v.clone() for k, v in clients[2].items()}
    _, new, _ = _spec_round(strategy, current, clients)
    assert strategy.rank == 10
    assert new["l0.A"].shape == (10, 18) and new["l0.B"].shape == (20, 10)
    clients = _spec_clients(layout, seed=4)
    messages, _, metrics = _spec_round(strategy, new, clients, server_round=2)
    assert strategy.rank == 12
    for msg, client in zip(messages, clients, strict=True):
        r = client["l0.A"].shape[0]
        sent = record_to_state(msg.content["arrays"])
        expected = leading_rank(layout_at_rank(layout, r), new)
        assert sent["l0.A"].shape == (r, 18)
        torch.testing.assert_close(sent["l0.B"], expected["l0.B"], rtol=0, atol=0)
        assert "lora-rank" not in msg.content["config"]
    down = [metrics[f"bytes-down-rank-{r}"] for r in SPEC_RANKS]
    assert down == sorted(down) and down[0] < down[-1]


def test_hetero_fedspec_drops_a_reply_at_an_undeclared_rank(caplog):
    layout = _spec_layout()
    strategy = HeteroFedSpec(
        layout=layout, client_ranks=SPEC_RANKS, fedspec_max_rank=10
    )
    clients = _spec_clients(layout, seed=5)
    clients[1] = {
        k: (v[:3] if k.endswith(".A") else v[:, :3] if k.endswith(".B") else v)
        for k, v in clients[1].items()
    }
    current = {k: v.clone() for k, v in clients[2].items()}
    with caplog.at_level(logging.WARNING, logger="flwr"):
        _, _, metrics = _spec_round(strategy, current, clients)
    assert metrics["dropped"] == 1 and metrics["clients"] == 3
    assert any("rank 3 is not one of the client ranks" in m for m in caplog.messages)


def test_fedspec_from_run_config_picks_the_hetero_strategy_for_client_ranks():
    layout = AdapterLayout(
        modules=(LoraModule("l0", "l0.A", "l0.B", "l0.W", ALPHA / 16, 24, 24, 16),)
    )
    base = {"method": "fedspec", "lora-rank": 16, "lora-alpha": ALPHA}
    plain = FedSpec.from_run_config(RunConfig.from_mapping(base), layout)
    assert type(plain) is FedSpec and "gap-rank-16" not in plain.extra_columns
    assert plain.round_config(1)["lora-rank"] == 16
    config = RunConfig.from_mapping({**base, "client-ranks": "2,4,8,16"})
    spec = get_method("fedspec")
    assert spec.strategy_for(client_ranks=False) is FedSpec
    hetero = spec.strategy_for(client_ranks=True).from_run_config(config, layout)
    assert type(hetero) is HeteroFedSpec
    assert hetero.client_ranks == (2, 4, 8, 16) and hetero.max_rank == 16
    assert "gap-rank-2" in hetero.extra_columns
    assert "tail-energy" in hetero.extra_columns
    state = hetero.state_dict()
    assert state["rank"] == 16 and "node-ranks" in state
    hetero.load_state_dict(state)
    with pytest.raises(ConfigError, match="below the initial rank"):
        HeteroFedSpec.from_run_config(
            RunConfig.from_mapping({**base, "client-ranks": "2,18"}),
            layout_at_rank(layout, 18),
        )


@pytest.mark.usefixtures("assets")
def test_fedspec_grows_its_rank_with_heterogeneous_clients(tmp_path):
    frame = _run(
        tmp_path,
        "fedspec",
        **{"fedspec-threshold": 0.0, "fedspec-max-rank": 20},
    )
    assert frame["round"].tolist() == [1, 2]
    assert (frame["clients"] == 4).all() and (frame["dropped"] == 0).all()
    assert frame["rank"].tolist() == [18, 20]
    columns = [
        f"{kind}-rank-{r}" for kind in ("gap", "bytes-down", "bytes-up") for r in RANKS
    ]
    values = frame[[*columns, "frobenius-gap", "tail-energy"]].to_numpy()
    assert torch.isfinite(torch.from_numpy(values.astype(float))).all()
    gaps = frame[[f"gap-rank-{r}" for r in RANKS]]
    for (_, row), total in zip(gaps.iterrows(), frame["frobenius-gap"], strict=True):
        assert list(row) == sorted(row, reverse=True)
        assert total <= row.iloc[-1]  # the global rank R >= 16
    down = frame.loc[1, [f"bytes-down-rank-{r}" for r in RANKS]].to_numpy()
    assert (down[1:] > down[:-1]).all(), down
    print(frame[["round", "rank", "frobenius-gap", *gaps.columns]].to_string())


# ------------------------------------------------------------------ FedEx-LoRA
def _fedex_layout(rank: int = 8) -> AdapterLayout:
    """Two layers, the second stored as a Conv1D (W0 is (d_in, d_out))."""
    return AdapterLayout(
        modules=(
            LoraModule("l0", "l0.A", "l0.B", "l0.W", ALPHA / rank, 20, 18, rank),
            LoraModule(
                "l1",
                "l1.A",
                "l1.B",
                "l1.W",
                ALPHA / rank,
                14,
                22,
                rank,
                fan_in_fan_out=True,
            ),
        ),
        head_shapes={"head.w": (2, 18)},
    )


def _effective(module: LoraModule, state, scaling: float) -> torch.Tensor:
    """``W0 + s B A`` in (d_out, d_in), float64."""
    w = state[module.base_key].to(F64)
    w = w.T if module.fan_in_fan_out else w
    return w + scaling * state[module.b_key].to(F64) @ state[module.a_key].to(F64)


def _node_model(layout: AdapterLayout, rank: int, sent) -> dict[str, torch.Tensor]:
    """What a node of ``rank`` trains from (``leading-rank`` + ``fold-tail``)."""
    at = layout_at_rank(layout, rank)
    cut = leading_rank(at, sent)
    return {
        **cut,
        **fold_tail(at, sent, {m.base_key: sent[m.base_key] for m in at.modules}),
    }


@pytest.mark.parametrize("downlink", ["factored", "dense"])
def test_hetero_fedex_every_client_holds_the_mean_of_the_client_models(downlink):
    """Two rounds on mocked replies against dense float64.

    Before a round every node, whatever its rank, trains from the global
    model W = W0 + s_R B A exactly; after it the global model is the weighted
    mean of the nodes' trained models, and B A is the truncated mean of the
    products (FlexLoRA's factors).
    """
    layout = _fedex_layout()
    strategy = HeteroFedExLoRA(
        layout=layout, client_ranks=SPEC_RANKS, fedex_downlink=downlink
    )
    config = strategy.round_config(1)
    assert config["leading-rank"] is True and config["fold-tail"] is True
    g = torch.Generator().manual_seed(7)
    current = {
        k: torch.randn(*s, generator=g, dtype=F64)
        for k, s in layout.shapes(
            Role.LORA_A, Role.LORA_B, Role.HEAD, Role.BASE
        ).items()
    }
    total = sum(SPEC_WEIGHTS)
    for server_round, seed in ((1, 11), (2, 12)):
        clients = _spec_clients(layout, seed=seed)
        # Each node's starting model is the global one, at every rank.
        for c in clients:
            r = c["l0.A"].shape[0]
            node = _node_model(layout, r, current)
            for m in layout.modules:
                start = _effective(m, node, ALPHA / r)
                glob = _effective(m, current, ALPHA / 8)
                assert float(torch.linalg.matrix_norm(start - glob)) <= 1e-12 * float(
                    torch.linalg.matrix_norm(glob)
                )
        trained = [
            {**_node_model(layout, c["l0.A"].shape[0], current), **c} for c in clients
        ]
        messages, new, metrics = _spec_round(
            strategy, current, clients, server_round=server_round
        )
        for msg in messages:  # full rank R: the node folds the tail itself
            assert msg.content["arrays"]["l0.A"].shape == (8, 18)
        for m in layout.modules:
            mean = sum(
                (w / total) * _effective(m, t, ALPHA / c["l0.A"].shape[0])
                for w, t, c in zip(SPEC_WEIGHTS, trained, clients, strict=True)
            )
            scale = float(torch.linalg.matrix_norm(mean))
            got = _effective(m, new, ALPHA / 8)
            assert float(torch.linalg.matrix_norm(got - mean)) <= 1e-10 * scale
            ideal = _dense_m(clients, m)
            adapter = (ALPHA / 8) * new[m.b_key] @ new[m.a_key]
            err = float(torch.linalg.matrix_norm(adapter - _best(ideal, 8)))
            assert err <= 1e-10 * float(torch.linalg.matrix_norm(ideal))
        residual = math.sqrt(
            sum(
                float(
                    torch.linalg.matrix_norm(
                        _dense_m(clients, m) - _best(_dense_m(clients, m), 8)
                    )
                )
                ** 2
                for m in layout.modules
            )
        )
        assert metrics["frobenius-gap"] == pytest.approx(residual, rel=1e-9)
        assert all(metrics[f"gap-rank-{r}"] == 0.0 for r in SPEC_RANKS)
        assert metrics["dense-base-sends"] >= 0
        current = new


def test_fedex_from_run_config_picks_the_hetero_strategy_for_client_ranks():
    layout = _fedex_layout(16)
    base = {"method": "fedex-lora", "lora-rank": 16, "lora-alpha": ALPHA}
    plain = FedExLoRA.from_run_config(RunConfig.from_mapping(base), layout)
    assert type(plain) is FedExLoRA
    config = RunConfig.from_mapping({**base, "client-ranks": "2,4,8,16"})
    with pytest.raises(ConfigError, match="HeteroFedExLoRA"):
        FedExLoRA.from_run_config(config, layout)
    cls = get_method("fedex-lora").strategy_for(client_ranks=True)
    hetero = cls.from_run_config(
        config, layout, DownlinkOptions(fedex_downlink="dense")
    )
    assert type(hetero) is HeteroFedExLoRA
    assert hetero.client_ranks == (2, 4, 8, 16) and not hetero.factored
    assert "gap-rank-2" in hetero.extra_columns
    assert "dense-base-sends" in hetero.extra_columns
    state = hetero.state_dict()  # a checkpoint keeps the node ranks and the ledger
    assert {"node-ranks", "downlink"} <= set(state)
    hetero.load_state_dict(state)


def _peft_pair(kind: str, rank: int):
    """A seeded peft LoRA model of ``rank`` (alpha 16): an MLP or a tiny GPT-2."""
    from peft import LoraConfig, get_peft_model

    from fedlr.models.causal import build_causal_lm
    from tests.plugin_app.task import MLP

    torch.manual_seed(0)
    if kind == "linear":
        base, targets, fan = MLP(), ["fc1", "fc2"], False
    else:
        base, targets, fan = build_causal_lm("tiny-gpt2", 0), ["c_attn", "c_fc"], True
    config = LoraConfig(
        r=rank, lora_alpha=ALPHA, target_modules=targets, fan_in_fan_out=fan
    )
    return get_peft_model(base, config)


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_apply_round_folds_the_tail_so_every_rank_holds_the_global_model(kind):
    """A real peft model of rank 2 and 4 under a rank-8 HeteroFedExLoRA
    instruction: ``W0 + s B A`` of every layer is the global one to 1e-6
    (float32), with the Conv1D's ``W0`` transposed."""
    from flwr.app import Context, RecordDict

    from fedlr import apply_round, lora_layout
    from fedlr.adapters import adapter_state
    from fedlr.wire import protocol

    server = _peft_pair(kind, 8)
    layout = lora_layout(server)
    strategy = HeteroFedExLoRA(
        layout=layout, client_ranks=(2, 4, 8), fedex_downlink="dense"
    )
    g = torch.Generator().manual_seed(3)
    arrays = adapter_state(server, layout, strategy.send_roles)
    for m in layout.modules:  # a trained global adapter: B != 0
        arrays[m.b_key] = 0.1 * torch.randn(m.d_out, 8, generator=g)
        arrays[m.a_key] = 0.1 * torch.randn(8, m.d_in, generator=g)
    config = ConfigRecord(strategy.round_config(1))
    for rank in (2, 4):
        node = _peft_pair(kind, rank)
        message = instruction(7)
        message.content[protocol.ARRAYS] = state_to_record(arrays)
        message.content[protocol.CONFIG] = config
        context = Context(
            run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={}
        )
        job = apply_round(node, message, context)
        held = adapter_state(
            node, job.adapted.layout, (Role.BASE, Role.LORA_A, Role.LORA_B)
        )
        for m, mn in zip(layout.modules, job.adapted.layout.modules, strict=True):
            assert mn.rank == rank and mn.fan_in_fan_out is (kind == "conv1d")
            glob = _effective(m, arrays, ALPHA / 8)
            got = _effective(mn, held, ALPHA / rank)
            rel = float(torch.linalg.matrix_norm(got - glob)) / float(
                torch.linalg.matrix_norm(glob)
            )
            assert rel <= 1e-6, (m.name, rank, rel)
            # the tail is not zero: without the fold the models would differ
            cut = (
                (ALPHA / 8)
                * arrays[m.b_key][:, rank:].double()
                @ arrays[m.a_key][rank:].double()
            )
            assert float(torch.linalg.matrix_norm(cut)) > 1e-3
