"""The privacy ledger's edges: malformed files, impossible entries, tiny deltas,
too many steps in a round, and the default ledger id.

Every malformed ledger stops the node with a :class:`~fedlr.errors.LedgerError`
naming the file (never a raw ``JSONDecodeError`` or ``IsADirectoryError``, never
an entry skipped); the default ledger id is a digest of the raw data the node
holds, the same whatever its tokenisation, order or personal split.
"""

from __future__ import annotations

import json
import math
import types
from pathlib import Path

import pytest
import torch
from flwr.app import RecordDict

from fedlr.client.train import TrainSettings, train_steps
from fedlr.errors import ConfigError, LedgerError, NodeConfigError, NodePolicyError
from fedlr.privacy.accounting import noise_multiplier_for
from fedlr.privacy.budget import PrivacyLedger, data_key, raw_data_key
from fedlr.privacy.dp_sgd import PrivateLoop
from fedlr.privacy.node_policy import NodePolicy
from fedlr.privacy.settings import DpSgdSettings
from tests.conftest import tiny_run_config

GOOD = {
    "noise-multiplier": 1.0,
    "sample-rate": 0.1,
    "steps": 3,
    "delta": 1e-5,
    "run-id": 1,
    "round": 1,
    "time": "",
}


def _ledger(tmp_path: Path) -> PrivacyLedger:
    ledger = PrivacyLedger(tmp_path, "node-a")
    ledger.path.parent.mkdir(parents=True, exist_ok=True)
    return ledger


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"\x89PNG\r\n\x1a\n\x00\xff\xfe garbage", "UnicodeDecodeError"),
        (b"{not json", "not JSON"),
        (b"[]", "not {"),
        (b'{"version": 1, "entries": {}}', "not {"),
        (b'{"version": 2, "entries": []}', "version 2"),
        (b'{"version": 1, "entries": [7]}', "is not an object"),
    ],
)
def test_a_malformed_ledger_stops_the_node_by_name(tmp_path, content, reason):
    ledger = _ledger(tmp_path)
    ledger.path.write_bytes(content)
    with pytest.raises(LedgerError, match=reason) as info:
        ledger.history()
    assert str(ledger.path) in str(info.value)


def test_a_directory_in_place_of_the_ledger_stops_the_node_by_name(tmp_path):
    ledger = _ledger(tmp_path)
    ledger.path.mkdir()
    with pytest.raises(LedgerError, match="IsADirectoryError"):
        ledger.history()
    ledger.path.rmdir()
    ledger.path.with_suffix(".lock").mkdir()  # the lock file's place taken too
    with pytest.raises(LedgerError, match="cannot be locked"), ledger.locked():
        pass
    blocked = PrivacyLedger(tmp_path / "file-not-dir", "node-a")
    (tmp_path / "file-not-dir").write_text("")  # the state dir is a file
    with pytest.raises(LedgerError, match="cannot be locked"), blocked.locked():
        pass


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"steps": -5}, "'steps' must be an integer >= 1, got -5"),
        ({"steps": 0}, "'steps' must be an integer >= 1, got 0"),
        ({"steps": 2.5}, "'steps' must be an integer >= 1"),
        ({"steps": True}, "'steps' must be an integer >= 1"),
        ({"noise-multiplier": math.nan}, "'noise-multiplier' must be finite"),
        ({"noise-multiplier": math.inf}, "'noise-multiplier' must be finite"),
        ({"noise-multiplier": -1.0}, "'noise-multiplier' must be finite and > 0"),
        ({"sample-rate": 0.0}, r"'sample-rate' must be in \(0, 1\]"),
        ({"sample-rate": 1.5}, r"'sample-rate' must be in \(0, 1\]"),
        ({"delta": 1.0}, r"'delta' must be in \(0, 1\)"),
        ({"steps": None}, "'steps' must be an integer >= 1, got None"),
    ],
)
def test_an_impossible_entry_is_refused_not_skipped(tmp_path, change, reason):
    ledger = _ledger(tmp_path)
    entries = [GOOD, {**GOOD, **change}]
    # json writes NaN and Infinity, as a hand-edited or corrupted file may hold
    ledger.path.write_text(json.dumps({"version": 1, "entries": entries}))
    with pytest.raises(LedgerError, match=f"impossible entry #1: {reason}"):
        ledger.history()
    with pytest.raises(LedgerError), ledger.locked():  # nor appended to
        ledger.append((1.0, 0.1, 1), run_id=1, server_round=2, delta=1e-5)
    assert len(json.loads(ledger.path.read_text())["entries"]) == 2


def test_an_impossible_release_is_not_recorded(tmp_path):
    ledger = _ledger(tmp_path)
    with ledger.locked():
        ledger.append((1.0, 0.1, 2), run_id=1, server_round=1, delta=1e-5)
        with pytest.raises(LedgerError, match="'steps' must be an integer >= 1"):
            ledger.append((1.0, 0.1, -3), run_id=1, server_round=2, delta=1e-5)
    assert ledger.history() == [(1.0, 0.1, 2)]


# ---------------------------------------------------------------- the loop
class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> types.SimpleNamespace:
        return types.SimpleNamespace(logits=self.lin(x))


class _Rows:
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        return {"x": self.x[indices], "labels": self.y[indices]}


def _rows(n: int = 40, seed: int = 1) -> _Rows:
    g = torch.Generator().manual_seed(seed)
    return _Rows(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g))


def _train(policy: NodePolicy, steps: int, **dp: float) -> PrivateLoop:
    settings = DpSgdSettings(max_grad_norm=1.0, **({"noise_multiplier": 1.0} | dp))
    control = PrivateLoop(settings, RecordDict(), policy)
    train_steps(
        _Tiny(),
        _rows(),
        TrainSettings(local_steps=steps, lr=0.1, batch_size=8),
        seed=0,
        device=torch.device("cpu"),
        control=control,
    )
    return control


def test_a_garbage_ledger_stops_training_by_name(tmp_path):
    policy = NodePolicy(state_dir=str(tmp_path), dp_ledger_id="node-a")
    ledger = PrivacyLedger(tmp_path, "node-a")
    ledger.path.parent.mkdir(parents=True)
    ledger.path.write_bytes(b"\x00\xff\x00\xfe")
    with pytest.raises(LedgerError, match="unreadable"):
        _train(policy, 2)
    assert ledger.path.read_bytes() == b"\x00\xff\x00\xfe"  # left for the operator


def test_more_dp_steps_than_the_node_allows_are_refused_before_the_ledger(tmp_path):
    ledger = PrivacyLedger(tmp_path, "node-a")
    strict = NodePolicy(
        state_dir=str(tmp_path), dp_ledger_id="node-a", dp_required=True
    )
    assert strict.dp_max_steps_per_round == 1000  # the documented default
    with pytest.raises(
        NodePolicyError, match="10000 DP-SGD steps in one round"
    ) as info:
        _train(strict, 10_000)
    assert info.value.key == "local-steps"
    assert "dp-max-steps-per-round" in str(info.value)
    assert not ledger.path.exists()  # nothing charged
    five = NodePolicy(
        state_dir=str(tmp_path), dp_ledger_id="node-a", dp_max_steps_per_round=5
    )
    with pytest.raises(NodePolicyError, match="6 DP-SGD steps"):
        _train(five, 6)
    assert not ledger.path.exists()
    _train(five, 5)
    assert [steps for _, _, steps in ledger.history()] == [5]


def test_a_delta_of_1e_300_is_refused_as_a_delta(tmp_path):
    with pytest.raises(NodeConfigError, match=r"node-config 'dp-delta'.*1e-300"):
        NodePolicy(dp_delta=1e-300)
    policy = NodePolicy(state_dir=str(tmp_path))
    # an instruction may lower delta, but not below what can be accounted
    with pytest.raises(NodePolicyError, match="'dp-delta' 1e-300 is below 1e-20"):
        _train(policy, 2, delta=1e-300)
    with pytest.raises(NodePolicyError, match="'dp-delta' 1e-300 is below"):
        _train(policy, 2, noise_multiplier=0.0, epsilon=3.0, delta=1e-300)
    assert not (tmp_path / "dp-ledger").exists() or not any(
        (tmp_path / "dp-ledger").glob("*.json")
    )
    # a budget no noise multiplier reaches names the budget and the delta
    with pytest.raises(ConfigError, match=r"'dp-epsilon': 0.5 at delta 1e-20"):
        noise_multiplier_for(0.5, 1e-20, 0.01, 1000, "prv")


# ---------------------------------------------------------------- ledger id
def test_the_default_ledger_id_ignores_order_and_padding_not_content():
    data = _rows()
    order = list(reversed(range(len(data))))
    shuffled = _Rows(data.x[order], data.y[order])
    assert data_key(data) == data_key(shuffled)
    changed = _Rows(data.x.clone(), data.y.clone())
    changed.x[3, 0] += 1e-3
    assert data_key(changed) != data_key(data)
    assert data_key(_rows(39)) != data_key(data)
    rows = [{"text": "a", "label": 0}, {"text": "b", "label": 1}]
    assert raw_data_key(rows) == raw_data_key(rows[::-1])
    assert raw_data_key(rows) != raw_data_key([rows[0], {"text": "b", "label": 0}])
    assert raw_data_key(rows) != raw_data_key([*rows, rows[0]])  # a multiset


def test_the_text_nodes_ledger_id_is_its_raw_datas(tmp_path, assets):
    """max-length 32 or 33, a personal split or a reordering of the same rows
    give one id; another partition (other data) another."""
    from fedlr.client_apps.text import _partition
    from fedlr.config.run import RunConfig
    from fedlr.tasks.text import text_task

    config = RunConfig.from_mapping(tiny_run_config(tmp_path))
    keys = {
        data_key(_partition(config, 0, 3, "all")),
        data_key(_partition(config.replace(max_length=33), 0, 3, "all")),
        data_key(_partition(config, 0, 3, "train")),
        data_key(_partition(config, 0, 3, "eval")),
    }
    assert len(keys) == 1
    rows = text_task(config).split(3).partition(0)
    assert raw_data_key(rows.shuffle(seed=3)) in keys
    # the tokenised examples differ with max-length; the id does not
    short = _partition(config, 0, 3, "all")
    longer = _partition(config.replace(max_length=33), 0, 3, "all")
    assert short.input_ids != longer.input_ids
    assert data_key(_partition(config, 1, 3, "all")) not in keys
