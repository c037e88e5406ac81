"""The node-config declarations: one list of keys, the readers' defaults, the docs;
and ``resume-from`` naming the real difference first."""

from __future__ import annotations

from dataclasses import dataclass, fields

import pytest

from fedlr.errors import ConfigError, NodeConfigError
from fedlr.options import kebab, option
from fedlr.privacy.node_policy import (
    NODE_CONFIG_KEYS,
    NODE_POLICY_KEYS,
    NodePolicy,
    NodeSettings,
    check_node_config,
)
from tests.conftest import ROOT


def test_the_known_keys_are_the_declared_fields():
    declared = {
        kebab(f.name) for cls in (NodePolicy, NodeSettings) for f in fields(cls)
    }
    assert set(NODE_CONFIG_KEYS) == declared
    assert set(NODE_POLICY_KEYS) == {kebab(f.name) for f in fields(NodePolicy)}
    # every declaration has its help text, and its default passes its checks
    for key, f in NODE_CONFIG_KEYS.items():
        assert f.metadata.get("help"), key
    NodePolicy()
    NodeSettings()


def test_a_field_added_to_a_declaration_is_a_known_typed_key():
    @dataclass(frozen=True)
    class Wider(NodePolicy):
        dp_extra_limit: int = option(3, "a key added as a field", range=">= 1")

    assert Wider.from_mapping({"dp-extra-limit": 5}).dp_extra_limit == 5
    with pytest.raises(NodeConfigError, match="'dp-extra-limit': must be >= 1"):
        Wider.from_mapping({"dp-extra-limit": 0})
    with pytest.raises(NodeConfigError, match="expected an integer"):
        Wider.from_mapping({"dp-extra-limit": "5"})


def test_each_reader_uses_the_declared_default():
    from fedlr.client.checks import NODE_LIMIT_KEYS
    from fedlr.client_apps.secagg_guard import DEFAULT_MAX_SHARES, MAX_SHARES_KEY
    from fedlr.strategies.scaffold_lora import CONTROL_LIMIT, DEFAULT_CONTROL_LIMIT

    defaults = NodeSettings.defaults()
    for key, default in NODE_LIMIT_KEYS.items():
        assert defaults[key] == default, key
    assert defaults[CONTROL_LIMIT] == DEFAULT_CONTROL_LIMIT
    assert defaults[MAX_SHARES_KEY] == DEFAULT_MAX_SHARES


def test_privacy_md_lists_every_privacy_key_with_its_default():
    text = (ROOT / "docs" / "privacy.md").read_text()
    table = text.split("## The node's own limits", 1)[1].split("\n## ", 1)[0]
    for key in NODE_POLICY_KEYS:
        assert f"| `{key}` |" in table, key
    assert "| `dp-max-steps-per-round` | 1000 |" in table
    assert NodePolicy().dp_max_steps_per_round == 1000


def test_an_unknown_key_names_the_closest_and_the_error_says_node_config():
    with pytest.raises(NodeConfigError) as info:
        check_node_config({"dp-max-step-per-round": 10})
    assert str(info.value).startswith("node-config 'dp-max-step-per-round'")
    assert "did you mean 'dp-max-steps-per-round'?" in str(info.value)
    assert isinstance(info.value, ConfigError)  # caught where a ConfigError is
    with pytest.raises(NodeConfigError, match="no key is close"):
        check_node_config({"zzzz": 1})


def test_resuming_with_another_method_names_the_method_first(tmp_path):
    from fedlr.launch.run_config import check_before_start, check_run_config
    from fedlr.runs.checkpoint import check_resumable, save_checkpoint

    saved = check_run_config(ROOT, 'method="fedex-lora"').to_mapping()
    assert "fedex-downlink" in saved  # a key fedavg-lora does not have
    save_checkpoint(
        tmp_path, {"round": 2, "arrays": {}, "strategy": {}, "rng": {}, "config": saved}
    )
    other = check_run_config(ROOT, f'method="fedavg-lora" resume-from="{tmp_path}"')
    with pytest.raises(ConfigError) as caught:
        check_before_start(other, num_supernodes=4)
    assert caught.value.key == "method"
    assert "'fedex-lora'" in str(caught.value) and "'fedavg-lora'" in str(caught.value)
    assert "fedlr version" not in str(caught.value)
    # the server's check is the same function: the same key comes first
    with pytest.raises(ConfigError) as server:
        check_resumable(saved, other.to_mapping(), other.defaults())
    assert server.value.key == "method"
    # same method, a key both have differs: that key, not a missing one
    with pytest.raises(ConfigError, match="'seed'"):
        check_resumable({**saved, "gone-key": 1}, {**saved, "seed": 99})
