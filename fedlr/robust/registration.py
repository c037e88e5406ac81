"""Robust rules as plug-ins: what a rule declares, and the table of rules.

A rule is one module (fedlr's own in :mod:`fedlr.robust.builtin_rules`, a
user's in a module named by the run config's ``extensions``) that calls
:func:`register_rule` once: its name (a value of the ``robust`` key), its
options (an :class:`~fedlr.options.Options` class, declared like a
method's keys), what it does and what it defends against (its row of the
rules table in ``docs/reliability.md``, generated), its start-up line, its
step in the method's update space (``apply``) and how it bounds each extra
record (``records``). Its page is ``docs/robust/<name>.md`` and its row is
in ``tests/unit/test_rule_table.py``; the tests refuse a rule without
either. The run config's ``robust`` values, the refusal of an unknown one,
the start-up lines and the strategy's settings come from this table, so a
new rule edits no other file.

Most rules choose weights from the round's Gram matrix in the method's
update space (:class:`~fedlr.robust.spaces.UpdateSpace`): :func:`gram_rule`
and :func:`gram_records` give such a choice what every one of them needs
(updates whose norm is not finite left out, at least two clients, the Gram
matrix).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from fedlr.errors import ConfigError
from fedlr.options import NoOptions, Options, declaration
from fedlr.robust.spaces import RecordSpace, UpdateSpace

if TYPE_CHECKING:
    from fedlr.wire.updates import ClientUpdate

__all__ = [
    "AUTO_DEFENDS",
    "AUTO_SUMMARY",
    "CLIP_REFERENCES",
    "ROBUST_AUTO",
    "RobustConfig",
    "RobustRule",
    "RuleResult",
    "gram_records",
    "gram_rule",
    "register_rule",
    "registered_rules",
    "rule_keys",
    "rule_named",
]

ROBUST_AUTO = "auto"
"""The ``robust`` run-config key's default besides the rules: the rule the
method's run can take, chosen at configuration
(:func:`fedlr.strategies.registry.resolve`)."""
AUTO_SUMMARY = (
    "where the server can train the method's round, `norm-clip` at the norm "
    "of the server's own update, which joins every round at share 0.5; "
    "elsewhere `none` ([the default](#the-default-robust--auto))"
)
AUTO_DEFENDS = (
    "one client of five that knows the rule, on the default task (measured below)"
)
"""``auto``'s row in ``docs/reliability.md``'s rules table."""
CLIP_REFERENCES = ("median", "server")
"""Values of the ``clip-reference`` run-config key."""


@dataclass
class RuleResult:
    """What a rule's step did to a round's updates.

    Attributes
    ----------
    updates : list of ClientUpdate
        The updates it keeps (moved ones replaced).
    weights : torch.Tensor
        (len(updates),) float64 weights of the kept updates.
    reasons : list of str
        One line per client it moved, left out or down-weighted.
    clipped, trimmed : int
        Clients moved, and clients left out (``robust-clipped``,
        ``robust-trimmed``).
    """

    updates: list[ClientUpdate]
    weights: torch.Tensor
    reasons: list[str] = field(default_factory=list)
    clipped: int = 0
    trimmed: int = 0


Apply = Callable[
    [list["ClientUpdate"], torch.Tensor, UpdateSpace, "RobustConfig"], RuleResult
]
"""A rule's step: (updates, their weights, the method's space, the config)."""
RecordFactors = Callable[
    [list["ClientUpdate"], RecordSpace, "RobustConfig"], tuple[list[float], list[str]]
]
"""A rule on one extra record: the factor ``g_i`` (1: untouched) by which each
update's record is moved towards its reference, and why."""
FollowedRecords = Callable[
    [list["ClientUpdate"], str, "RobustConfig"], tuple[list["ClientUpdate"], list[str]]
]
"""A rule on a record that has followed its arrays: (the kept updates, the
record's name, the config) -> (the updates, a reason per record moved)."""


def _no_settings(config: RobustConfig) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class RobustRule:
    """One registered rule (a value of the ``robust`` run-config key).

    Attributes
    ----------
    name : str
        The ``robust`` value; its page is ``docs/robust/<name>.md``.
    summary, defends : str
        What it does and what it defends against: one line of Markdown each,
        its row in ``docs/reliability.md``'s rules table (generated).
    startup : callable
        ``startup(config) -> str``: the rule as the start-up line says it
        (``robust aggregation: <this>``), with its settings.
    apply : callable, optional
        The rule's step on the round's updates (:data:`Apply`; a choice of
        weights from the Gram matrix is wrapped by :func:`gram_rule`).
        ``None``: the method's plain weighted aggregation.
    records : callable, optional
        How it bounds each extra record in the record's own space
        (:data:`RecordFactors`; :func:`gram_records`). ``None``: untouched.
    followed_records : callable, optional
        How it bounds a record that follows its arrays (a reply step's
        ``clips_record``: SCAFFOLD-LoRA's control delta) once the record has
        followed them (:data:`FollowedRecords`; ``norm-clip`` clips it by its
        own norm). ``None``: such a record is bounded by ``records`` alone.
    options : Options class, optional
        The rule's own run-config keys (:func:`~fedlr.options.option`);
        the rule reads them as ``options.of(config.options)``, and they are
        its entries in the strategy's settings summary. A key two rules
        declare must be declared alike.
    settings : callable, optional
        ``settings(config) -> dict``: its other entries in the settings
        summary (common keys it reads, e.g. ``trim_fraction``).
    clipping : bool
        Whether the rule has a bound that ``clip-reference = "server"`` sets.
    """

    name: str
    summary: str
    defends: str
    startup: Callable[[RobustConfig], str]
    apply: Apply | None = None
    records: RecordFactors | None = None
    followed_records: FollowedRecords | None = None
    options: type[Options] = NoOptions
    settings: Callable[[RobustConfig], dict[str, Any]] = _no_settings
    clipping: bool = False

    @property
    def page(self) -> str:
        """The rule's docs page, relative to the repository."""
        return f"docs/robust/{self.name}.md"

    def describe(self, config: RobustConfig) -> dict[str, Any]:
        """The rule's entries in the strategy's settings summary: its own
        options, then :attr:`settings`."""
        return {**asdict(self.options.of(config.options)), **self.settings(config)}


_RULES: dict[str, RobustRule] = {}


def register_rule(name: str, **declared: Any) -> RobustRule:
    """Register a robust rule: ``name`` and the other fields of
    :class:`RobustRule` (``summary``, ``defends``, ``startup`` required).

    Raises
    ------
    ValueError
        If the name is taken, or a key is declared differently by another rule.
    TypeError
        If a field is not one of :class:`RobustRule`'s.
    """
    rule = RobustRule(name, **declared)
    if name in _RULES or name == ROBUST_AUTO:
        raise ValueError(f"robust rule '{name}' is already registered")
    for other in _RULES.values():
        theirs = other.options.option_fields()
        for key, f in rule.options.option_fields().items():
            if key in theirs and declaration(theirs[key]) != declaration(f):
                raise ValueError(
                    f"rule '{name}' declares '{key}' unlike rule '{other.name}'"
                )
    _RULES[name] = rule
    return rule


def registered_rules() -> list[RobustRule]:
    """Every registered rule, sorted by name (import :mod:`fedlr.robust.rules`
    first: it loads fedlr's own)."""
    return [_RULES[name] for name in sorted(_RULES)]


def rule_named(name: str, also: tuple[str, ...] = ()) -> RobustRule:
    """The rule ``name``; unknown names are refused by the ``robust`` key.

    Raises
    ------
    ConfigError
        ``robust``: naming the value, ``also`` (the key's other values) and
        every registered rule.
    """
    if name not in _RULES:
        names = [*also, *(rule.name for rule in registered_rules())]
        raise ConfigError("robust", f"must be one of {names}, got {name!r}")
    return _RULES[name]


def rule_keys() -> dict[str, Any]:
    """Every registered rule's run-config key (kebab-case) -> its field."""
    return {
        key: f
        for rule in registered_rules()
        for key, f in rule.options.option_fields().items()
    }


@dataclass(frozen=True)
class RobustConfig:
    """The robust-aggregation options of a strategy.

    Parameters
    ----------
    rule : str
        A registered rule (:func:`registered_rules`).
    clip_norm : float, default 0.0
        ``norm-clip``'s bound on a client's update norm (``centred-clip``'s
        on a client's distance to the centre); 0 uses the round's median.
    trim_fraction : float, default 0.2
        ``trimmed-mean``: share of the clients left out, in [0, 0.5).
    max_client_weight : float, default 1.0
        Cap on any client's share of the total weight, in (0, 1]; 1 is no cap.
    clip_ratio : float, default 1.0
        ``norm-clip`` with ``clip_norm`` 0: the bound is this multiple of the
        round's median update norm (``centred-clip``: of the median distance
        to the geometric median), > 0.
    max_weight_ratio : float, default 0.0
        Cap on any client's weight at this multiple of the round's median
        weight (its claimed example count), >= 0; 0 is no cap. Unlike
        ``max_client_weight`` it does not depend on how many clients reply.
    bucket_size : int, default 1
        ``centred-clip``: clients averaged per random bucket before clipping,
        >= 1; 1 is no bucketing.
    clip_reference : {"median", "server"}, default "median"
        What ``clip_ratio`` multiplies when ``clip_norm`` is 0: the round's
        median (norm or distance), or the norm of the server's own update
        (:mod:`fedlr.robust.server_update`; the protection step sets the
        round's ``clip_norm`` from it, the normalisation of FLTrust).
    options : Options, optional
        The rule's own keys (an instance of its registered ``options``);
        ``None``: their defaults.

    Raises
    ------
    ConfigError
        Naming the run-config key of a bad value.
    """

    rule: str = "none"
    clip_norm: float = 0.0
    trim_fraction: float = 0.2
    max_client_weight: float = 1.0
    clip_ratio: float = 1.0
    max_weight_ratio: float = 0.0
    bucket_size: int = 1
    clip_reference: str = "median"
    options: Options | None = None

    def __post_init__(self) -> None:
        rule = rule_named(self.rule)
        if not (math.isfinite(self.clip_norm) and self.clip_norm >= 0):
            raise ConfigError("clip-norm", f"must be >= 0, got {self.clip_norm}")
        if not 0.0 <= self.trim_fraction < 0.5:
            raise ConfigError(
                "trim-fraction", f"must be in [0, 0.5), got {self.trim_fraction}"
            )
        if not (math.isfinite(self.clip_ratio) and self.clip_ratio > 0):
            raise ConfigError("clip-ratio", f"must be > 0, got {self.clip_ratio}")
        if not (math.isfinite(self.max_weight_ratio) and self.max_weight_ratio >= 0):
            raise ConfigError(
                "max-weight-ratio", f"must be >= 0, got {self.max_weight_ratio}"
            )
        if isinstance(self.bucket_size, bool) or not (
            isinstance(self.bucket_size, int) and self.bucket_size >= 1
        ):
            raise ConfigError(
                "bucket-size", f"must be an integer >= 1, got {self.bucket_size!r}"
            )
        if self.clip_reference not in CLIP_REFERENCES:
            raise ConfigError(
                "clip-reference",
                f"must be one of {list(CLIP_REFERENCES)}, got {self.clip_reference!r}",
            )
        if self.clip_reference == "server" and not rule.clipping:
            clipping = ", ".join(r.name for r in registered_rules() if r.clipping)
            raise ConfigError(
                "clip-reference",
                f"'server' sets a clipping rule's bound ({clipping}); "
                f"robust is {self.rule!r}",
            )
        if not 0.0 < self.max_client_weight <= 1.0:
            raise ConfigError(
                "max-client-weight",
                f"must be in (0, 1], got {self.max_client_weight}",
            )
        rule.options.of(self.options)  # another rule's options: TypeError

    @property
    def active(self) -> bool:
        """Whether aggregation differs from the method's plain weighted one."""
        return (
            self.rule != "none"
            or self.max_client_weight < 1.0
            or self.max_weight_ratio > 0
        )


# ------------------------------------------------------------ Gram-based rules
Choose = Callable[
    [list["ClientUpdate"], torch.Tensor, torch.Tensor, RobustConfig], RuleResult
]
"""(finite updates, their weights, their Gram matrix, the config) -> result."""


def gram_rule(choose: Choose) -> Apply:
    """A rule's step that chooses weights from the round's Gram matrix.

    Updates whose norm is not finite are left out first (nothing to rank;
    counted as trimmed); with fewer than two updates left the round is kept
    as it is.
    """

    def apply(
        kept: list[ClientUpdate],
        weights: torch.Tensor,
        space: UpdateSpace,
        config: RobustConfig,
    ) -> RuleResult:
        if len(kept) < 2:
            return RuleResult(kept, weights)
        kept, weights, excluded = _finite_only(kept, weights, space)
        if len(kept) < 2:
            return RuleResult(kept, weights, excluded, trimmed=len(excluded))
        done = choose(kept, weights, space.gram(kept), config)
        done.reasons[:0] = excluded
        done.trimmed += len(excluded)
        return done

    return apply


def gram_records(
    choose: Callable[[torch.Tensor, RobustConfig], tuple[list[float], str]],
) -> RecordFactors:
    """A rule on a record that chooses its factors from the record's Gram
    matrix, and why it moves a record (one reason for all); a round of fewer
    than two records, or whose Gram matrix is not finite (the screen drops
    non-finite records), is left as it is."""

    def factors(
        updates: list[ClientUpdate], record: RecordSpace, config: RobustConfig
    ) -> tuple[list[float], list[str]]:
        k = len(updates)
        if k < 2:
            return [1.0] * k, [""] * k
        gram = record.gram(updates)
        if not bool(torch.isfinite(gram).all()):
            return [1.0] * k, [""] * k
        factors, why = choose(gram, config)
        return factors, [why] * k

    return factors


def selection_rule(
    select: Callable[[torch.Tensor, RobustConfig], list[int]],
    why: Callable[[RobustConfig], str],
) -> Apply:
    """A rule's step that keeps the updates ``select`` picks from the round's
    Gram matrix, at their own weights (:func:`keep_only`, ``why(config)`` the
    reason for each update left out)."""

    def choose(
        kept: list[ClientUpdate],
        weights: torch.Tensor,
        gram: torch.Tensor,
        config: RobustConfig,
    ) -> RuleResult:
        return keep_only(kept, weights, select(gram, config), why(config))

    return gram_rule(choose)


def selected_records(
    select: Callable[[torch.Tensor, RobustConfig], list[int]], why: str
) -> RecordFactors:
    """A selection rule on a record: a record the rule does not select (on
    the record's own Gram matrix) is set to its reference."""

    def choose(gram: torch.Tensor, config: RobustConfig) -> tuple[list[float], str]:
        chosen = set(select(gram, config))
        return [1.0 if i in chosen else 0.0 for i in range(len(gram))], why

    return gram_records(choose)


def _finite_only(
    updates: list[ClientUpdate], weights: torch.Tensor, space: UpdateSpace
) -> tuple[list[ClientUpdate], torch.Tensor, list[str]]:
    """Leave out updates whose norm is not finite in float64 (nothing to rank)."""
    norms = [space.norm(u) for u in updates]
    keep = [i for i, n in enumerate(norms) if math.isfinite(n)]
    reasons = [
        f"node {updates[i].node_id}: left out (update norm {norms[i]} is not finite)"
        for i in range(len(updates))
        if i not in keep
    ]
    if not keep:  # nothing finite to rank: keep all, the round check decides
        return updates, weights, []
    return [updates[i] for i in keep], weights[keep], reasons


def keep_only(
    kept: list[ClientUpdate], weights: torch.Tensor, chosen: list[int], why: str
) -> RuleResult:
    """The result of a selection: the ``chosen`` updates (in their order in
    ``kept``) at their own weights, a reason (``why``) per update left out."""
    keep = sorted(set(chosen))
    reasons = [
        f"node {u.node_id}: left out ({why})"
        for i, u in enumerate(kept)
        if i not in keep
    ]
    return RuleResult(
        [kept[i] for i in keep], weights[keep], reasons, trimmed=len(reasons)
    )
