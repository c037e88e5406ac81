"""Every record a client feature receives is checked from its declaration.

Driven by the registry: every record any registered method's client feature
declares in ``receives`` (:attr:`fedlr.client.features.Record.expects`) is
taken from a real instruction of a method that sends it (a run of the
plug-in app in process, ``SOURCES``), then broken three ways: one array
missing, one of another shape, one holding NaN. Each is refused by
:class:`~fedlr.errors.FeatureRecordError` naming the record, before anything
changes: the model's parameters and the node's ``context.state`` are as
before, and no training step ran (the error comes from ``apply_round``,
which returns the job the loop trains).
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict

from fedlr import apply_round
from fedlr.client.features import ClientFeature
from fedlr.client_apps import lora
from fedlr.errors import FeatureRecordError
from fedlr.launch.local import run_in_process
from fedlr.strategies.registry import client_features, registered_methods
from fedlr.wire import protocol
from tests.conftest import tiny_run_config
from tests.plugin_app.task import build_model
from tests.strategies.test_plugin import _run

SOURCES: dict[str, tuple[str, dict[str, object]]] = {
    # fedlr's own app on the tiny BERT (``TINY``): the plug-in MLP's base
    # weights are smaller dense than as changes, and its server app does not
    # pass HiLoRA's stage lengths
    protocol.BASE_DELTA: ("fedex-lora", {"num-server-rounds": 3}),
    protocol.PERSONAL: ("global-svd", {"num-server-rounds": 2}),
    "scaffold-control": ("scaffold-lora", {"num-server-rounds": 1}),
    "hilora-tiers": (
        "hilora",
        {
            "num-server-rounds": 3,
            "local-steps": 1,
            "hilora-root-rounds": 1,
            "hilora-cluster-rounds": 1,
        },
    ),
    "fedlease-mixture": ("fedlease", {"num-server-rounds": 2}),
}
"""Each declared received record: a method that sends it, and its run."""
TINY = {protocol.BASE_DELTA, "hilora-tiers"}


def _declared() -> dict[str, type[ClientFeature]]:
    return {r.name: f for f in client_features() for r in f.receives}


def test_every_received_record_has_a_rule_and_a_source_here():
    declared = _declared()
    assert set(declared) == set(SOURCES)
    for name, feature in declared.items():
        method, _ = SOURCES[name]
        [spec] = [s for s in registered_methods() if s.name == method]
        assert feature in spec.client, (name, method)
        assert all(r.expects is not None for r in feature.receives)


def test_a_feature_receiving_an_undeclared_record_is_refused_at_definition():
    from fedlr.client.features import Record

    with pytest.raises(TypeError, match=r"\['mine'\] without declaring"):

        class Careless(ClientFeature):
            receives = (Record("mine", "something"),)


_CAPTURED: dict[str, list[tuple[Message, torch.nn.Module, Context]]] = {}


def _instructions(name: str) -> list[tuple[Message, torch.nn.Module, Context]]:
    """Node 0's honest instructions carrying ``name`` (one per distinct key
    set: HiLoRA's cluster and leaf stages), each with a copy of the model it
    reached and a node context; every one was answered without an error."""
    if name in _CAPTURED:
        return _CAPTURED[name]
    method, overrides = SOURCES[name]
    seen: dict[tuple[str, ...], tuple[Message, torch.nn.Module]] = {}
    errors: list[str] = []

    def hook(partition: int, instruction: Message, reply: Message) -> Message:
        records = instruction.content.array_records
        if partition == 0 and name in records:
            keys = tuple(sorted(records[name]))
            if keys not in seen:
                model = _cached() if name in TINY else build_model(method)
                seen[keys] = (copy.deepcopy(instruction), model)
            if reply.has_error():
                errors.append(reply.error.reason)
        return reply

    context = Context(
        run_id=1,
        node_id=1000,
        node_config={"partition-id": 0, "num-partitions": 3},
        state=RecordDict(),
        run_config={},
    )
    if name in TINY:
        out = Path(tempfile.mkdtemp(prefix="feature-records-"))
        config = tiny_run_config(out, method=method, **overrides)
        run_in_process(config, reply_hook=hook)
    else:
        _, grid = _run(method, hook=hook, **overrides)
        context = grid.contexts[1000]
    assert seen and not errors, (name, errors)
    _CAPTURED[name] = [(m, model, context) for m, model in seen.values()]
    return _CAPTURED[name]


def _cached() -> torch.nn.Module:
    """fedlr's app's last cached model, as it was when the node replied (the
    refusals are checked before anything changes, so its values matter not,
    its layout does)."""
    return copy.deepcopy(list(lora.CLIENT._models.values())[-1].model)


def _broken(message: Message, name: str, how: str) -> tuple[Message, str] | None:
    """``message`` with its record ``name`` broken ``how``, and the key
    broken (``None``: every array is empty, nothing to break)."""
    bad = copy.deepcopy(message)
    record = bad.content.array_records[name]
    arrays = {k: record[k] for k in record}
    filled = [k for k in arrays if np.prod(arrays[k].shape) > 0]
    if not filled:
        return None
    key = min(filled)
    value = np.array(arrays[key].numpy())
    if how == "missing":
        del arrays[key]
    elif how == "shape":
        arrays[key] = Array(np.zeros((value.shape[0] + 1, *value.shape[1:]), "f4"))
    else:
        value = value.copy()
        value.flat[0] = np.nan
        arrays[key] = Array(value)
    bad.content[name] = ArrayRecord(arrays)
    return bad, key


def _snapshot(model: torch.nn.Module, context: Context):
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = {
        name: {k: bytes(a.data) for k, a in record.items()}
        for name, record in context.state.array_records.items()
    }
    return params, state


@pytest.mark.parametrize("how", ["missing", "shape", "nan"])
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_a_broken_record_is_refused_by_name_before_anything_changes(name, how):
    tested = 0
    for message, built, node in _instructions(name):
        broken = _broken(message, name, how)
        if broken is None:
            continue
        bad, key = broken
        tested += 1
        model = copy.deepcopy(built)
        context = copy.deepcopy(node)
        before = _snapshot(model, context)
        with pytest.raises(FeatureRecordError) as info:
            apply_round(model, bad, context)
        assert info.value.record == name and info.value.key == key
        assert f"(in '{name}')" in str(info.value)
        params, state = _snapshot(model, context)
        assert state == before[1]
        assert params.keys() == before[0].keys()
        for k, v in params.items():
            assert torch.equal(v, before[0][k]), (name, how, k)
    assert tested >= 1, name


@pytest.mark.parametrize("name", ["fedlease-mixture", "hilora-tiers"])
def test_an_absent_record_the_settings_need_is_refused_by_name(name):
    """Where the instruction's settings switch the feature on (the others'
    switch is the record itself: SCAFFOLD's control, ``personal``, or
    ``base-delta``, without which the node takes the dense weights)."""
    for message, built, node in _instructions(name):
        bad = copy.deepcopy(message)
        del bad.content[name]
        with pytest.raises(FeatureRecordError, match=f"'{name}' is missing"):
            apply_round(copy.deepcopy(built), bad, copy.deepcopy(node))
