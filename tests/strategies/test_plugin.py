"""fedlr as a plug-in: someone else's Flower app, and the legacy strategy API.

The app in tests/plugin_app/ is what docs/plugin.md shows: its own model and
data, a ClientApp on :func:`fedlr.apply_round`, a ServerApp on Flower's own
``strategy.start()`` with ``for_model``, ``initial_arrays`` and ``load_into``.
"""

from __future__ import annotations

import logging
import math
import re

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import (
    Code,
    FitRes,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from peft import LoraConfig, get_peft_model

from fedlr import (
    FedExLoRA,
    LegacyStrategy,
    Role,
    adapter_state,
    apply_round,
    available_methods,
    get_method,
    load_adapter_state,
    lora_layout,
)
from fedlr.adapters import parameters_by_key
from fedlr.adapters.plugin import lora_layers
from fedlr.errors import (
    ProjectionMismatchError,
    ProtocolError,
    ReplyValidationError,
    ShapeMismatchError,
    UnsupportedModelError,
)
from fedlr.flower import InProcessGrid
from fedlr.flower.records import record_to_state
from fedlr.strategies import FedAvgLoRA, FedAvgVeRA, FedSALoRA, FedSpec, FedSVD
from fedlr.strategies.lora_svd import PERSONAL_GRAM
from fedlr.wire import protocol
from tests.conftest import ROOT
from tests.plugin_app.client_app import app as plugin_client
from tests.plugin_app.client_app import train as plugin_train
from tests.plugin_app.server_app import main
from tests.plugin_app.task import MLP, build_model
from tests.strategies.conftest import reply

PLUGIN_FAMILIES = ("lora", "vera", "sorf-vera")
PLUGIN_METHODS = [
    name
    for name in available_methods()
    if get_method(name).payload.name in PLUGIN_FAMILIES
]
"""Every registered method of the payload kinds a user's own model can carry."""
PERSONAL = {"fedsa-lora", "global-svd", "local-svd"}
NODES = 3


def _config(method: str, **overrides: object) -> dict[str, object]:
    config: dict[str, object] = {
        "method": method,
        "num-server-rounds": 2,
        "local-steps": 5,
        "lr": 0.1,
        "min-nodes": NODES,
        "fedspec-threshold": 0.0,  # every round's tail > 0: the rank grows
        "fedspec-max-rank": 6,
    }
    config.update(overrides)
    return config


def _run(method: str, hook=None, **overrides):
    config = _config(method, **overrides)
    grid = InProcessGrid(
        plugin_client, num_nodes=NODES, run_config=config, reply_hook=hook
    )
    context = Context(
        run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=config
    )
    return main(grid, context), grid


def _message(content: RecordDict, node_id: int, message_type: str = "train"):
    """An instruction as a grid would push it."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 0
    message = Message(content=content, dst_node_id=node_id, message_type=message_type)
    message.metadata.__dict__["_message_id"] = f"plugin-{node_id}-{message_type}"
    return message


def _context(partition: int = 0) -> Context:
    return Context(
        run_id=1,
        node_id=1000 + partition,
        node_config={"partition-id": partition, "num-partitions": NODES},
        state=RecordDict(),
        run_config=_config("fedavg-lora"),
    )


def _instruction(strategy, model, node_id: int = 1000) -> Message:
    """Round 1's train instruction of ``strategy`` for ``model``."""
    config = strategy.begin_round(
        1, strategy.initial_arrays(model), ConfigRecord({"lr": 0.1})
    )
    config[protocol.SERVER_ROUND] = 1
    content = RecordDict(
        {protocol.ARRAYS: strategy.initial_arrays(model), protocol.CONFIG: config}
    )
    return _message(content, node_id)


def _effective_updates(model) -> dict[str, torch.Tensor]:
    """``scaling * B @ A`` (d_out, d_in) of every LoRA layer, in float64."""
    adapter = model.active_adapter
    return {
        name: float(layer.scaling[adapter])
        * layer.lora_B[adapter].weight.detach().double()
        @ layer.lora_A[adapter].weight.detach().double()
        for name, layer in lora_layers(model).items()
    }


# --------------------------------------------------------- every method, e2e
def test_plugin_methods_cover_every_plugin_family():
    """The list comes from the registry; each family has methods in it and
    every one of them builds from a user's model (``for_model``)."""
    families = {get_method(name).payload.name for name in PLUGIN_METHODS}
    assert families == set(PLUGIN_FAMILIES)
    assert {"fedavgm-lora", "scaffold-lora", "fedex-lora"} <= set(PLUGIN_METHODS)
    for name in PLUGIN_METHODS:
        assert callable(getattr(get_method(name).strategy, "for_model", None)), name


@pytest.mark.parametrize("method", PLUGIN_METHODS)
def test_user_client_app_completes_two_rounds_of_strategy_start(method):
    result, grid = _run(method)
    train = result.train_metrics_clientapp
    assert sorted(train) == [1, 2]
    for metrics in train.values():
        assert metrics["dropped"] == 0 and metrics["clients"] == NODES
        assert metrics["num-examples"] == NODES * 128
        assert math.isfinite(metrics["train-loss"]) and metrics["train-loss"] > 0
        assert math.isfinite(metrics["frobenius-gap"])
    server = result.evaluate_metrics_serverapp
    assert sorted(server) == [0, 1, 2]
    for metrics in server.values():
        assert 0.0 <= metrics["accuracy"] <= 1.0
        assert math.isfinite(metrics["loss"]) and metrics["loss"] > 0
    # The global arrays are the strategy's send keys (and nothing else).
    options = {"fedspec_max_rank": 6} if method == "fedspec" else {}
    strategy = get_method(method).strategy.for_model(build_model(method), **options)
    assert set(record_to_state(result.arrays)) == set(strategy.send_keys())
    # Federated evaluation (the app's @app.evaluate) runs where the strategy
    # asks for it; personalised methods always do.
    clients = result.evaluate_metrics_clientapp
    evaluated = strategy.fraction_evaluate > 0
    assert evaluated or method not in PERSONAL
    assert grid.messages_sent == NODES * 2 * (2 if evaluated else 1)
    assert sorted(clients) == ([1, 2] if evaluated else [])
    for metrics in clients.values():
        assert 0.0 <= metrics["accuracy"] <= 1.0 and math.isfinite(metrics["loss"])
    if method in PERSONAL:
        # Round 2 starts every client from its own kept or received factors.
        assert train[1]["personal-clients"] == 0
        assert train[2]["personal-clients"] == NODES
        assert clients[2]["evaluated-clients"] == NODES
        kept = grid.contexts[1000].state.array_records[protocol.PERSONAL]
        b_keys = set(strategy.layout.keys(Role.LORA_B))
        assert set(kept) == b_keys


def test_ffa_lora_gap_is_measured_against_the_bound_initial_a():
    """initial_arrays binds the A FFA-LoRA never sends: the gap is ~0, not NaN."""
    result, _ = _run("ffa-lora")
    for metrics in result.train_metrics_clientapp.values():
        assert metrics["frobenius-gap"] < 1e-5
    final = record_to_state(result.arrays)
    layout = lora_layout(build_model("ffa-lora"))
    assert not set(layout.keys(Role.LORA_A)) & set(final)


def test_fedsvd_clients_send_b_only_and_the_server_orthonormalises_a():
    result, _ = _run("fedsvd")
    final = record_to_state(result.arrays)
    layout = lora_layout(build_model("fedsvd"))
    for module in layout.modules:
        a = final[module.a_key].double()
        torch.testing.assert_close(a @ a.T, torch.eye(module.rank, dtype=a.dtype))


def test_fedex_lora_accuracy_rises_over_three_rounds():
    result, _ = _run("fedex-lora", **{"num-server-rounds": 3, "local-steps": 10})
    accuracy = {
        r: float(m["accuracy"]) for r, m in result.evaluate_metrics_serverapp.items()
    }
    assert sorted(accuracy) == [0, 1, 2, 3]
    assert accuracy[3] > accuracy[0] + 0.1, accuracy


# ------------------------------------------------------------------- FedSpec
def _mean_of_products(replies, layout) -> dict[str, torch.Tensor]:
    """``sum_i w_i B_i A_i`` per layer (dense, float64) from round-1 replies."""
    total = sum(int(r.content["metrics"]["num-examples"]) for r in replies)
    out: dict[str, torch.Tensor] = {}
    for m in layout.modules:
        out[m.name] = sum(
            int(r.content["metrics"]["num-examples"])
            / total
            * record_to_state(r.content["arrays"])[m.b_key].double()
            @ record_to_state(r.content["arrays"])[m.a_key].double()
            for r in replies
        )
    return out


def _truncate(matrix: torch.Tensor, rank: int) -> torch.Tensor:
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    return (u[:, :rank] * s[:rank]) @ vh[:rank]


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "fedlr" and r.levelno >= logging.WARNING
    ]


def test_fedspec_rank_growth_client_update_equals_the_server_aggregate(caplog):
    seen: list[tuple[Message, Message]] = []

    def hook(partition, instruction, answer):
        if instruction.metadata.message_type == "train":
            seen.append((instruction, answer))
        return answer

    result, _ = _run("fedspec", hook=hook)
    assert all(m["dropped"] == 0 for m in result.train_metrics_clientapp.values())
    assert [m["rank"] for m in result.train_metrics_clientapp.values()] == [6, 6]
    # evaluate_fn (strategy.load_into) ran after the growth, every round.
    server = result.evaluate_metrics_serverapp
    assert sorted(server) == [0, 1, 2]
    assert all(math.isfinite(m["accuracy"]) for m in server.values())

    def of_round(r):
        return [
            pair
            for pair in seen
            if pair[0].content["config"][protocol.SERVER_ROUND] == r
        ]

    round_1, round_2 = of_round(1), of_round(2)
    assert len(round_1) == len(round_2) == NODES
    layout = lora_layout(build_model("fedspec"))  # rank 4, alpha 8
    assert all(m.scaling == 2.0 for m in layout.modules)
    # The server's aggregate in model units: (alpha / 4) * M_6, the best rank-6
    # approximation of the round-1 mean of the clients' products.
    means = _mean_of_products([answer for _, answer in round_1], layout)
    target = {name: 2.0 * _truncate(mean, 6) for name, mean in means.items()}
    instruction = round_2[0][0]
    config = instruction.content["config"]
    assert config[protocol.LORA_RANK] == 6
    assert config[protocol.LORA_ALPHA] == 8.0

    # A client whose model is still at rank 4 rebuilds at rank 6, alpha 8.
    model = build_model("fedspec")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fedlr"):
        job = apply_round(model, instruction, _context())
    assert not _warnings(caplog)  # a rank change is no alpha error
    assert [(c.old_rank, c.rank) for c in job.changes] == [(4, 6), (4, 6)]
    assert not any(c.alpha_changed for c in job.changes)
    got = _effective_updates(model)
    for name, want in target.items():
        torch.testing.assert_close(got[name], want, rtol=1e-4, atol=1e-6)

    # A client that rebuilt itself at rank 6 with lora_alpha = 2 r = 12 would
    # be 50 % off (scaling 2 instead of 8 / 6); apply_round corrects it.
    torch.manual_seed(0)
    wrong = get_peft_model(
        MLP(),
        LoraConfig(
            r=6,
            lora_alpha=12,
            target_modules=["fc1", "fc2"],
            modules_to_save=["classifier"],
        ),
    )
    assert pytest.approx(0.5) == 2.0 / (8 / 6) - 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fedlr"):
        job = apply_round(wrong, instruction, _context())
    warnings = _warnings(caplog)
    assert len(warnings) == 2  # one per layer, naming it
    assert all("alpha 12) -> 1.33333 (alpha 8)" in m for m in warnings), warnings
    assert all(c.alpha_changed and c.rank == 6 for c in job.changes)
    adapter = wrong.active_adapter
    assert all(
        layer.scaling[adapter] == pytest.approx(8 / 6)
        for layer in lora_layers(wrong).values()
    )
    got = _effective_updates(wrong)
    for name, want in target.items():
        torch.testing.assert_close(got[name], want, rtol=1e-4, atol=1e-6)


def test_load_into_follows_the_rank_of_the_arrays():
    result, _ = _run("fedspec")
    final = record_to_state(result.arrays)
    model = build_model("fedspec")  # the server's model, rank 4
    # The old evaluate_fn: the arrays have rank 6, the model rank 4.
    with pytest.raises(ShapeMismatchError, match="layout declares"):
        load_adapter_state(model, lora_layout(model), final)
    strategy = FedSpec.for_model(model, fedspec_threshold=0.0, fedspec_max_rank=6)
    initial = strategy.initial_arrays(model)
    strategy.load_into(model, result.arrays)
    layout = lora_layout(model)
    assert {m.rank for m in layout.modules} == {6}
    for m in layout.modules:
        assert m.scaling == pytest.approx(8 / 6)  # alpha 8 kept
        want = (8 / 6) * final[m.b_key].double() @ final[m.a_key].double()
        torch.testing.assert_close(_effective_updates(model)[m.name], want)
    assert torch.isfinite(model(torch.randn(5, 8))).all()
    # And back to the initial rank-4 arrays.
    strategy.load_into(model, initial)
    assert {m.rank for m in lora_layout(model).modules} == {4}
    assert all(torch.count_nonzero(u) == 0 for u in _effective_updates(model).values())


# ------------------------------------------------------------ server helpers
def test_initial_arrays_are_the_send_roles_not_the_state_dict():
    model = build_model("fedex-lora")
    strategy = FedExLoRA.for_model(model)
    initial = strategy.initial_arrays(model)
    assert list(initial) == strategy.send_keys()
    layout = lora_layout(model)
    assert set(layout.keys(Role.BASE)) <= set(initial)
    # What users tried first has other keys; it would fail after round 1.
    assert set(ArrayRecord(model.state_dict())) != set(initial)
    fedsvd = FedSVD.for_model(model)
    with pytest.raises(ShapeMismatchError, match="lora_A"):
        fedsvd.initial_arrays(
            get_peft_model(
                MLP(),
                LoraConfig(
                    r=2, target_modules=["fc1", "fc2"], modules_to_save=["classifier"]
                ),
            )
        )
    with pytest.raises(UnsupportedModelError, match="VeraLayout"):
        fedsvd.initial_arrays(build_model("fedavg-vera"))
    with pytest.raises(UnsupportedModelError, match="MLP"):
        FedSVD.for_model(MLP())


# ------------------------------------------------------------ client helpers
def test_fedsvd_reply_is_exactly_b_and_head_and_a_stays_frozen():
    model = build_model("fedsvd")
    strategy = FedSVD.for_model(model)
    instruction = _instruction(strategy, model)
    context = _context()
    context.run_config["method"] = "fedsvd"
    answer = plugin_train(instruction, context)
    arrays = record_to_state(answer.content["arrays"])
    layout = lora_layout(model)
    assert set(arrays) == set(layout.keys(Role.LORA_B, Role.HEAD))
    # The reply passes the strategy's checks (the old plain-peft reply did not).
    update = strategy.replies.validate_reply(answer, strategy.reply_shapes())
    assert update.num_examples == 128 and update.metrics["train-loss"] > 0
    old = reply(
        1000, adapter_state(model, layout, FedSVD.send_roles), {"num-examples": 8}
    )
    with pytest.raises(ReplyValidationError, match=r"unexpected.*lora_A"):
        strategy.replies.validate_reply(old, strategy.reply_shapes())
    # A is loaded and frozen; B and the head train.
    model = build_model("fedsvd")
    job = apply_round(model, instruction, context)
    by_key = parameters_by_key(model, layout)
    trained = layout.keys(Role.LORA_B, Role.HEAD)
    assert {id(p) for p in job.parameters()} == {id(by_key[k]) for k in trained}
    for m in layout.modules:
        torch.testing.assert_close(
            by_key[m.a_key].detach(),
            record_to_state(instruction.content["arrays"])[m.a_key],
        )
    assert job.penalty().item() == 0.0


def test_fedprox_penalty_is_the_proximal_term_of_the_trained_parameters():
    from fedlr.strategies.fedprox_lora import FedProxLoRA

    model = build_model("fedprox-lora")
    strategy = FedProxLoRA.for_model(model, proximal_mu=0.5)
    job = apply_round(model, _instruction(strategy, model), _context())
    assert job.penalty().item() == 0.0
    with torch.no_grad():
        for p in job.parameters():
            p.add_(0.1)
    count = sum(p.numel() for p in job.parameters())
    assert job.penalty().item() == pytest.approx(0.5 / 2 * count * 0.01, rel=1e-5)
    job.penalty().backward()  # differentiable: it joins the user's loss
    assert all(p.grad is not None for p in job.parameters())


def test_fedsa_lora_keeps_b_in_context_state_and_sends_its_gram():
    model = build_model("fedsa-lora")
    strategy = FedSALoRA.for_model(model)
    context = _context()
    job = apply_round(model, _instruction(strategy, model), context)
    assert job.keep_roles == (Role.LORA_B,) and not job.personal_loaded
    with torch.no_grad():
        for p in job.parameters():
            p.add_(0.01)
    answer = job.reply(num_examples=16, metrics={"train-loss": 0.5, "mine": 3})
    layout = lora_layout(model)
    arrays = record_to_state(answer.content["arrays"])
    assert set(arrays) == set(layout.keys(Role.LORA_A, Role.HEAD))
    kept = record_to_state(context.state.array_records[protocol.PERSONAL])
    grams = record_to_state(answer.content.array_records[PERSONAL_GRAM])
    for m in layout.modules:
        torch.testing.assert_close(grams[m.b_key], kept[m.b_key].T @ kept[m.b_key])
        assert torch.count_nonzero(kept[m.b_key]) > 0
    metrics = answer.content["metrics"]
    assert metrics["mine"] == 3 and metrics["train-loss"] == 0.5  # unchanged
    assert metrics[protocol.PERSONAL_LOADED] == 0
    strategy.replies.validate_reply(answer, strategy.reply_shapes())
    # The next round starts from the kept B, not from the model's.
    model = build_model("fedsa-lora")
    job = apply_round(model, _instruction(strategy, model), context)
    assert job.personal_loaded
    state = adapter_state(model, lora_layout(model), (Role.LORA_B,))
    for key, value in kept.items():
        torch.testing.assert_close(state[key], value)


def test_a_cached_model_starts_each_round_from_its_initial_values():
    model = build_model("fedsa-lora")
    strategy = FedSALoRA.for_model(model)
    first = _context(0)
    job = apply_round(model, _instruction(strategy, model), first)
    with torch.no_grad():
        for p in job.parameters():
            p.add_(1.0)
    job.reply(num_examples=4)
    # The same model object serves another node: its B is the initial zero.
    apply_round(model, _instruction(strategy, model, 1001), _context(1))
    state = adapter_state(model, lora_layout(model), (Role.LORA_B,))
    assert all(torch.count_nonzero(b) == 0 for b in state.values())


def test_vera_client_checks_the_projection_seed_and_rank():
    server = build_model("fedavg-vera")
    strategy = FedAvgVeRA.for_model(server)
    instruction = _instruction(strategy, server)
    other = build_model("fedavg-vera", seed=1)
    with pytest.raises(ProjectionMismatchError, match="projection-seed 0"):
        apply_round(other, instruction, _context())
    job = apply_round(build_model("fedavg-vera"), instruction, _context())
    answer = job.reply(num_examples=10)
    metrics = answer.content["metrics"]
    assert metrics[protocol.PROJECTION_SEED] == 0
    assert metrics[protocol.PROJECTION_RANK] == 8
    update = strategy.replies.validate_reply(answer, strategy.reply_shapes())
    assert set(update.arrays) == set(strategy.reply_shapes())


def test_client_helpers_refuse_with_named_errors():
    lora = build_model("fedavg-lora")
    instruction = _instruction(FedAvgLoRA.for_model(lora), lora)
    job = apply_round(lora, instruction, _context())
    with pytest.raises(ProtocolError, match="positive integer"):
        job.reply(num_examples=0)
    with pytest.raises(ProtocolError, match="num-examples"):
        job.reply(num_examples=3, metrics={"num-examples": 3})
    vera = build_model("fedavg-vera")
    vera_instruction = _instruction(FedAvgVeRA.for_model(vera), vera)
    with pytest.raises(ProtocolError, match="vera_lambda_b"):
        apply_round(build_model("fedavg-lora"), vera_instruction, _context())
    with pytest.raises(UnsupportedModelError, match="MLP"):
        apply_round(MLP(), instruction, _context())


def test_evaluate_reply_is_metrics_only():
    model = build_model("fedavg-lora")
    strategy = FedAvgLoRA.for_model(model)
    content = RecordDict(
        {
            protocol.ARRAYS: strategy.initial_arrays(model),
            protocol.CONFIG: ConfigRecord(strategy.round_config(1)),
        }
    )
    job = apply_round(model, _message(content, 1000, "evaluate"), _context(2))
    assert not job.is_train and job.parameters() == []
    answer = job.reply(num_examples=7, metrics={"accuracy": 0.5, "loss": 0.7})
    assert list(answer.content.array_records) == []
    assert dict(answer.content["metrics"]) == {
        "num-examples": 7,
        "accuracy": 0.5,
        "loss": 0.7,
    }


# ---------------------------------------------------------------------- docs
_BLOCK = re.compile(
    r"<!-- (file|excerpt): (\S+) -->\n```\w+\n(.*?)```", flags=re.DOTALL
)


def test_every_plugin_snippet_in_the_docs_is_the_test_app():
    text = (ROOT / "docs" / "plugin.md").read_text(encoding="utf-8")
    blocks = _BLOCK.findall(text)
    kinds = {(kind, path) for kind, path, _ in blocks}
    assert ("file", "tests/plugin_app/client_app.py") in kinds
    assert ("file", "tests/plugin_app/server_app.py") in kinds
    for kind, path, body in blocks:
        if not path.startswith("tests/"):
            continue
        source = (ROOT / path).read_text(encoding="utf-8")
        if kind == "file":
            assert body == source, path
        else:
            assert body in source, path


# ------------------------------------------------------------------- legacy
def _client_states(layout, seed):
    g = torch.Generator().manual_seed(seed)
    states = []
    for _ in range(3):
        state = {}
        for key, shape in layout.shapes(*FedExLoRA.train_roles).items():
            state[key] = torch.randn(*shape, generator=g)
        states.append(state)
    return states


class _Proxy:
    def __init__(self, cid):
        self.cid = str(cid)


@pytest.mark.parametrize("strategy_cls", [FedExLoRA, FedAvgLoRA])
def test_legacy_aggregate_fit_equals_the_message_api(strategy_cls):
    model = build_model("fedex-lora")
    layout = lora_layout(model)
    initial = adapter_state(model, layout, strategy_cls.send_roles)
    states = _client_states(layout, seed=3)
    sizes = [10, 30, 60]

    modern = strategy_cls(layout=layout)
    modern.begin_round(1, ArrayRecord(initial), ConfigRecord({}))
    expected, metrics = modern.aggregate_train(
        1,
        [
            reply(1 + i, state, {"num-examples": n})
            for i, (state, n) in enumerate(zip(states, sizes, strict=True))
        ],
    )

    legacy = LegacyStrategy(strategy_cls(layout=layout), initial_arrays=initial)
    params = legacy.initialize_parameters(client_manager=None)
    initial_order = list(legacy.send_keys)
    assert initial_order == list(initial)
    keys = legacy.reply_keys
    results = [
        (
            _Proxy(1 + i),
            FitRes(
                Status(Code.OK, ""),
                ndarrays_to_parameters([state[k].numpy() for k in keys]),
                n,
                {},
            ),
        )
        for i, (state, n) in enumerate(zip(states, sizes, strict=True))
    ]
    legacy.strategy.begin_round(1, ArrayRecord(initial), ConfigRecord({}))
    got, legacy_metrics = legacy.aggregate_fit(1, results, [])
    got_arrays = parameters_to_ndarrays(got)
    want = record_to_state(expected)
    assert legacy.send_keys == list(want)
    for key, array in zip(legacy.send_keys, got_arrays, strict=True):
        np.testing.assert_array_equal(array, want[key].numpy())
    assert legacy_metrics["num-examples"] == 100
    assert legacy_metrics["frobenius-gap"] == pytest.approx(metrics["frobenius-gap"])
    for key, array in zip(initial_order, parameters_to_ndarrays(params), strict=True):
        np.testing.assert_array_equal(array, initial[key].numpy())


def test_legacy_drops_bad_fitres_and_failures_with_reasons(caplog):
    model = build_model("fedavg-lora")
    layout = lora_layout(model)
    initial = adapter_state(model, layout, FedAvgLoRA.send_roles)
    legacy = LegacyStrategy(FedAvgLoRA(layout=layout), initial_arrays=initial)
    legacy.strategy.begin_round(1, ArrayRecord(initial), ConfigRecord({}))
    (noise,) = _client_states(layout, 5)[:1]  # a trained-looking step from initial
    good = {k: initial[k] + 0.01 * v for k, v in noise.items()}
    keys = legacy.reply_keys
    results = [
        (
            _Proxy(1),
            FitRes(
                Status(Code.OK, ""),
                ndarrays_to_parameters([good[k].numpy() for k in keys]),
                8,
                {},
            ),
        ),
        (
            _Proxy(2),
            FitRes(
                Status(Code.OK, ""),
                ndarrays_to_parameters([good[k].numpy() for k in keys[:-1]]),
                8,
                {},
            ),
        ),
    ]
    failures = [RuntimeError("connection lost")]
    with caplog.at_level("WARNING"):
        params, metrics = legacy.aggregate_fit(1, results, failures)
    assert metrics["clients"] == 1 and metrics["dropped"] == 2
    assert any(f"expected {len(keys)}" in m for m in caplog.messages)
    assert any("connection lost" in m for m in caplog.messages)
    got = dict(zip(legacy.send_keys, parameters_to_ndarrays(params), strict=True))
    for key in keys:
        np.testing.assert_array_equal(got[key], good[key].numpy())


def test_legacy_route_takes_the_plugin_initial_arrays():
    """The legacy snippet of docs/plugin.md."""
    model = build_model("fedex-lora")
    inner = FedExLoRA.for_model(model)
    strategy = LegacyStrategy(
        inner,
        initial_arrays=inner.initial_arrays(model).to_torch_state_dict(),
        train_config={"lr": 0.003},
        evaluate_fn=None,
    )
    assert strategy.send_keys == inner.send_keys()
    params = parameters_to_ndarrays(strategy.initialize_parameters(None))
    want = adapter_state(model, lora_layout(model), FedExLoRA.send_roles)
    for key, array in zip(strategy.send_keys, params, strict=True):
        np.testing.assert_array_equal(array, want[key].numpy())


# ------------------------------------- federated evaluation, helper metrics
def _train_only_run(caplog, **strategy_options):
    """Three rounds of a ClientApp without @app.evaluate() under Flower's
    ``strategy.start()``; the strategy from ``for_model(**strategy_options)``."""
    from flwr.clientapp import ClientApp

    train_only = ClientApp()
    train_only.train()(plugin_train)
    config = _config("fedex-lora", **{"num-server-rounds": 3})
    grid = InProcessGrid(train_only, num_nodes=NODES, run_config=config)
    model = build_model("fedex-lora")
    strategy = FedExLoRA.for_model(
        model, min_available_nodes=NODES, min_train_nodes=NODES, **strategy_options
    )
    with caplog.at_level(logging.INFO, logger="flwr"):
        result = strategy.start(
            grid=grid,
            initial_arrays=strategy.initial_arrays(model),
            num_rounds=3,
            train_config=ConfigRecord({"lr": 0.1}),
        )
    return strategy, result, grid, [r.getMessage() for r in caplog.records]


def test_for_model_evaluate_false_sends_no_evaluate_instructions(caplog):
    strategy, result, grid, lines = _train_only_run(caplog, evaluate=False)
    assert strategy.fraction_evaluate == 0.0
    assert grid.messages_sent == NODES * 3  # train instructions only
    assert dict(result.evaluate_metrics_clientapp) == {}
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3]
    assert not [line for line in lines if "evaluat" in line and "dropped" in line]
    assert not [line for line in lines if "federated evaluation is on" in line]


def test_for_model_without_evaluate_says_so_and_stops_after_one_failed_round(caplog):
    """Not told: one start-up line says federated evaluation is on and how to
    turn it off; a train-only ClientApp's round-1 errors turn it off with one
    warning instead of an error per node and round."""
    strategy, result, grid, lines = _train_only_run(caplog)
    startup = [line for line in lines if "federated evaluation is on" in line]
    assert len(startup) == 1 and "evaluate=False" in startup[0]
    off = [line for line in lines if "have no @app.evaluate()" in line]
    assert len(off) == 1 and "round 1" in off[0]
    assert not [line for line in lines if "dropped an evaluate reply" in line]
    assert strategy.fraction_evaluate == 0.0
    assert grid.messages_sent == NODES * 3 + NODES  # one evaluate round only
    assert dict(result.evaluate_metrics_clientapp) == {}


def test_for_model_evaluate_true_with_no_fraction_is_refused():
    with pytest.raises(ValueError, match="fraction_evaluate"):
        FedExLoRA.for_model(
            build_model("fedex-lora"), evaluate=True, fraction_evaluate=0.0
        )
    strategy = FedExLoRA.for_model(build_model("fedex-lora"), evaluate=True)
    assert strategy.fraction_evaluate == 1.0  # Flower's default kept


def test_evaluating_app_keeps_federated_evaluation_when_not_told():
    """A ClientApp that evaluates is never switched off, and the helpers' ids
    and flags are not averaged into the aggregated metrics."""
    result, grid = _run("fedex-lora", **{"num-server-rounds": 2})
    assert sorted(result.evaluate_metrics_clientapp) == [1, 2]
    assert grid.messages_sent == NODES * 2 * 2
    for metrics in result.train_metrics_clientapp.values():
        assert protocol.PARTITION_ID not in metrics
        assert protocol.BASE_HELD not in metrics
        assert metrics["clients"] == NODES  # fedlr's own count stays


@pytest.mark.parametrize("method", ["fedex-lora", "fedsa-lora", "fedavg-vera"])
def test_helper_ids_and_flags_are_not_averaged(method):
    """partition-id (ids 0..2 would average to 1), base-held (a version),
    personal-loaded, VeRA's projection seed and rank: none in the round's
    aggregated train or evaluate metrics; the user's train-loss is."""
    result, _ = _run(method)
    helper = {
        protocol.PARTITION_ID,
        protocol.BASE_HELD,
        protocol.PERSONAL_LOADED,
        protocol.PROJECTION_SEED,
        protocol.PROJECTION_RANK,
        protocol.RANK_PRUNED,
    }
    for metrics in result.train_metrics_clientapp.values():
        assert not helper & set(metrics), sorted(metrics)
        assert math.isfinite(metrics["train-loss"])
    for metrics in result.evaluate_metrics_clientapp.values():
        assert not helper & set(metrics), sorted(metrics)


def test_without_helper_metrics_keeps_the_users_metrics():
    from flwr.app import MetricRecord

    from fedlr.round.publish import without_helper_metrics

    content = RecordDict(
        {
            "metrics": MetricRecord(
                {"num-examples": 5, "partition-id": 2, "base-held": 3, "my-f1": 0.5}
            )
        }
    )
    kept = without_helper_metrics(content)
    assert dict(kept["metrics"]) == {"num-examples": 5, "my-f1": 0.5}
    assert dict(content["metrics"])["partition-id"] == 2  # the reply is unchanged
    plain = RecordDict({"metrics": MetricRecord({"num-examples": 5})})
    assert without_helper_metrics(plain) is plain
