"""A node's own privacy limits: set by its operator, never by the server.

Three sources of authority, never mixed: the server's instruction (what to
train), the node's own configuration (this module: its privacy limits), and
the node's own durable state (its privacy ledger, :mod:`fedlr.privacy.budget`).
An instruction may tighten a node limit (more noise, a smaller epsilon, a
smaller delta, a smaller clip), never loosen it; a refusal is a
:class:`~fedlr.errors.NodePolicyError` naming the key and the node's limit.

Where the limits come from, later sources winning:

1. the simulation's node config file: the TOML file named by the
   ``FEDLR_NODE_CONFIG`` environment variable of the node's process (Flower's
   simulation engine gives its nodes only ``partition-id`` and
   ``num-partitions``)::

       dp-required = true          # every node
       dp-epsilon-budget = 3.0

       [partition.2]               # node of partition 2 only
       dp-epsilon-budget = 1.0

2. the node's ``context.node_config``: ``flower-supernode --node-config
   'dp-required=true dp-epsilon-budget=3.0 state-dir="/var/lib/fedlr"'`` in a
   deployment; fedlr's in-process grid passes it per node.

Keys (all optional):

=================================  ==========================================
``dp-required``                    refuse any training instruction without
                                   DP-SGD (``dp-max-grad-norm`` > 0)
``dp-epsilon-budget``              the node's lifetime epsilon (at its delta)
                                   over every run its ledger has seen; 0: none
``dp-delta``                       the node's delta; an instruction may ask
                                   for less, never more; 0: ``min(1e-5,
                                   1/(10 n))``; ``>= 1/n`` refused
``dp-max-grad-norm``               the largest per-example clip it accepts;
                                   0: no ceiling
``dp-accountant``                  ``prv`` (default) or ``rdp``: how the node
                                   checks its budget
``dp-allow-reproducible-noise``    honour the simulation option
                                   ``reproducible-noise`` (default false: the
                                   node draws secure noise whatever the server
                                   asks)
``secure-aggregation-required``    refuse a train round outside SecAgg+
``dp-ledger-id``                   name of the node's ledger (default: a
                                   SHA-256 of its training data)
``state-dir``                      the node's state directory (default:
                                   ``FEDLR_NODE_STATE_DIR``, else
                                   ``$XDG_STATE_HOME/fedlr``, else
                                   ``~/.local/state/fedlr``)
=================================  ==========================================
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from fedlr.errors import ConfigError, NodePolicyError
from fedlr.privacy.settings import ACCOUNTANTS, DpSgdSettings, default_delta

__all__ = [
    "NODE_CONFIG_ENV",
    "NODE_POLICY_KEYS",
    "STATE_DIR_ENV",
    "NodePolicy",
    "check_node_config_file",
    "node_policy",
]

NODE_CONFIG_ENV = "FEDLR_NODE_CONFIG"
"""Environment variable naming the simulation's node config file (TOML)."""
STATE_DIR_ENV = "FEDLR_NODE_STATE_DIR"
"""Environment variable naming the nodes' state directory (the ledgers)."""


@dataclass(frozen=True)
class NodePolicy:
    """The privacy limits a node's operator set (see the module docstring)."""

    dp_required: bool = False
    dp_epsilon_budget: float = 0.0
    dp_delta: float = 0.0
    dp_max_grad_norm: float = 0.0
    dp_accountant: str = "prv"
    dp_allow_reproducible_noise: bool = False
    secure_aggregation_required: bool = False
    dp_ledger_id: str = ""
    state_dir: str = ""

    def __post_init__(self) -> None:
        for key in ("dp_epsilon_budget", "dp_max_grad_norm"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(
                    _kebab(key), f"node config must be finite and >= 0, got {value}"
                )
        if not (math.isfinite(self.dp_delta) and 0.0 <= self.dp_delta < 1.0):
            raise ConfigError(
                "dp-delta", f"node config must be in [0, 1), got {self.dp_delta}"
            )
        if self.dp_accountant not in ACCOUNTANTS:
            raise ConfigError(
                "dp-accountant",
                f"node config must be one of {list(ACCOUNTANTS)}, got "
                f"{self.dp_accountant!r}",
            )

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> NodePolicy:
        """The policy of node-config values (other keys are ignored).

        Raises
        ------
        ConfigError
            A policy key of the wrong type or out of range, naming it.
        """
        kwargs: dict[str, Any] = {}
        for field in fields(cls):
            key = _kebab(field.name)
            if key not in values:
                continue
            kwargs[field.name] = _typed(key, values[key], field.type)
        return cls(**kwargs)

    def state_path(self) -> Path:
        """The node's state directory."""
        if self.state_dir:
            return Path(self.state_dir).expanduser()
        if os.environ.get(STATE_DIR_ENV):
            return Path(os.environ[STATE_DIR_ENV]).expanduser()
        base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
        return Path(base) / "fedlr"

    def delta_for(self, requested: float, examples: int) -> float:
        """The delta of a round: the node's, or the instruction's if smaller.

        Raises
        ------
        NodePolicyError
            If the instruction asks for a larger delta than the node's, or the
            delta is not below ``1 / n`` (``epsilon`` would mean nothing).
        """
        own = self.dp_delta or default_delta(examples)
        if requested > own:
            raise NodePolicyError(
                "dp-delta",
                f"{requested:g} is above this node's limit {own:g} (node config "
                "dp-delta, or min(1e-5, 1/(10 n))); an instruction may lower "
                "delta, never raise it",
            )
        delta = requested or own
        if not 0.0 < delta < 1.0 / max(int(examples), 1):
            raise NodePolicyError(
                "dp-delta",
                f"{delta:g} must be in (0, 1/n) = (0, {1.0 / max(examples, 1):.3g}) "
                f"for a node of {examples} examples",
            )
        return delta

    def check_instruction(self, dp: DpSgdSettings | None) -> None:
        """Refuse what the node's limits forbid, before anything trains.

        Raises
        ------
        NodePolicyError
            Naming ``dp-required`` (no DP-SGD), ``dp-max-grad-norm`` (a clip
            above the ceiling) or ``dp-reproducible-noise``.
        """
        if dp is None:
            if self.dp_required:
                raise NodePolicyError(
                    "dp-max-grad-norm",
                    "is 0 or missing, but this node trains only with DP-SGD "
                    "(node config dp-required = true)",
                )
            return
        if self.dp_max_grad_norm > 0 and dp.max_grad_norm > self.dp_max_grad_norm:
            raise NodePolicyError(
                "dp-max-grad-norm",
                f"{dp.max_grad_norm:g} is above this node's ceiling "
                f"{self.dp_max_grad_norm:g} (node config dp-max-grad-norm)",
            )


NODE_POLICY_KEYS = tuple(_f.name.replace("_", "-") for _f in fields(NodePolicy))
"""The node-config keys of :class:`NodePolicy`."""


def node_policy(
    node_config: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> NodePolicy:
    """The node's policy: its config file (simulation) overlaid by its node config.

    Parameters
    ----------
    node_config : mapping
        ``context.node_config`` (``partition-id`` picks the file's
        ``[partition.<id>]`` table).
    environ : mapping, optional
        The environment (default: ``os.environ``) naming the file.

    Raises
    ------
    ConfigError
        If the file named by ``FEDLR_NODE_CONFIG`` is missing or not TOML,
        or a value is out of range.
    """
    env = os.environ if environ is None else environ
    merged: dict[str, Any] = {}
    path = env.get(NODE_CONFIG_ENV, "")
    if path:
        merged.update(_file_values(Path(path), node_config.get("partition-id")))
    merged.update(node_config)
    return NodePolicy.from_mapping(merged)


def check_node_config_file(path: str | Path) -> None:
    """Check every node's policy in a node config file (top level and each
    ``[partition.<id>]`` table).

    Raises
    ------
    ConfigError
        If the file is unreadable or a value is out of range, naming the key.
    """
    environ = {NODE_CONFIG_ENV: str(path)}
    node_policy({}, environ)
    table = tomllib.loads(Path(path).read_text())
    for partition in table.get("partition", {}):
        node_policy({"partition-id": partition}, environ)


def _file_values(path: Path, partition: object) -> dict[str, Any]:
    try:
        table = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(
            NODE_CONFIG_ENV, f"the node config file '{path}' is unreadable: {exc}"
        ) from None
    values = {k: v for k, v in table.items() if not isinstance(v, dict)}
    own = table.get("partition", {}).get(str(partition), {})
    values.update(own)
    return values


def _kebab(name: str) -> str:
    return name.replace("_", "-")


def _typed(key: str, value: Any, kind: Any) -> Any:
    name = kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
    if name == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif name == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif name == "str" and isinstance(value, str):
        return value
    raise ConfigError(key, f"node config must be a {name}, got {value!r}")
