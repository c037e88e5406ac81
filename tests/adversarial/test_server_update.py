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

from fedlr.config.run import RunConfig
from fedlr.errors import ConfigError
from fedlr.flower.records import record_to_state
from fedlr.robust.rules import RobustConfig, robust_aggregate
from fedlr.robust.server_update import (
    AUTO_SHARE,
    ServerUpdate,
    check_server_update_strategy,
    server_update_refusal,
    server_weight,
)
from fedlr.strategies.refusals import reply_records
from fedlr.strategies.registry import available_methods, resolve
from fedlr.wire import protocol
from tests.conftest import tiny_run_config
from tests.strategies.test_every_method import CASES


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
        ({"method": "scaffold-lora"}, "scaffold-delta"),
        ({"method": "fedbuff-lora"}, "asynchronous engine"),
        ({"method": "hetlora", "client-ranks": "2,4"}, "client-ranks"),
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


# ------------------------------------------------------------ robust = auto
def _bare(method: str) -> dict[str, Any]:
    """The run config a user writes for ``method``: its name, and a model and
    data set of its family where the default task's are not."""
    case = CASES.get(method)
    family = {} if case is None else case.overrides
    return {
        "method": method,
        **{k: family[k] for k in ("model", "dataset") if k in family},
    }


@pytest.mark.parametrize("method", available_methods())
def test_auto_is_the_servers_update_with_its_clip_wherever_it_can_run(method):
    """Every registered method, with nothing but its name: ``robust = auto``
    (the default) is the server's update at share 0.5 with every client
    clipped at its norm exactly where the refusal finds nothing, else no
    rule, and the start-up line says which and why."""
    assert RunConfig.from_mapping({}).robust == "auto"
    config = resolve(_bare(method))
    spec, run = config.spec, config.run
    reason = server_update_refusal(
        spec.name,
        spec.payload.name,
        spec.traits.personalised,
        secure_aggregation=False,
        client_dp=False,
        records=sorted({r.name for _, r in reply_records(spec.client, spec.records)}),
        asynchronous=spec.strategy.asynchronous,
    )
    if reason is None:
        assert (run.robust, run.clip_reference) == ("norm-clip", "server")
        assert run.server_update_share == AUTO_SHARE == 0.5
        assert "norm of the server's own update" in config.auto
    else:
        assert (run.robust, run.server_update_share) == ("none", 0.0)
        assert reason in config.auto
    resolved = resolve({**_bare(method), **config.run.to_mapping()})
    assert resolved.run == run  # resolving the resolved config changes nothing


def test_auto_on_the_default_task_is_the_studys_serverclip_defence():
    """The published 5-seed numbers (docs/results/robustness.md) are the
    default's: ``robust = auto`` on the default method is the study's
    ``serverclip`` defence, key for key."""
    from benchmarks.robustness import DEFENCES

    run = resolve({}).run
    assert run.method == "fedex-lora"
    for key, value in DEFENCES["serverclip"].items():
        assert run.to_mapping()[key] == value, key
    assert run.clip_ratio == 1.0 and run.clip_norm == 0.0


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        ({"secure-aggregation": True}, "secure-aggregation"),
        ({"method": "hetlora", "client-ranks": "2,4"}, "client-ranks"),
        ({"method": "fedsa-lora"}, "personalised"),
        ({"method": "scaffold-lora"}, "scaffold-delta"),
    ],
)
def test_auto_is_no_rule_where_the_server_cannot_train_and_says_why(settings, why):
    config = resolve(settings)
    assert config.run.robust == "none" and config.run.server_update_share == 0
    assert config.auto.startswith("robust = auto: no rule") and why in config.auto


def test_a_rule_that_is_set_is_kept_and_a_share_that_is_set_is_used():
    for rule in ("none", "median", "norm-clip", "krum"):
        config = resolve({"robust": rule})
        assert config.run.robust == rule and config.auto == ""
        assert config.run.server_update_share == 0
    assert resolve({"server-update-share": 0.25}).run.server_update_share == 0.25
    with pytest.raises(ConfigError, match="must be one of") as caught:
        resolve({"robust": "kurm"})
    assert caught.value.key == "robust" and "'auto'" in str(caught.value)
    # an explicit share the method cannot take is refused, not turned off
    with pytest.raises(ConfigError, match="personalised") as caught:
        resolve({"method": "fedsa-lora", "server-update-share": 0.25})
    assert caught.value.key == "server-update-share"


@pytest.mark.slow  # one small in-process federation per method
@pytest.mark.usefixtures("assets")
@pytest.mark.parametrize(
    "method",
    [m for m in available_methods() if resolve(_bare(m)).run.server_update_share],
)
def test_every_method_auto_turns_on_runs_with_it(tmp_path, method):
    """Each method that ``robust = auto`` gives the server's update runs a
    two-round federation with it: both rounds aggregate it at share 0.5,
    nothing is dropped, and the model stays finite."""
    from fedlr.launch.local import run_in_process

    config = tiny_run_config(
        tmp_path,
        method=method,
        robust="auto",
        **{"num-server-rounds": 2, "local-steps": 2, "num-partitions": 2},
    )
    frame = pd.read_csv(run_in_process(config) / "results.csv")
    trained = frame.dropna(subset=["server-update-weight"])
    assert trained["round"].tolist() == [1, 2]
    assert trained["server-update-weight"].tolist() == [0.5, 0.5]
    assert trained["dropped"].sum() == 0
    assert all(math.isfinite(x) for x in trained["server-update-loss"])
    assert math.isfinite(frame["loss"].dropna().iloc[-1])


@pytest.mark.usefixtures("assets")
def test_the_server_examples_are_left_out_of_the_evaluation():
    from fedlr.tasks.text import text_task

    plain = text_task(resolve({"model": "tiny-bert", "robust": "none"}).run)
    default = text_task(resolve({"model": "tiny-bert"}).run)  # robust = auto
    assert len(default.heldout()) == len(plain.heldout()) - 128
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
    ("share", "reference"),
    [(0.25, "median"), (0.75, "median"), (0.5, "server"), (0.5, "auto")],
)
def test_the_published_arrays_are_the_weighted_mean_with_the_servers_share(
    tmp_path, share, reference
):
    """FedAvg-LoRA, one round, four clients: every published array is, in
    float64, ``(1 - s)`` times the clients' example-weighted mean plus ``s``
    times the server's own trained arrays (which a node's checks accepted),
    and the round reports that share. With ``clip-reference = "server"``
    each client's update is first clipped by the norm-clip rule at the
    server's update norm in the method's update space; ``robust = auto``
    (the default) is that, at share 0.5."""
    from fedlr.launch.local import run_in_process
    from fedlr.wire.updates import ClientUpdate

    recorder = _Recorder()
    overrides: dict[str, Any] = {
        "num-partitions": 4,
        "num-server-rounds": 1,
        "server-update-share": share,
    }
    if reference == "server":
        overrides |= {"robust": "norm-clip", "clip-reference": "server"}
    if reference == "auto":  # the default: nothing set but the method
        overrides = {k: v for k, v in overrides.items() if k != "server-update-share"}
        overrides["robust"] = "auto"
    config = tiny_run_config(tmp_path, method="fedavg-lora", **overrides)
    run_dir = run_in_process(config, round_hook=recorder, observe=recorder.attach)
    frame = pd.read_csv(run_dir / "results.csv")
    assert frame["server-update-weight"].dropna().tolist() == pytest.approx([share])
    assert frame["clients"].dropna().tolist() == [4.0]  # the server is not a client
    strategy = recorder.strategy
    instruction = strategy.round.instruction
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
    if reference in ("server", "auto"):  # the rule, at the server's norm
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


@pytest.mark.slow  # one small in-process federation
@pytest.mark.usefixtures("assets")
def test_the_servers_examples_are_not_held_to_the_clients_cap(tmp_path):
    """Eight IID clients of 400 examples under a cap of 400, the server with
    600 validation examples: its update is aggregated at its share (the cap
    bounds what a client's claim buys, not the server's fixed share)."""
    from fedlr.launch.local import run_in_process

    config = tiny_run_config(
        tmp_path,
        method="fedavg-lora",
        robust="auto",
        partitioner="iid",
        **{
            "num-partitions": 8,
            "num-server-rounds": 1,
            "local-steps": 1,
            "max-num-examples": 400,
            "heldout-check-examples": 600,
        },
    )
    frame = pd.read_csv(run_in_process(config) / "results.csv")
    row = frame.dropna(subset=["server-update-weight"]).iloc[-1]
    assert row["server-update-weight"] == 0.5
    assert row["clients"] == 8 and row["dropped"] == 0
