"""A node's own settings: set by its operator, never by the server.

Three sources of authority, never mixed: the server's instruction (what to
train), the node's own configuration (this module: its privacy limits and
its other settings), and the node's own durable state (its privacy ledger,
:mod:`fedlr.privacy.budget`). An instruction may tighten a node limit (more
noise, a smaller epsilon, a smaller delta, a smaller clip, fewer steps),
never loosen it; a refusal is a :class:`~fedlr.errors.NodePolicyError`
naming the key and the node's limit.

Every node-config key is declared here, as a run-config option is
(:func:`fedlr.options.option`: default, help, range or choices): the
privacy limits are the fields of :class:`NodePolicy`, the node's other keys
(Flower's ``partition-id`` and ``num-partitions``, the limits other parts of
fedlr read) the fields of :class:`NodeSettings`. The declarations are the
one list of known keys (:data:`NODE_CONFIG_KEYS`): a key added as a field
is known, typed and bounded. An unknown or misspelt key, a value of another
type (``dp-required = "true"``: Flower parses ``--node-config`` as TOML, so a
boolean arrives as a boolean) or out of range stops the node with a
:class:`~fedlr.errors.NodeConfigError` naming the key (and the closest
declared one), before it answers anything; the launcher refuses it before
anything starts.

Where the limits come from, later sources winning:

1. the simulation's nodes' file: the TOML file named by the
   ``FEDLR_NODE_CONFIG`` environment variable of the node's process (Flower's
   simulation engine gives its nodes only ``partition-id`` and
   ``num-partitions``); it holds :class:`NodePolicy`'s keys::

       dp-required = true          # every node
       dp-epsilon-budget = 3.0

       [partition.2]               # node of partition 2 only
       dp-epsilon-budget = 1.0

2. the node's ``context.node_config``: ``flower-supernode --node-config
   'dp-required=true dp-epsilon-budget=3.0 state-dir="/var/lib/fedlr"'`` in a
   deployment; fedlr's in-process grid passes it per node.

No tool writes these settings: the launcher and ``run_in_process`` pass the
user's own file and values on as they are.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import Field, dataclass
from pathlib import Path
from typing import Any, NoReturn, Self

from fedlr.errors import ConfigError, NodeConfigError, NodePolicyError, did_you_mean
from fedlr.options import Options, coerce, option
from fedlr.privacy.settings import ACCOUNTANTS, DpSgdSettings, default_delta

__all__ = [
    "MIN_DELTA",
    "NODE_CONFIG_ENV",
    "NODE_CONFIG_KEYS",
    "NODE_POLICY_KEYS",
    "STATE_DIR_ENV",
    "NodePolicy",
    "NodeSettings",
    "check_ledger_id",
    "check_node_config",
    "check_node_config_file",
    "node_policy",
]

NODE_CONFIG_ENV = "FEDLR_NODE_CONFIG"
"""Environment variable naming the simulation's node config file (TOML)."""
STATE_DIR_ENV = "FEDLR_NODE_STATE_DIR"
"""Environment variable naming the nodes' state directory (the ledgers)."""

MIN_DELTA = 1e-20
"""The smallest delta a node accounts at (its own ``dp-delta`` or an
instruction's): below it the accountants' arithmetic fails (PRV's already
below about 1e-13, where fedlr falls back to RDP), and no data set needs it
(the default is ``min(1e-5, 1/(10 n))``)."""

_LEDGER_ID = re.compile(r"[A-Za-z0-9._-]+")


def check_ledger_id(ledger_id: str) -> None:
    """Refuse a ledger id that is not a plain file name.

    Raises
    ------
    NodeConfigError
        Naming ``dp-ledger-id``, unless it is letters, digits, ``-``, ``_``
        and ``.`` (and not ``.`` or ``..``).
    """
    if not _LEDGER_ID.fullmatch(ledger_id) or ledger_id in (".", ".."):
        raise NodeConfigError(
            "dp-ledger-id",
            f"must be letters, digits, '-', '_' or '.', got {ledger_id!r}",
        )


class _NodeOptions(Options):
    """Declared node-config keys: refusals are :class:`NodeConfigError`."""

    def __post_init__(self) -> None:
        try:
            super().__post_init__()
        except NodeConfigError:
            raise
        except ConfigError as exc:
            raise NodeConfigError(exc.key, exc.reason) from None

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> Self:
        """This group's values of a node config (other keys are ignored here;
        :func:`check_node_config` refuses an unknown one).

        Raises
        ------
        NodeConfigError
            A key of this group of the wrong type or out of range, naming it.
        """
        kwargs = {
            f.name: _typed(key, values[key], f)
            for key, f in cls.option_fields().items()
            if key in values
        }
        return cls(**kwargs)


@dataclass(frozen=True)
class NodePolicy(_NodeOptions):
    """The privacy limits a node's operator set (see the module docstring).

    Each field is one node-config key (kebab-case there); its help text is
    its row in docs/privacy.md's table.
    """

    dp_required: bool = option(
        False,
        "refuses any train instruction without DP-SGD (`dp-max-grad-norm` > 0), "
        "whatever the method",
    )
    dp_epsilon_budget: float = option(
        0.0,
        "refuses a release that would take its ledger past this ε (at its δ, by "
        "its accountant), over every run; 0: none",
        range=">= 0",
    )
    dp_delta: float = option(
        0.0,
        "its δ: refuses an instruction asking for a larger one, and a δ ≥ `1/n`; "
        "0: `min(1e-5, 1/(10 n))`; else at least `1e-20`",
        range="[0, 1)",
    )
    dp_max_grad_norm: float = option(
        0.0, "refuses a per-example clip above this; 0: no ceiling", range=">= 0"
    )
    dp_max_steps_per_round: int = option(
        1000,
        "refuses a train instruction asking for more DP-SGD steps than this in "
        "one round (before anything is charged to its ledger)",
        range=">= 1",
    )
    dp_accountant: str = option(
        "prv", "accountant of its budget check", choices=ACCOUNTANTS
    )
    dp_allow_reproducible_noise: bool = option(
        False,
        "honours the server's `reproducible-noise` (a simulation option: ε is "
        "then no guarantee); otherwise draws secure noise, and the launcher "
        "refuses such a run before it starts",
    )
    dp_evaluation_noise_multiplier: float = option(
        0.0,
        "> 0: answers an evaluate instruction with noised sums charged to its "
        "ledger; 0: under `dp-required` an evaluate instruction is refused",
        range=">= 0",
    )
    secure_aggregation_required: bool = option(
        False, "refuses a train round outside SecAgg+"
    )
    dp_ledger_id: str = option(
        "",
        "names its ledger; empty: a SHA-256 of the raw data it holds "
        "(order-independent; not of its tokenisation or split)",
    )
    state_dir: str = option(
        "",
        "where its ledger lives; empty: `$FEDLR_NODE_STATE_DIR`, else "
        "`$XDG_STATE_HOME/fedlr`, else `~/.local/state/fedlr`",
    )

    def check(self) -> None:
        """What the declarations cannot say: δ's floor, the ledger id's form."""
        if 0.0 < self.dp_delta < MIN_DELTA:
            raise NodeConfigError(
                "dp-delta",
                f"must be 0 (min(1e-5, 1/(10 n))) or at least {MIN_DELTA:g}, got "
                f"{self.dp_delta:g}: the accountants cannot account a smaller delta",
            )
        if self.dp_ledger_id:
            check_ledger_id(self.dp_ledger_id)

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
            If the instruction asks for a larger delta than the node's, or one
            below :data:`MIN_DELTA`, or the delta is not below ``1 / n``
            (``epsilon`` would mean nothing).
        """
        own = self.dp_delta or default_delta(examples)
        if requested > own:
            raise NodePolicyError(
                "dp-delta",
                f"{requested:g} is above this node's limit {own:g} (node config "
                "dp-delta, or min(1e-5, 1/(10 n))); an instruction may lower "
                "delta, never raise it",
            )
        if 0.0 < requested < MIN_DELTA:
            raise NodePolicyError(
                "dp-delta",
                f"{requested:g} is below {MIN_DELTA:g}, the smallest delta this "
                "node's accountants account at",
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
            Naming ``dp-required`` (no DP-SGD) or ``dp-max-grad-norm`` (a clip
            above the ceiling).
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

    def check_steps(self, steps: int) -> None:
        """Refuse a DP-SGD round of more steps than ``dp-max-steps-per-round``.

        Raises
        ------
        NodePolicyError
            Naming ``local-steps`` and the node's limit.
        """
        if steps > self.dp_max_steps_per_round:
            raise NodePolicyError(
                "local-steps",
                f"{steps} DP-SGD steps in one round are above this node's limit "
                f"{self.dp_max_steps_per_round} (node config dp-max-steps-per-round)",
            )


@dataclass(frozen=True)
class NodeSettings(_NodeOptions):
    """The node-config keys that are not privacy limits.

    Flower's own, and the limits other parts of fedlr read from
    ``context.node_config`` (declared here, on the floor every node reads, so
    that one list knows every key; ``tests/unit/test_node_config.py`` checks
    that each reader's default is this one). They are not read from the
    simulation's nodes' file.
    """

    partition_id: int = option(
        0, "the node's partition (Flower's simulation sets it)", range=">= 0"
    )
    num_partitions: int = option(
        1, "the number of partitions (Flower's simulation sets it)", range=">= 1"
    )
    max_local_steps: int = option(
        10_000, "refuses a round asking for more local steps", range=">= 1"
    )
    max_batch_size: int = option(
        4_096, "refuses a round asking for a larger batch", range=">= 1"
    )
    scaffold_control_limit: float = option(
        1.0,
        "SCAFFOLD-LoRA: refuses a control variate longer than this times `max(‖x‖, 1)`",
        range="> 0",
    )
    secagg_max_shares: int = option(
        100, "refuses a SecAgg+ round asking for more shares", range=">= 2"
    )


NODE_POLICY_KEYS = tuple(NodePolicy.option_fields())
"""The node-config keys of :class:`NodePolicy` (the nodes' file's keys)."""

NODE_CONFIG_KEYS: dict[str, Field[Any]] = {
    **NodeSettings.option_fields(),
    **NodePolicy.option_fields(),
}
"""Every node-config key a node knows, with its declaration."""


def check_node_config(values: Mapping[str, Any], where: str = "node config") -> None:
    """Refuse an unknown key, a value of the wrong type or out of range.

    Parameters
    ----------
    values : mapping
        A node config (``context.node_config``).
    where : str
        Where the values come from, for the message.

    Raises
    ------
    NodeConfigError
        Naming the first unknown key (with the closest declared key), or the
        key whose value is refused.
    """
    for key in sorted(values):
        if key not in NODE_CONFIG_KEYS:
            _refuse_unknown(key, NODE_CONFIG_KEYS, where)
    NodeSettings.from_mapping(values)
    NodePolicy.from_mapping(values)


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
    NodeConfigError
        If the node config or the file named by ``FEDLR_NODE_CONFIG`` has an
        unknown key or a value of the wrong type or out of range, or the file
        is missing or not TOML.
    """
    check_node_config(node_config)
    env = os.environ if environ is None else environ
    merged: dict[str, Any] = {}
    path = env.get(NODE_CONFIG_ENV, "")
    if path:
        merged.update(_file_values(Path(path), node_config.get("partition-id")))
    merged.update(node_config)
    return NodePolicy.from_mapping(merged)


def check_node_config_file(path: str | Path) -> None:
    """Check a nodes' file: its keys, its tables and every value.

    Raises
    ------
    NodeConfigError
        If the file is unreadable, has an unknown key or table (with the
        closest declared key), a key that is not read from it, or a value of
        the wrong type or out of range, naming the key and the table.
    """
    _file_tables(Path(path))


def _file_values(path: Path, partition: object) -> dict[str, Any]:
    """A node's values of the file: the top level, overlaid by its table."""
    top, tables = _file_tables(path)
    return {**top, **tables.get(str(partition), {})}


def _file_tables(path: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """``(top-level values, {partition id: its table})`` of a checked file."""
    try:
        table = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise NodeConfigError(
            NODE_CONFIG_ENV, f"the nodes' file '{path}' is unreadable: {exc}"
        ) from None
    top = {k: v for k, v in table.items() if not isinstance(v, dict)}
    _check_file_keys(top, f"nodes' file {path}")
    tables: dict[str, dict[str, Any]] = {}
    for name, value in table.items():
        if not isinstance(value, dict):
            continue
        if name != "partition":
            hint = did_you_mean(name, ["partition", *NODE_POLICY_KEYS])
            raise NodeConfigError(
                name,
                f"unknown table [{name}] in the nodes' file {path}; "
                f"{hint or ''}a node's own table is [partition.<id>]",
            )
        for pid, own in value.items():
            where = f"nodes' file {path} [partition.{pid}]"
            if not (str(pid).isdigit() and isinstance(own, dict)):
                raise NodeConfigError(
                    f"partition.{pid}",
                    f"in the nodes' file {path}: a node's table is "
                    "[partition.<id>], <id> its partition-id (an integer >= 0)",
                )
            _check_file_keys(own, where)
            tables[str(int(pid))] = own
    return top, tables


def _check_file_keys(values: Mapping[str, Any], where: str) -> None:
    """The file's keys are :class:`NodePolicy`'s, each of its type and range."""
    for key in sorted(values):
        if key in NodeSettings.option_fields():
            raise NodeConfigError(
                key,
                f"in the {where}: is not read from the nodes' file (it holds the "
                "privacy keys); a node reads it from its own node config "
                "(flower-supernode --node-config, run_in_process's node_config)",
            )
        if key not in NODE_POLICY_KEYS:
            _refuse_unknown(key, NODE_POLICY_KEYS, where)
    try:
        NodePolicy.from_mapping(values)
    except NodeConfigError as exc:
        raise NodeConfigError(exc.key, f"{exc.reason} (in the {where})") from None


def _refuse_unknown(key: str, known: Iterable[str], where: str) -> NoReturn:
    """Refuse ``key``, naming the closest of the ``known`` keys."""
    hint = did_you_mean(key, known)
    raise NodeConfigError(
        key,
        f"unknown key in the {where}; {hint or 'no key is close; '}the "
        "node-config keys are listed in docs/privacy.md",
    )


def _typed(key: str, value: Any, f: Field[Any]) -> Any:
    """A node-config value of its declared type (as Flower's TOML parsing
    yields it: a boolean is a boolean, an integer is accepted for a float)."""
    try:
        return coerce(key, value, f.type)
    except ConfigError as exc:
        raise NodeConfigError(key, exc.reason) from None
