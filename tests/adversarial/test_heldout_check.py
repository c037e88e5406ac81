"""The held-out check (fedlr.robust.heldout): leave out a reply that makes the
server's model worse on validation examples the clients never see."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
import torch
from flwr.app import Message

from fedlr.errors import ConfigError
from fedlr.flower.records import record_to_state
from fedlr.robust.heldout import HeldOutCheck, leave_one_out
from fedlr.strategies.registry import resolve
from tests.adversarial.payloads import _INSTRUCTIONS, _scaled
from tests.conftest import tiny_run_config

INF, NAN = math.inf, math.nan


@pytest.mark.parametrize(
    ("loss_all", "without", "margin", "left_out"),
    [  # dyadic numbers: the differences are exact
        (0.75, [0.6875, 0.8125, 0.75], 0.125, None),  # all within the margin
        (0.75, [0.6875, 0.8125, 0.5], 0.125, 2),
        (0.75, [0.5, 0.8125, 0.5], 0.125, 0),  # ties: the first
        (0.75, [0.6875, 0.8125, 0.75], 0.0, 0),  # margin 0: any improvement
        (0.75, [0.625, 0.8125, 0.75], 0.125, None),  # exactly the margin: kept
        (INF, [0.875, NAN, 2.0], 0.125, 0),  # a diverged aggregate: a finite try wins
        (NAN, [INF, 3.0, 4.0], 0.125, 1),
        (0.75, [NAN, INF, NAN], 0.125, None),  # no finite try: nothing to choose
    ],
)
def test_leave_one_out_rule(loss_all, without, margin, left_out):
    assert leave_one_out(loss_all, without, margin) == left_out


def test_a_bad_margin_is_refused_by_name():
    with pytest.raises(ConfigError, match="heldout-check-margin"):
        HeldOutCheck(lambda state: 0.0, -0.1, 8)
    with pytest.raises(ConfigError, match="heldout-check-margin"):
        resolve({"heldout-check": True, "heldout-check-margin": -1.0})


@pytest.mark.parametrize(
    ("settings", "reason"),
    [
        (
            {"method": "fedavg-lora", "secure-aggregation": True},
            "under SecAgg\\+ the server sees only their sum",
        ),
        (
            {
                "method": "fedavg-lora",
                "client-dp-clip": 1.0,
                "client-dp-noise-multiplier": 1.0,
            },
            "client-level DP's sensitivity",
        ),
        ({"method": "fedsa-lora"}, "personalised"),
        ({"method": "qrmix", "model": "cnn", "dataset": "digits"}, "'qrmix' payloads"),
    ],
)
def test_the_check_is_refused_where_the_server_cannot_make_it(settings, reason):
    with pytest.raises(ConfigError, match=reason) as caught:
        resolve({**settings, "heldout-check": True})
    assert caught.value.key == "heldout-check"


@pytest.mark.usefixtures("assets")
def test_the_check_examples_are_the_last_of_the_heldout_split_and_never_evaluated():
    from fedlr.tasks.text import text_task

    plain = text_task(resolve({"model": "tiny-bert", "robust": "none"}).run)
    checked = text_task(
        resolve(
            {
                "model": "tiny-bert",
                "robust": "none",
                "heldout-check": True,
                "heldout-check-examples": 100,
            }
        ).run
    )
    rows = plain.split().heldout
    evaluated, validation = checked.heldout(), checked.check_examples()
    assert len(evaluated) + len(validation) == len(rows) == len(plain.heldout())
    assert len(validation) == 100
    ids = plain.heldout().input_ids
    assert evaluated.input_ids == ids[: len(evaluated)]
    assert validation.input_ids == ids[len(evaluated) :]
    assert plain.check_examples() is None
    too_many = resolve(
        {"model": "tiny-bert", "heldout-check": True, "heldout-check-examples": 10**6}
    ).run
    with pytest.raises(ConfigError, match="heldout-check-examples"):
        text_task(too_many).heldout()


# ------------------------------------------------------------ whole runs
def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "final_arrays.pt", weights_only=True)


def _assert_same_arrays(a: Path, b: Path) -> None:
    got, want = _final(a), _final(b)
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.slow  # whole in-process federations (tests/adversarial/test_runs.py)
@pytest.mark.usefixtures("assets")
@pytest.mark.parametrize("method", ["fedex-lora", "fedavgm-lora"])
def test_the_checks_tries_leave_the_method_as_it_was(tmp_path, method):
    """With a margin nothing exceeds, a run with the check publishes exactly
    the arrays of the run without it: every try's state was restored
    (FedAvgM-LoRA's momentum, FedEx-LoRA's folded base)."""
    from fedlr.launch.local import run_in_process

    config = tiny_run_config(tmp_path / "plain", method=method, **{"num-partitions": 4})
    plain = run_in_process(config)
    checked = run_in_process(
        {
            **config,
            "output-dir": str(tmp_path / "checked"),
            "heldout-check": True,
            "heldout-check-margin": 1e9,
        }
    )
    frame = pd.read_csv(checked / "results.csv")
    assert (frame["heldout-left-out"] == 0).all()
    assert frame["heldout-loss"].between(0, 5).all()
    _assert_same_arrays(checked, plain)


@pytest.mark.slow
@pytest.mark.usefixtures("assets")
def test_a_flipped_client_under_the_screen_is_left_out_every_round(tmp_path):
    """Five clients; partition 0 sends its honest update flipped and boosted
    8x (under the default 20x screen: 0 dropped). The check leaves it out
    first every round, and then decides on the honest four exactly as in the
    run in which its replies were lost (same arrays at the end, one more
    reply left out per round)."""
    from fedlr.launch.local import run_in_process

    flip = _scaled(-8.0)

    def attack(partition: int, instruction: Message, reply: Message) -> Message | None:
        if partition != 0 or reply.has_error():
            return reply
        _INSTRUCTIONS[int(instruction.metadata.dst_node_id)] = instruction
        sent = record_to_state(instruction.content.array_records["arrays"])
        (forged,) = flip(reply, sent)
        return forged

    config = tiny_run_config(
        tmp_path / "attacked",
        **{"num-partitions": 5, "num-server-rounds": 3, "heldout-check": True},
    )
    attacked = run_in_process(config, reply_hook=attack)
    lost = run_in_process(
        {**config, "output-dir": str(tmp_path / "lost")},
        reply_hook=lambda p, i, r: None if p == 0 else r,
    )
    frame = pd.read_csv(attacked / "results.csv")
    honest = pd.read_csv(lost / "results.csv")
    assert frame["dropped"].tolist() == [0, 0, 0]  # the screen let it through
    assert (frame["heldout-left-out"] == honest["heldout-left-out"] + 1).all()
    _assert_same_arrays(attacked, lost)
