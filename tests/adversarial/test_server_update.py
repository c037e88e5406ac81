"""The server's own update (fedlr.robust.server_update): the round's
instruction trained on the server's validation examples, aggregated with the
clients' updates at a fixed share of the weight that no claim changes."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import pytest
import torch
from flwr.app import Message, MessageType
from hypothesis import given
from hypothesis import strategies as st

from fedlr.errors import ConfigError
from fedlr.flower.records import record_to_state
from fedlr.robust.rules import RobustConfig, robust_aggregate
from fedlr.robust.server_update import (
    ServerUpdate,
    check_server_update_strategy,
    server_weight,
)
from fedlr.strategies.registry import resolve
from fedlr.wire import protocol
from tests.conftest import tiny_run_config


@given(
    share=st.floats(0.01, 0.99),
    weights=st.lists(st.integers(1, 10**6), min_size=1, max_size=12),
)
def test_the_server_weight_is_its_share_of_the_round(share, weights):
    w = server_weight(share, [float(x) for x in weights])
    assert math.isclose(w / (w + sum(weights)), share, rel_tol=1e-12)


@pytest.mark.parametrize(
    ("share", "weights"),
    [(0.0, [1.0]), (1.0, [1.0]), (0.5, [1.0, -2.0]), (0.5, [math.nan])],
)
def test_a_bad_share_or_weight_is_refused(share, weights):
    with pytest.raises(ValueError, match=r"share|weights"):
        server_weight(share, weights)


def test_a_bad_share_is_refused_by_name():
    with pytest.raises(ConfigError, match="server-update-share"):
        ServerUpdate(lambda m: m, 1.5, 8)
    for bad in (1.0, -0.1):
        with pytest.raises(ConfigError, match="server-update-share"):
            resolve({"server-update-share": bad})


@pytest.mark.parametrize(
    ("settings", "reason"),
    [
        ({"method": "fedavg-lora", "secure-aggregation": True}, "secure-aggregation"),
        (
            {
                "method": "fedavg-lora",
                "client-dp-clip": 1.0,
                "client-dp-noise-multiplier": 1.0,
            },
            "client-level DP",
        ),
        ({"method": "fedsa-lora"}, "personalised"),
        ({"method": "qrmix", "model": "cnn", "dataset": "digits"}, "'qrmix' payloads"),
    ],
)
def test_it_is_refused_at_configuration_where_the_server_cannot_add_it(
    settings, reason
):
    with pytest.raises(ConfigError, match=reason) as caught:
        resolve({**settings, "server-update-share": 0.5})
    assert caught.value.key == "server-update-share"


def test_methods_with_node_records_or_no_round_are_refused_by_name():
    with pytest.raises(ConfigError, match="scaffold-delta") as caught:
        check_server_update_strategy(
            "scaffold-lora", ["scaffold-delta"], asynchronous=False
        )
    assert caught.value.key == "server-update-share"
    with pytest.raises(ConfigError, match="asynchronous engine"):
        check_server_update_strategy("fedbuff-lora", [], asynchronous=True)
    check_server_update_strategy("fedex-lora", [], asynchronous=False)  # allowed


@pytest.mark.parametrize(
    ("settings", "reason"),
    [
        (
            {"robust": "norm-clip", "clip-reference": "server"},
            "server-update-share > 0",
        ),
        (
            {
                "robust": "median",
                "clip-reference": "server",
                "server-update-share": 0.5,
            },
            "clipping rule",
        ),
        ({"robust": "norm-clip", "clip-reference": "mean"}, "must be one of"),
    ],
)
def test_a_clip_at_the_servers_norm_needs_the_server_update_and_a_bound(
    settings, reason
):
    with pytest.raises(ConfigError, match=reason) as caught:
        resolve(settings)
    assert caught.value.key == "clip-reference"


@pytest.mark.usefixtures("assets")
@pytest.mark.parametrize("method", ["scaffold-lora", "fedbuff-lora"])
def test_the_server_plan_refuses_them_before_any_client_trains(method):
    from fedlr.server_apps.builtin_plans import build_plan

    config = resolve(
        {"method": method, "model": "tiny-bert", "server-update-share": 0.5}
    )
    with pytest.raises(ConfigError, match="server-update-share"):
        build_plan(config)


@pytest.mark.usefixtures("assets")
def test_the_server_examples_are_left_out_of_the_evaluation():
    from fedlr.tasks.text import text_task

    plain = text_task(resolve({"model": "tiny-bert"}).run)
    served = text_task(
        resolve(
            {
                "model": "tiny-bert",
                "server-update-share": 0.5,
                "heldout-check-examples": 100,
            }
        ).run
    )
    evaluated, own = served.heldout(), served.check_examples()
    assert len(own) == 100
    assert len(evaluated) + len(own) == len(plain.heldout())
    assert own.input_ids == plain.heldout().input_ids[len(evaluated) :]


# ------------------------------------------------------------ whole runs
class _Recorder:
    """Round hook and observer: the clients' train replies and the strategy."""

    def __init__(self) -> None:
        self.strategy: Any = None
        self.replies: list[Message] = []

    def attach(self, strategy: Any) -> None:
        self.strategy = strategy

    def __call__(self, round_: list[tuple[int, Message, Message]]) -> list[Message]:
        self.replies = [
            rep
            for _, ins, rep in round_
            if ins.metadata.message_type == MessageType.TRAIN
        ]
        return [rep for _, _, rep in round_]


@pytest.mark.slow  # whole in-process federations
@pytest.mark.usefixtures("assets")
@pytest.mark.parametrize(
    ("share", "reference"), [(0.25, "median"), (0.75, "median"), (0.5, "server")]
)
def test_the_published_arrays_are_the_weighted_mean_with_the_servers_share(
    tmp_path, share, reference
):
    """FedAvg-LoRA, one round, four clients: every published array is, in
    float64, ``(1 - s)`` times the clients' example-weighted mean plus ``s``
    times the server's own trained arrays (which a node's checks accepted),
    and the round reports that share. With ``clip-reference = "server"``
    each client's update is first clipped by the norm-clip rule at the
    server's update norm in the method's update space."""
    from fedlr.server_apps.local import run_in_process
    from fedlr.wire.updates import ClientUpdate

    recorder = _Recorder()
    overrides: dict[str, Any] = {
        "num-partitions": 4,
        "num-server-rounds": 1,
        "server-update-share": share,
    }
    if reference == "server":
        overrides |= {"robust": "norm-clip", "clip-reference": "server"}
    config = tiny_run_config(tmp_path, method="fedavg-lora", **overrides)
    run_dir = run_in_process(config, round_hook=recorder, observe=recorder.attach)
    frame = pd.read_csv(run_dir / "results.csv")
    assert frame["server-update-weight"].dropna().tolist() == pytest.approx([share])
    assert frame["clients"].dropna().tolist() == [4.0]  # the server is not a client
    strategy = recorder.strategy
    instruction = strategy.server_instruction
    own = strategy.server_update.train(instruction)  # its round's, not a new one
    sent = record_to_state(instruction.content.array_records[protocol.ARRAYS])
    server = record_to_state(own.content.array_records[protocol.ARRAYS])
    states = [
        record_to_state(r.content.array_records[protocol.ARRAYS])
        for r in recorder.replies
    ]
    counts = [
        float(r.content.metric_records[protocol.METRICS][protocol.NUM_EXAMPLES])
        for r in recorder.replies
    ]
    assert len(states) == 4
    if reference == "server":  # the rule, at the bound of the server's norm
        space = strategy.replies.space(sent)
        bound = space.norm(ClientUpdate.of_arrays(server))
        outcome = robust_aggregate(
            [
                ClientUpdate.of_arrays(x, int(n))
                for x, n in zip(states, counts, strict=True)
            ],
            space,
            RobustConfig(rule="norm-clip", clip_norm=bound),
        )
        assert frame["robust-clipped"].sum() == outcome.metrics["robust-clipped"] > 0
        assert all(space.norm(u) <= bound * (1 + 1e-6) for u in outcome.updates)
        states = [u.arrays for u in outcome.updates]
    final = torch.load(run_dir / "final_arrays.pt", weights_only=True)
    for key, got in final.items():
        clients = sum(n * s[key].double() for n, s in zip(counts, states, strict=True))
        want = (1 - share) * clients / sum(counts) + share * server[key].double()
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
