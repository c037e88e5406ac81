"""A client feature owns its surface (issue 34, items 2 and 4).

* A feature's wire keys and their bounds are declared on its class; the
  node's instruction check covers them with no edit of
  ``fedlr/client/checks.py`` or ``fedlr/wire/protocol.py`` (a feature defined
  here, with a key of its own, is checked by the node);
* the traits the features declare drive the configuration-time refusals:
  scaffold-lora's ``scaffold-delta`` and fot's ``sketches`` with client-level
  DP are refused when the run config is resolved, naming the method, the
  record and the reason;
* a user's reply metrics may not reuse a name a feature declares;
* the round's LoRA rank is decided by one function
  (:func:`fedlr.client.pruning.round_rank`);
* the generated docs rows are current, and a stale one is found.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from peft import LoraConfig, get_peft_model

from fedlr import apply_round
from fedlr.adapters.plugin import adapted
from fedlr.adapters.roles import Role
from fedlr.client.checks import (
    BOUNDS,
    NodeLimits,
    bound_of,
    check_config,
    declare_bounds,
    declared_keys,
)
from fedlr.client.features import Bound, ClientFeature, Record, RoundJob
from fedlr.client.pruning import PRUNE_GAMMA, RANK_STATE, RoundRank, round_rank
from fedlr.configdoc import features as featuredoc
from fedlr.errors import InstructionError, PrivacyUnsupportedError, ProtocolError
from fedlr.flower.records import state_to_record
from fedlr.strategies.registry import client_features, get_method, resolve
from fedlr.wire import protocol
from tests.conftest import ROOT

LABEL_SMOOTHING = "test-label-smoothing"


class _LabelSmoothing(ClientFeature):
    """A method's new client feature, with a new instruction key and bound,
    defined here: nothing else is edited."""

    keys = (Bound(LABEL_SMOOTHING, "float", 0.0, 1.0, low_open=True),)
    order = 77

    @classmethod
    def for_round(cls, job: RoundJob) -> _LabelSmoothing | None:
        return cls() if LABEL_SMOOTHING in job.config else None


# ------------------------------------------------------------ the wire keys
def test_a_new_features_key_is_checked_by_the_node_without_editing_the_checks():
    assert bound_of(LABEL_SMOOTHING) == _LabelSmoothing.keys[0]
    assert LABEL_SMOOTHING not in {b.key for b in BOUNDS}
    assert not hasattr(protocol, "LABEL_SMOOTHING")
    limits = NodeLimits()
    check_config({LABEL_SMOOTHING: 0.1, protocol.LR: 0.1}, limits)  # accepted
    for bad, why in [
        (0.0, r"must be in \(0, 1\], got 0.0"),
        (1.5, r"must be in \(0, 1\], got 1.5"),
        (float("nan"), "got nan"),
        ("0.1", "is str '0.1', expected a number"),
        (True, "is bool True, expected a number"),
    ]:
        with pytest.raises(InstructionError, match=why) as caught:
            check_config({LABEL_SMOOTHING: bad}, limits)
        assert caught.value.key == LABEL_SMOOTHING
    declared = {d.key: d for d in declared_keys()}[LABEL_SMOOTHING]
    assert declared.owner == f"{__name__}._LabelSmoothing"


def _lora_model(rank: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU())
    config = LoraConfig(r=rank, lora_alpha=4, target_modules=["0"])
    return get_peft_model(net, config)


def _message(model: torch.nn.Module, config: dict[str, Any]) -> Message:
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 0
    roles = (Role.LORA_A, Role.LORA_B)
    arrays = state_to_record(adapted(model).state(roles))
    base = {protocol.LR: 0.1, protocol.TRAIN_ROLES: protocol.encode_roles(roles)}
    content = RecordDict(
        {protocol.ARRAYS: arrays, protocol.CONFIG: ConfigRecord({**base, **config})}
    )
    return Message(content=content, dst_node_id=1, message_type="train")


def _context() -> Context:
    return Context(
        run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={}
    )


def test_the_node_refuses_a_bad_value_of_the_new_key_before_changing_anything():
    model = _lora_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(InstructionError, match=f"'{LABEL_SMOOTHING}'"):
        apply_round(model, _message(model, {LABEL_SMOOTHING: 2.0}), _context())
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    job = apply_round(model, _message(model, {LABEL_SMOOTHING: 0.5}), _context())
    assert job.is_train


def test_every_methods_feature_key_has_its_bound_with_the_feature():
    features = [f for f in client_features() if f.__module__.startswith("fedlr.strat")]
    owned = {k.key for f in features for k in f.keys if isinstance(k, Bound)}
    # the keys that moved out of BOUNDS and fedlr.wire.protocol into their features
    assert owned >= {"proximal-mu", "prune-gamma", "prune-lambda", "fold-tail"}
    assert owned >= {"client-svd", "base-version", "base-check"}
    for name in ("PROXIMAL_MU", "PRUNE_GAMMA", "FOLD_TAIL", "CLIENT_SVD"):
        assert not hasattr(protocol, name), name
    assert not owned & {b.key for b in BOUNDS}


def test_a_key_has_one_owner_and_the_common_keys_are_not_redeclared():
    with pytest.raises(ValueError, match="'lr', a key of the common round"):
        declare_bounds("tests.Mine", [Bound(protocol.LR, "float", 0.0)])
    with pytest.raises(
        ValueError,
        match=r"tests.Other declares 'proximal-mu'.*"
        r"fedlr.strategies.fedprox_lora.ProximalTerm declared",
    ):
        declare_bounds("tests.Other", [Bound("proximal-mu", "float", 0.0, 1.0)])
    with pytest.raises(TypeError, match="a Bound or a str"):
        declare_bounds("tests.Mine", [("x", "float")])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="high names no node limit"):
        Bound("x", "int", 0, "max_rnak")
    # the same bound read by a second feature is accepted, the first keeps it
    declare_bounds("tests.Reader", [Bound("proximal-mu", "float", 0.0)])
    owner = {d.key: d.owner for d in declared_keys()}["proximal-mu"]
    assert owner == "fedlr.strategies.fedprox_lora.ProximalTerm"


# ------------------------------------------------ records and their refusals
CLIENT_DP = {"client-dp-clip": 1.0, "client-dp-noise-multiplier": 1.0}


@pytest.mark.parametrize(
    ("method", "record", "holder"),
    [
        ("scaffold-lora", "scaffold-delta", "ScaffoldCorrection"),
        ("fot", "sketches", "the method's client"),
    ],
)
def test_client_dp_with_extra_reply_records_is_refused_at_configuration(
    method, record, holder
):
    assert get_method(method).traits.sum_only  # not refused for that reason
    with pytest.raises(PrivacyUnsupportedError) as caught:
        resolve({"method": method, **CLIENT_DP})
    message = str(caught.value)
    assert message.startswith("client-dp-clip:")
    assert f"method '{method}'" in message
    assert f"'{record}' ({holder}:" in message
    assert "would reach the server as sent, outside the epsilon" in message
    resolve({"method": method})  # the method alone is fine


@pytest.mark.parametrize("method", ["fedavg-lora", "fedavg-continual", "ffa-lora"])
def test_client_dp_is_accepted_for_sum_only_methods_without_records(method):
    assert resolve({"method": method, **CLIENT_DP}).run.privacy.client_dp is not None


def test_the_records_are_declared_by_the_feature_or_the_registration():
    scaffold = get_method("scaffold-lora").client
    assert [r.name for f in scaffold for r in f.sends] == ["scaffold-delta"]
    assert [r.name for f in scaffold for r in f.receives] == ["scaffold-control"]
    assert [r.name for f in scaffold for r in f.node_state] == ["fedlr-scaffold"]
    assert [r.name for r in get_method("fot").records] == [protocol.SKETCHES]
    assert [r.name for r in get_method("qrmix").records] == [protocol.EIGEN]
    assert get_method("fedavg-continual").records == ()
    assert all(isinstance(r, Record) for r in get_method("fot").records)


def test_a_user_metric_may_not_reuse_a_name_a_feature_declares():
    model = _lora_model()
    job = apply_round(model, _message(model, {}), _context())
    declared = {m.name for f in client_features() for m in f.metrics}
    assert {"rank-pruned", "base-held", "personal-loaded"} <= declared
    for name in ("rank-pruned", "dp-epsilon-spent", protocol.NUM_EXAMPLES):
        with pytest.raises(
            ProtocolError, match=f"'{name}'.*written by fedlr.client.round"
        ):
            job.reply(num_examples=3, metrics={name: 1.0})
    assert job.reply(num_examples=3, metrics={"train-loss": 0.5}).content


# ------------------------------------------------------------ the round rank
def _kept(rank: int) -> RecordDict:
    return RecordDict({RANK_STATE: ConfigRecord({"rank": rank})})


@pytest.mark.parametrize(
    ("config", "state", "kwargs", "want"),
    [
        ({protocol.LORA_RANK: 6}, _kept(2), {"own": 4}, RoundRank(6, "instruction")),
        ({}, None, {"own": 4}, RoundRank(4, "node")),
        ({}, None, {"own": None, "model_rank": 8}, RoundRank(None, "model")),
        # a kept (pruned) rank counts under leading-rank only
        ({protocol.LEADING_RANK: True}, _kept(2), {"own": 4}, RoundRank(2, "kept")),
        ({}, _kept(2), {"own": 4}, RoundRank(4, "node")),
        # pruning: a narrower instruction is a pruned rank the node lost
        (
            {protocol.LEADING_RANK: True, PRUNE_GAMMA: 0.5},
            None,
            {"own": 4, "received": 2},
            RoundRank(2, "server-pruned", instead=4),
        ),
        (
            {protocol.LEADING_RANK: True, PRUNE_GAMMA: 0.5},
            None,
            {"own": 4, "received": 8},  # wider: the node's own rank
            RoundRank(4, "node"),
        ),
        (
            {protocol.LEADING_RANK: True},  # no pruning: never adopted
            None,
            {"own": 4, "received": 2},
            RoundRank(4, "node"),
        ),
    ],
)
def test_the_round_rank_is_one_decision(config, state, kwargs, want):
    got = round_rank(config, state, **kwargs)
    assert got == want
    assert got.adopted == (want.source == "server-pruned")


def test_the_node_serves_the_round_at_the_decided_rank_and_keeps_an_adopted_one():
    model = _lora_model()  # rank 2
    narrow = _lora_model(rank=1)  # arrays at rank 1
    context = _context()
    job = apply_round(model, _message(narrow, {protocol.LORA_RANK: 1}), context)
    assert {m.rank for m in job.adapted.layout.modules} == {1}
    # the next instruction without lora-rank: the node's own rank again
    job = apply_round(model, _message(_lora_model(), {}), context, rank=2)
    assert {m.rank for m in job.adapted.layout.modules} == {2}
    assert RANK_STATE not in context.state.config_records
    # pruning under leading-rank, an instruction at rank 1: taken and kept
    message = _message(narrow, {protocol.LEADING_RANK: True, PRUNE_GAMMA: 0.5})
    job = apply_round(model, message, context, rank=2)
    assert {m.rank for m in job.adapted.layout.modules} == {1}
    assert context.state.config_records[RANK_STATE]["rank"] == 1
    # and later rounds are served at the kept rank, whatever the node's own
    job = apply_round(
        model, _message(narrow, {protocol.LEADING_RANK: True}), context, rank=2
    )
    assert {m.rank for m in job.adapted.layout.modules} == {1}


# ------------------------------------------------------------ generated docs
def test_the_committed_docs_rows_are_generated_from_the_declarations():
    for path, text in featuredoc.generated(ROOT).items():
        assert path.read_text() == text, f"{path}: run `{featuredoc.COMMAND}`"
    keys = featuredoc.render_keys()
    assert (
        "| `proximal-mu` | finite number >= 0 | `ProximalTerm` (fedprox-lora) |" in keys
    )
    assert "| `prune-gamma` | number in (0, 1] | `RankSelfPruning` (hetlora) |" in keys
    assert LABEL_SMOOTHING not in keys  # no registered method lists the feature
    features = featuredoc.render_features()
    assert "`scaffold-delta`: the node's control-variate change" in features
    rows = featuredoc.render_method_privacy()
    assert "| `fot` |" in rows and "`sketches` would reach the server un-noised" in rows


def test_a_stale_row_is_found_by_the_check(tmp_path: Path):
    from fedlr.configdoc import generate as configdoc

    for name in (
        "pyproject.toml",
        "README.md",
        "docs/configuration.md",
        "docs/reliability.md",
        "docs/privacy.md",
        "docs/plugin.md",
    ):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    reliability = tmp_path / "docs" / "reliability.md"
    reliability.write_text(
        reliability.read_text().replace(
            "| `proximal-mu` | finite number >= 0 |", "| `proximal-mu` | bool |"
        )
    )
    stale = configdoc.outdated(tmp_path)
    assert [item.path for item in stale] == [reliability]
    assert "+| `proximal-mu` | finite number >= 0 |" in stale[0].diff
    configdoc.write(tmp_path)
    assert configdoc.outdated(tmp_path) == []
