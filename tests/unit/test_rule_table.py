"""Every registered robust rule, one row each.

A rule is one module (:func:`fedlr.robust.registration.register_rule`), its
page ``docs/robust/<name>.md`` and its row here. The table must hold every
registered rule; a row with a ``flower`` reference (Flower's own function
on the same arrays) is checked against it on random float64 rounds: the
clients the rule keeps are the ones Flower's selection returns, and the
aggregate (the kept clients' weighted mean) equals Flower's. Every row is
also checked for what any rule must do: refuse nothing that is valid, keep
the round unchanged when every client sends the same update, and describe
itself at start-up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy.multikrum import select_multikrum
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from fedlr.config.run import RunConfig
from fedlr.errors import ConfigError
from fedlr.robust.builtin_rules.bulyan import bulyan_byzantine, bulyan_select
from fedlr.robust.builtin_rules.krum import KrumOptions
from fedlr.robust.builtin_rules.multi_krum import MultiKrumOptions
from fedlr.robust.estimators import distances, geometric_median_weights
from fedlr.robust.rules import RobustConfig, registered_rules, robust_aggregate
from fedlr.robust.spaces import ParameterSpace
from fedlr.server_apps.runner import guarantee_lines
from fedlr.wire.updates import ClientUpdate

ROOT = Path(__file__).resolve().parents[2]
SHAPES = {"a": (3, 4), "b": (5,)}

Flower = Callable[[list[RecordDict], RobustConfig], tuple[list[int], list[int]]]
"""(the round's contents, the config) -> (Flower's selection, the clients
whose weighted mean is the aggregate), as indices into the round."""


def _krum(
    contents: list[RecordDict], config: RobustConfig
) -> tuple[list[int], list[int]]:
    f = KrumOptions.of(config.options).krum_byzantine
    chosen = _indices(contents, select_multikrum(contents, f, 1))
    return chosen, chosen


def _multi_krum(
    contents: list[RecordDict], config: RobustConfig
) -> tuple[list[int], list[int]]:
    options = MultiKrumOptions.of(config.options)
    keep = options.multi_krum_keep or len(contents) - options.krum_byzantine
    chosen = _indices(
        contents, select_multikrum(contents, options.krum_byzantine, keep)
    )
    return chosen, chosen


def _bulyan(
    contents: list[RecordDict], config: RobustConfig
) -> tuple[list[int], list[int]]:
    """Flower's first step (``select_multikrum`` keeping ``theta = k - 2f``);
    the aggregate: the ``beta = theta - 2f`` selected closest to their
    geometric median (the client-level second step, docs/robust/bulyan.md),
    in float64 from the flattened arrays."""
    f = KrumOptions.of(config.options).krum_byzantine
    assert len(contents) >= 4 * f + 3
    theta = len(contents) - 2 * f
    chosen = _indices(contents, select_multikrum(contents, f, theta))
    flat = torch.as_tensor(np.stack([_flat(contents[i]) for i in chosen]))
    gram = flat @ flat.T
    dist = distances(gram, geometric_median_weights(gram, [1.0] * theta))
    order = sorted(range(theta), key=lambda i: (float(dist[i]), i))
    return chosen, [chosen[i] for i in order[: theta - 2 * f]]


@dataclass(frozen=True)
class Row:
    """One rule's row: the configs it is checked at (run-config keys), and
    Flower's own function where Flower ships the rule."""

    configs: tuple[dict[str, Any], ...] = ({},)
    flower: Flower | None = None


ROWS: dict[str, Row] = {
    "none": Row(),
    "norm-clip": Row(({}, {"clip-norm": 0.5})),
    "trimmed-mean": Row(({}, {"trim-fraction": 0.4})),
    "median": Row(),
    "centred-clip": Row(({}, {"bucket-size": 2})),
    "krum": Row(({}, {"krum-byzantine": 1}, {"krum-byzantine": 2}), _krum),
    "multi-krum": Row(
        (
            {},
            {"krum-byzantine": 1, "multi-krum-keep": 3},
            {"krum-byzantine": 2, "multi-krum-keep": 1},
        ),
        _multi_krum,
    ),
    "bulyan": Row(({"krum-byzantine": 1}, {"krum-byzantine": 2}), _bulyan),
}


def _robust(rule: str, keys: dict[str, Any]) -> RobustConfig:
    mapping = {"method": "fedavg-lora", "robust": rule, **keys}
    return RunConfig.from_mapping(mapping).robust_config


def _flat(content: RecordDict) -> np.ndarray:
    record = content["arrays"]
    assert isinstance(record, ArrayRecord)
    return np.concatenate([a.ravel() for a in record.to_numpy_ndarrays()])


def _indices(contents: list[RecordDict], chosen: list[RecordDict]) -> list[int]:
    return [next(i for i, c in enumerate(contents) if c is pick) for pick in chosen]


def _round(seed: int, k: int) -> tuple[list[dict[str, np.ndarray]], list[int]]:
    rng = np.random.default_rng(seed)
    scale = rng.uniform(0.5, 3.0, k)  # some clients far from the others
    arrays = [
        {key: s * rng.standard_normal(shape) for key, shape in SHAPES.items()}
        for s in scale
    ]
    return arrays, [int(n) for n in rng.integers(1, 100, k)]


def _fedlr(
    arrays: list[dict[str, np.ndarray]], counts: list[int], config: RobustConfig
) -> tuple[list[int], np.ndarray]:
    """The rule on the round (updates against a zero state, so that the
    updates are the arrays Flower sees): the kept clients and the kept
    clients' weighted mean."""
    updates = [
        ClientUpdate.of_arrays(
            {key: torch.as_tensor(a) for key, a in x.items()}, n, node_id=i
        )
        for i, (x, n) in enumerate(zip(arrays, counts, strict=True))
    ]
    space = ParameterSpace(
        {key: torch.zeros(s, dtype=torch.float64) for key, s in SHAPES.items()}
    )
    out = robust_aggregate(updates, space, config).updates
    total = sum(u.weight for u in out)
    mean = sum(
        u.weight
        / total
        * np.concatenate([u.arrays[key].numpy().ravel() for key in SHAPES])
        for u in out
    )
    return [u.node_id for u in out], np.asarray(mean)


def test_the_table_holds_every_registered_rule_and_each_has_its_page() -> None:
    names = [rule.name for rule in registered_rules()]
    assert sorted(ROWS) == names
    for rule in registered_rules():
        assert (ROOT / rule.page).is_file(), f"{rule.name}: no {rule.page}"


@pytest.mark.parametrize("name", [n for n, row in ROWS.items() if row.flower])
def test_the_rule_selects_what_flower_selects(name: str) -> None:
    """Random float64 rounds, several client counts and f: the set of
    clients kept equals Flower's selection (Bulyan: its second step's subset
    of it), and the aggregate equals Flower's weighted mean of its selection
    (Bulyan: of the client-level second step) to 1e-12."""
    row = ROWS[name]
    assert row.flower is not None
    checked = 0
    for keys in row.configs:
        config = _robust(name, keys)
        f = KrumOptions.of(config.options).krum_byzantine
        for k in (4 * f + 3, 4 * f + 4, 12):
            for seed in range(4):
                arrays, counts = _round(seed * 100 + k, k)
                contents = [
                    RecordDict(
                        {
                            "arrays": ArrayRecord(
                                {key: Array(a) for key, a in x.items()}
                            ),
                            "metrics": MetricRecord({"num-examples": n}),
                        }
                    )
                    for x, n in zip(arrays, counts, strict=True)
                ]
                selected, aggregated = row.flower(contents, config)
                kept, mean = _fedlr(arrays, counts, config)
                assert set(selected) >= set(aggregated)
                assert sorted(kept) == sorted(aggregated), (keys, k, seed)
                if name != "bulyan":
                    flower = aggregate_arrayrecords(
                        [contents[i] for i in selected], "num-examples"
                    )
                    want = np.concatenate(
                        [flower[key].numpy().ravel() for key in SHAPES]
                    )
                else:  # step 1 is Flower's selection itself
                    flat = torch.as_tensor(np.stack([_flat(c) for c in contents]))
                    first, _ = bulyan_select(flat @ flat.T, f)
                    assert sorted(first) == sorted(selected)
                    total = sum(counts[i] for i in aggregated)
                    want = sum(
                        counts[i] / total * _flat(contents[i]) for i in aggregated
                    )
                np.testing.assert_allclose(mean, want, rtol=0, atol=1e-12)
                checked += 1
    assert checked == len(row.configs) * 12


@pytest.mark.parametrize("name", ROWS)
def test_identical_updates_leave_the_round_as_it_is(name: str) -> None:
    """Every client sends the same update: whatever the rule keeps, the
    aggregate is that update (at the row's first config, which sets no
    fixed bound)."""
    config = _robust(name, ROWS[name].configs[0])
    arrays, counts = _round(7, 11)
    same = [arrays[0]] * 11
    _, mean = _fedlr(same, counts, config)
    want = np.concatenate([arrays[0][key].ravel() for key in SHAPES])
    np.testing.assert_allclose(mean, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("name", "keys"), [(n, c) for n, r in ROWS.items() for c in r.configs]
)
def test_start_up_describes_every_rule(name: str, keys: dict[str, Any]) -> None:
    """The server's start-up lines come from the registry: a rule without
    its description fails here, not at a server's start (a weight cap makes
    ``none`` active too)."""
    mapping = {
        "method": "fedavg-lora",
        "robust": name,
        "max-client-weight": 0.5,
        **keys,
    }
    config = RunConfig.from_mapping(mapping)
    rule = next(r for r in registered_rules() if r.name == name)
    lines = [line for line in guarantee_lines(config, nodes=4) if "robust" in line]
    detail = rule.startup(config.robust_config)
    assert lines == [f"robust aggregation: {detail}, max client weight 0.5"]
    assert config.to_mapping()["robust"] == name
    assert set(rule.options.option_fields()) <= set(config.to_mapping())


def test_an_unknown_rule_is_refused_by_name() -> None:
    with pytest.raises(ConfigError) as caught:
        RunConfig.from_mapping({"method": "fedavg-lora", "robust": "krum2"})
    assert caught.value.key == "robust"
    assert "'krum2'" in str(caught.value)
    for rule in registered_rules():
        assert f"'{rule.name}'" in str(caught.value)
    with pytest.raises(ConfigError, match="robust"):
        RobustConfig(rule="auto")


@pytest.mark.parametrize(
    ("keys", "key"),
    [
        ({"krum-byzantine": -1}, "krum-byzantine"),
        ({"multi-krum-keep": -1}, "multi-krum-keep"),
    ],
)
def test_a_rule_option_is_checked_from_its_declaration(
    keys: dict[str, Any], key: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        RunConfig.from_mapping(
            {"method": "fedavg-lora", "robust": "multi-krum", **keys}
        )
    assert caught.value.key == key


def test_bulyan_runs_at_the_largest_f_a_small_round_allows() -> None:
    assert [bulyan_byzantine(k, 2) for k in (2, 3, 6, 7, 10, 11, 40)] == [
        0,
        0,
        0,
        1,
        1,
        2,
        2,
    ]
    config = _robust("bulyan", {"krum-byzantine": 2})
    arrays, counts = _round(3, 7)  # f = 1: theta 5, beta 3
    kept, _ = _fedlr(arrays, counts, config)
    assert len(kept) == 3
