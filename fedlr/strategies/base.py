"""Base of every fedlr strategy: the round driver, weighting, metrics.

A subclass declares which arrays a valid reply carries (:meth:`reply_shapes`)
and implements :meth:`aggregate_updates`, a pure function of the validated
updates and the current global state. Everything Flower-specific (the
round's messages, robust weighting, rejecting a round, byte counts, the
``MetricRecord``) lives here once; the one validation path for replies is
:class:`~fedlr.strategies.replies.ReplyChecks`, mixed in (``ClientUpdate``,
defined in :mod:`fedlr.updates`, is re-exported from here).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from abc import abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any, ClassVar, cast

import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MetricRecord,
    MetricRecordValues,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.supercore import log

from fedlr.adapters.plugin import warn_unsaved_heads
from fedlr.adapters.roles import AdaptedModel, Role, RoleLayout
from fedlr.config import RunConfig
from fedlr.errors import (
    InitialArraysError,
    NoValidRepliesError,
    ReplyValidationError,
)
from fedlr.fingerprint import (
    BaseFingerprint,
    check_model,
    fingerprint_roles,
    model_fingerprint,
)
from fedlr.flower.records import record_nbytes, record_to_state, state_to_record
from fedlr.linalg import weighted_mean
from fedlr.options import NoOptions, Options, coerce, kebab
from fedlr.privacy.client_dp import ClientDpLedger, check_robust, keep_ledger, protect
from fedlr.privacy.settings import PrivacyConfig
from fedlr.protocol import (
    LR,
    NUM_EXAMPLES,
    TRAIN_LOSS,
    TRAIN_LOSS_ALIASES,
    TRAIN_ROLES,
    encode_roles,
    train_loss_of,
)
from fedlr.robust import (
    DEFAULT_SCREEN_RATIO,
    ParameterSpace,
    RobustConfig,
    ScreenOutcome,
    UpdateSpace,
    robust_aggregate,
)
from fedlr.strategies.replies import ReplyChecks, short, without_helper_metrics
from fedlr.updates import ClientUpdate

NO_EVALUATE_HANDLER = "No evaluate function registered"
"""Flower's error reason when a ClientApp has no ``@app.evaluate()``."""

__all__ = ["ClientUpdate", "Exchange", "FedLRStrategy", "RoundReport"]

Exchange = Callable[[Grid, Iterable[Message], float | None], Iterable[Message]]
"""Sends a round's train instructions and returns the replies (``run_round``)."""

NUMERIC_FAULTS: tuple[type[BaseException], ...] = (
    torch.linalg.LinAlgError,  # type: ignore[attr-defined]
    ArithmeticError,
)
"""Errors of an aggregation kernel that reject the round, not the run (a
failed SVD, an overflow)."""


@dataclass
class RoundReport:
    """What a round's aggregation produced besides the arrays.

    Attributes
    ----------
    metrics : dict of str to float
        Scalar metrics (``frobenius-gap``, ``relative-gap``, ``rank`` ...).
    layers : dict of str to (float, float)
        Per-layer (gap, relative gap), when the method measures them.
    """

    metrics: dict[str, float] = field(default_factory=dict)
    layers: dict[str, tuple[float, float]] = field(default_factory=dict)

    @classmethod
    def from_layers(
        cls, layers: Mapping[str, tuple[float, float]], **metrics: float
    ) -> RoundReport:
        """Totals from per-layer ``(gap, reference norm)`` pairs.

        ``frobenius-gap = sqrt(sum gap^2)`` and ``relative-gap =
        frobenius-gap / sqrt(sum norm^2)`` (0 when every norm is 0); each
        layer's relative gap is ``gap / norm`` (0 when ``norm`` is 0).

        Parameters
        ----------
        layers : mapping of str to (float, float)
            Layer name to ``(||Delta_agg - Delta_ref||_F, ||Delta_ref||_F)``.
        **metrics : float
            Further metrics (``rank`` ...), after the two gaps.

        Returns
        -------
        RoundReport

        Raises
        ------
        ValueError
            If ``metrics`` names one of the two computed gaps.
        """
        clash = sorted({"frobenius-gap", "relative-gap"} & metrics.keys())
        if clash:
            raise ValueError(f"from_layers computes {clash}; do not pass them")
        gap_sq = sum(gap * gap for gap, _ in layers.values())
        norm_sq = sum(norm * norm for _, norm in layers.values())
        total = math.sqrt(gap_sq)
        return cls(
            metrics={
                "frobenius-gap": total,
                "relative-gap": total / math.sqrt(norm_sq) if norm_sq > 0 else 0.0,
                **metrics,
            },
            layers={
                name: (gap, gap / norm if norm > 0 else 0.0)
                for name, (gap, norm) in layers.items()
            },
        )


class FedLRStrategy(ReplyChecks, FedAvg):
    """Message-API strategy with validated replies and a pure aggregation hook.

    Used as a plug-in in a user's own ServerApp (Flower's ``strategy.start()``)
    it keeps Flower's conventions: ``FedAvg``'s defaults (``fraction_evaluate``
    1.0, ``min_*_nodes`` 2), the clients' own metrics aggregated by
    ``train_metrics_aggr_fn`` / ``evaluate_metrics_aggr_fn`` (by default a
    weighted average by ``num-examples``) beside fedlr's, and lost replies
    counted. fedlr's own ServerApp passes its choices explicitly
    (:meth:`base_options`) and drives rounds with :meth:`run_round`, which runs
    the same hooks as ``start()``.

    Class attributes: ``send_roles`` and ``train_roles`` are the roles of the
    global arrays sent to clients and of the arrays a client sends back
    (empty: the strategy declares its arrays by key, see
    :meth:`expected_arrays` and :meth:`reply_shapes`); ``federated_evaluation``
    says whether fedlr's own app runs federated evaluation for the method
    (personalised methods evaluate each client's own model).

    Parameters
    ----------
    min_replies : int, default 1
        Valid replies needed to aggregate a round; fewer raise
        :class:`~fedlr.errors.NoValidRepliesError`.
    lr_decay : float, default 1.0
        If the train config carries ``lr``, round ``t`` sends
        ``lr * lr_decay ** (t - 1)`` (a server-side step-size schedule).
    robust : RobustConfig, optional
        Robust aggregation (:mod:`fedlr.robust`): norm clipping, geometric
        median, client trimming, a cap on a client's weight share. Default:
        none (the method's plain weighted aggregation).
    max_num_examples : int, optional
        A reply claiming more ``num-examples`` is dropped. Default: no cap.
    max_update_ratio : float, default 0.0
        A round whose new global arrays differ from the current ones by more
        than this times the current arrays' norm is rejected (the previous
        global state is kept); 0: only non-finite results are rejected.
    evaluate : bool, optional
        Whether the ClientApp answers federated evaluation (has an
        ``@app.evaluate()`` function). ``False`` sets ``fraction_evaluate`` to
        0 (nothing is sent to evaluate); ``True`` keeps ``fraction_evaluate``
        (Flower's default 1.0). Not given: Flower's ``fraction_evaluate``
        holds, :meth:`summary` says at start-up that federated evaluation is
        on and how to turn it off, and if every evaluate reply of a round is
        Flower's ``No evaluate function registered`` error the strategy logs
        that once and stops sending evaluate instructions.
    screen_ratio : float, default 20.0
        A reply whose update norm (in :meth:`robust_space`) exceeds this times
        the round's median update norm, and the current state's norm, is
        dropped before aggregation (:func:`fedlr.robust.screen_sizes`); 0
        turns the screen off.
    privacy : PrivacyConfig, optional
        Differential privacy (:mod:`fedlr.privacy`): DP-SGD settings sent to
        the clients, client-level DP applied here after validation. Default:
        none.
    options : Options, optional
        The method's options, an instance of :attr:`options_type` (default:
        its defaults); kept as :attr:`method_options`.
    **kwargs
        Any field of :attr:`options_type` by name (snake_case, e.g.
        ``proximal_mu=0.5``): replaces that option, checked as the run-config
        key is. Other parameters: see ``flwr.serverapp.strategy.FedAvg`` (its
        defaults hold).
    """

    send_roles: ClassVar[tuple[Role, ...]] = ()
    train_roles: ClassVar[tuple[Role, ...]] = ()
    federated_evaluation: ClassVar[bool] = False
    folds_base: ClassVar[bool] = False
    personalised: ClassVar[bool] = False
    heterogeneous_ranks: ClassVar[bool] = False
    hetero_variant: ClassVar[type[FedLRStrategy] | None] = None
    """The class a run with ``client-ranks`` builds instead of this one (set by
    FedEx-LoRA and FedSpec, whose heterogeneous-rank rounds are another
    class); read by :meth:`fedlr.strategies.registry.MethodSpec.strategy_for`."""
    extra_columns: tuple[str, ...] = ()
    options_type: ClassVar[type[Options]] = NoOptions
    """The method's options class: the ``options`` it is registered with
    (:func:`~fedlr.strategies.registry.register_method` sets it), or declared
    by a family base whose ``__init__`` reads them."""

    def __init__(
        self,
        *,
        min_replies: int = 1,
        lr_decay: float = 1.0,
        robust: RobustConfig | None = None,
        max_num_examples: int | None = None,
        max_update_ratio: float = 0.0,
        screen_ratio: float = DEFAULT_SCREEN_RATIO,
        privacy: PrivacyConfig | None = None,
        options: Options | None = None,
        evaluate: bool | None = None,
        **kwargs: Any,
    ) -> None:
        self.method_options: Options = self.own_options(options, kwargs)
        if evaluate is False:
            kwargs["fraction_evaluate"] = 0.0
        elif evaluate and kwargs.get("fraction_evaluate", 1.0) == 0.0:
            raise ValueError(
                "evaluate=True asks for federated evaluation, but fraction_evaluate "
                "is 0.0: nothing would be sent to evaluate"
            )
        self.client_evaluates = evaluate
        """Whether the ClientApp evaluates (``None``: not said, see the class)."""
        if min_replies < 1:
            raise ValueError(f"min_replies must be >= 1, got {min_replies}")
        if not 0.0 < lr_decay <= 1.0:
            raise ValueError(f"lr_decay must be in (0, 1], got {lr_decay}")
        if max_num_examples is not None and max_num_examples < 1:
            raise ValueError(f"max_num_examples must be >= 1, got {max_num_examples}")
        if not (math.isfinite(max_update_ratio) and max_update_ratio >= 0):
            raise ValueError(f"max_update_ratio must be >= 0, got {max_update_ratio}")
        if not (math.isfinite(screen_ratio) and screen_ratio >= 0):
            raise ValueError(f"screen_ratio must be >= 0, got {screen_ratio}")
        super().__init__(**kwargs)
        self.lr_decay = lr_decay
        self.min_replies = min_replies
        self.robust = robust if robust is not None else RobustConfig()
        self.max_num_examples = max_num_examples
        self.max_update_ratio = max_update_ratio
        self.privacy = privacy if privacy is not None else PrivacyConfig()
        check_robust(self.privacy, self.robust)
        self.screen_ratio = screen_ratio
        self.last_screen: ScreenOutcome | None = None
        self.rejected_rounds = 0
        self.last_rejection: str | None = None
        self.last_robust: list[str] = []
        self.last_timing: dict[str, float] = {}
        self._current: ArrayRecord | None = None
        self._bytes_down = 0
        self._sent: list[int] | None = None
        self.instructed: int | None = None  # nodes sent an instruction this round
        self.client_dp_ledger = ClientDpLedger.of(self.privacy)
        self._warned_clashes: set[str] = set()
        self.last_report: RoundReport = RoundReport()
        self.nodes_sampled_from = 0
        self.last_dropped: list[str] = []
        self.base_fingerprint: BaseFingerprint | None = None
        """Plug-in use: the server's model's frozen weights (:meth:`bind_model`),
        sent with every instruction; ``None``: not sent, not checked."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        keep_ledger(cls)  # its state_dict carries client-level DP's releases

    @classmethod
    def own_options(cls, options: Options | None, kwargs: dict[str, Any]) -> Options:
        """``options`` (default: :attr:`options_type`'s defaults) with the
        option fields named in ``kwargs`` replaced; those are popped.

        Raises
        ------
        TypeError
            If ``options`` is not an instance of :attr:`options_type`.
        ConfigError
            If a replaced value has the wrong type or is out of range.
        """
        kind = cls.options_type
        base = kind.of(options)
        names = {f.name: f for f in dataclasses.fields(kind)}
        changes = {
            name: coerce(kebab(name), kwargs.pop(name), names[name].type)
            for name in list(kwargs)
            if name in names
        }
        return base.replace(**changes) if changes else base

    # ------------------------------------------------------------ subclass API
    @abstractmethod
    def reply_shapes(self) -> dict[str, tuple[int, ...]]:
        """Keys and shapes every valid reply's ArrayRecord carries."""

    @abstractmethod
    def aggregate_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], RoundReport]:
        """Combine validated updates into the next global state.

        Parameters
        ----------
        server_round : int
        updates : list of ClientUpdate
            Validated, sorted by partition id then node id.
        current : dict of str to torch.Tensor
            The global state sent this round.

        Returns
        -------
        state : dict of str to torch.Tensor
            The next global state (every key to send next round).
        report : RoundReport
        """

    def round_config(self, server_round: int) -> dict[str, Any]:
        """Extra per-round values for the clients' ConfigRecord."""
        return {}

    def instruction_config(self, server_round: int) -> dict[str, Any]:
        """:meth:`round_config` plus the base fingerprint (when bound): the
        values every train and evaluate instruction of the round carries."""
        config = self.round_config(server_round)
        if self.base_fingerprint is not None:
            config = {**config, **self.base_fingerprint.config()}
        return config

    def bind_model(self, view: AdaptedModel) -> None:
        """Plug-in use (``for_model``): fingerprint the server's model.

        Remembers :attr:`base_fingerprint`, the frozen base weights of every
        adapted layer and the adapter factors that never travel, as built
        (:mod:`fedlr.fingerprint`), and warns about a task head fedlr would
        never send (:func:`~fedlr.adapters.plugin.warn_unsaved_heads`).
        """
        roles = fingerprint_roles(
            view.layout,
            self.send_roles,
            self.train_roles,
            getattr(self, "keep_roles", ()),
        )
        self.base_fingerprint = model_fingerprint(view, roles)
        warn_unsaved_heads(view)

    def check_model(self, view: AdaptedModel, *, what: str) -> None:
        """Plug-in use (``initial_arrays``, ``load_into``): ``view`` was built
        like the model the strategy was made for.

        Raises
        ------
        BaseMismatchError
            If its frozen weights differ from :attr:`base_fingerprint`.
        """
        check_model(self.base_fingerprint, view, what=what)
        warn_unsaved_heads(view)

    def options(self) -> dict[str, Any]:
        """The strategy's fedlr settings, for :meth:`summary`: the common
        ones by constructor name, then every :attr:`method_options` key.

        A subclass adds settings that are not options (``client_ranks``).
        """
        options: dict[str, Any] = {
            "min_replies": self.min_replies,
            "lr_decay": self.lr_decay,
            "robust": self.robust.rule,
        }
        if self.robust.rule == "norm-clip":
            options["clip_norm"] = self.robust.clip_norm or "median"
        if self.robust.rule == "trimmed-mean":
            options["trim_fraction"] = self.robust.trim_fraction
        if self.robust.max_client_weight < 1.0:
            options["max_client_weight"] = self.robust.max_client_weight
        if self.max_num_examples is not None:
            options["max_num_examples"] = self.max_num_examples
        if self.max_update_ratio > 0:
            options["max_update_ratio"] = self.max_update_ratio
        options["screen_ratio"] = self.screen_ratio or "off"
        return {**options, **self.method_options.to_mapping()}

    def robust_space(self, current: Mapping[str, torch.Tensor]) -> UpdateSpace:
        """The space in which robust options measure and move client updates.

        The default is the change of the reply's arrays against the round's
        global state (:class:`~fedlr.robust.ParameterSpace`); the LoRA family
        measures products, FOT projected updates, QR-Mix the head's change.
        """
        return ParameterSpace(current)

    def expected_arrays(self) -> dict[str, tuple[int, ...]] | None:
        """Keys and shapes of the global arrays the strategy sends, if fixed.

        The default: a strategy with a ``layout``
        (:class:`~fedlr.adapters.roles.RoleLayout`) and ``send_roles`` sends
        exactly ``layout.shapes(*send_roles)``; others (vision FedAvg, FOT,
        QR-Mix: whatever model the user gives) return ``None`` and are not
        checked.
        """
        layout = getattr(self, "layout", None)
        if isinstance(layout, RoleLayout) and self.send_roles:
            return layout.shapes(*self.send_roles)
        return None

    def initial_arrays_hint(self) -> str:
        """What to pass as ``initial_arrays``, for :class:`InitialArraysError`."""
        roles = encode_roles(self.send_roles)
        ways = ["ArrayRecord(adapter_state(model, layout, strategy.send_roles))"]
        if callable(getattr(self, "initial_arrays", None)):
            ways.insert(0, "strategy.initial_arrays(model)")
        return (
            f"pass exactly the global arrays of send roles {roles}, e.g. "
            f"{' or '.join(ways)}, not ArrayRecord(model.state_dict())"
        )

    def reply_hint(self) -> str:
        """What a client must send back, appended to a wrong-keys drop reason."""
        if self.train_roles:
            roles = encode_roles(self.train_roles)
            return f"the client must send exactly the arrays of {TRAIN_ROLES}={roles}"
        keys = sorted(self.reply_shapes())
        return (
            f"the client must send exactly the {len(keys)} arrays it was sent "
            f"({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})"
        )

    @classmethod
    def base_options(cls, config: RunConfig) -> dict[str, Any]:
        """Constructor arguments of fedlr's own ServerApp, from the run config.

        Besides the run config's keys, the app's choices that differ from
        Flower's defaults: the server evaluates the global model itself, so
        federated evaluation is off unless the method needs it
        (``federated_evaluation``), and one node is enough.
        """
        return {
            "min_replies": config.min_replies,
            "fraction_train": config.fraction_train,
            "lr_decay": config.lr_decay,
            "robust": config.robust_config,
            "max_num_examples": config.max_num_examples or None,
            "max_update_ratio": config.max_update_ratio,
            "privacy": config.privacy,
            "screen_ratio": config.screen_ratio,
            "fraction_evaluate": 1.0 if cls.federated_evaluation else 0.0,
            "evaluate": cls.federated_evaluation,
            "min_train_nodes": 1,
            "min_evaluate_nodes": 1,
            "min_available_nodes": 1,
        }

    @staticmethod
    def weighted_means(
        updates: list[ClientUpdate],
        keys: Iterable[str],
        like: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Per-key weighted mean of the updates, weights = num-examples.

        With ``like``, each mean is cast to ``like[key]``'s dtype.
        """
        weights = [u.weight for u in updates]
        means = {
            key: weighted_mean([u.arrays[key] for u in updates], weights)
            for key in keys
        }
        if like is not None:
            means = {k: v.to(like[k].dtype) for k, v in means.items()}
        return means

    def state_dict(self) -> dict[str, Any]:
        """Strategy state a resumed run needs besides the global arrays.

        Tensors and JSON-like values (saved with ``torch.save``). Stateless
        strategies return ``{}``; stateful ones (FedSpec's rank, FOT's bases...)
        override this and :meth:`load_state_dict`.
        """
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises
        ------
        ValueError
            If ``state`` has keys this strategy does not know.
        """
        if state:
            raise ValueError(
                f"{type(self).__name__} keeps no state, got keys {sorted(state)}"
            )

    def summary(self) -> None:
        """Log the fedlr options (:meth:`options`), then FedAvg's settings."""
        items = list(self.options().items())
        log(INFO, "\t├──> fedlr options (%s):", type(self).__name__)
        for i, (name, value) in enumerate(items):
            branch = "└" if i == len(items) - 1 else "├"
            log(INFO, "\t│\t%s── %s: %s", branch, name, value)
        if self.base_fingerprint is not None:
            log(
                INFO,
                "\t├──> nodes' models checked against a fingerprint of %d frozen "
                "weights of the server's model",
                len(self.base_fingerprint.keys),
            )
        if self.client_evaluates is None and self.fraction_evaluate > 0.0:
            log(
                INFO,
                "\t├──> federated evaluation is on (fraction_evaluate=%s): every "
                "round's global arrays go to the ClientApps' @app.evaluate(); for "
                "a ClientApp without one, build the strategy with evaluate=False",
                self.fraction_evaluate,
            )
        super().summary()

    # ---------------------------------------------------------- round driver
    def run_round(
        self,
        grid: Grid,
        server_round: int,
        arrays: ArrayRecord,
        train_config: ConfigRecord,
        evaluate_config: ConfigRecord | None = None,
        timeout: float | None = 3600.0,
        exchange: Exchange | None = None,
    ) -> ArrayRecord:
        """One round as ``Strategy.start`` runs it: train, then federated eval.

        The ServerApp drives rounds itself with this (so a run can start at
        any round when it resumes from a checkpoint); it calls the same hooks
        in the same order as Flower's ``start``, so nodes that were sent an
        instruction but did not reply within ``timeout`` are reported as
        dropped (``no reply``) by :meth:`aggregate_train` either way.

        ``last_timing`` holds the round's wall-clock seconds: ``train-seconds``
        (instructions out, replies in), ``aggregate-seconds`` (validation and
        the kernel) and ``federated-eval-seconds``.

        ``exchange(grid, instructions, timeout)``, when given, sends the train
        instructions and returns the replies in place of
        ``grid.send_and_receive`` (secure aggregation:
        :class:`fedlr.server_apps.secagg.SecAggPlusExchange`).

        Returns
        -------
        ArrayRecord
            The next global arrays.
        """
        start = time.perf_counter()
        sent = self.configure_train(server_round, arrays, train_config, grid)
        if exchange is None:
            replies = grid.send_and_receive(messages=sent, timeout=timeout)
        else:
            replies = exchange(grid, sent, timeout)
        trained = time.perf_counter()
        new_arrays, _ = self.aggregate_train(server_round, replies)
        if new_arrays is not None:
            arrays = new_arrays
        aggregated = time.perf_counter()
        messages = list(
            self.configure_evaluate(
                server_round, arrays, evaluate_config or ConfigRecord(), grid
            )
        )
        if messages:
            evaluations = grid.send_and_receive(messages=messages, timeout=timeout)
            self.aggregate_evaluate(server_round, evaluations)
        self.last_timing = {
            "train-seconds": trained - start,
            "aggregate-seconds": aggregated - trained,
            "federated-eval-seconds": time.perf_counter() - aggregated,
        }
        return arrays

    # ------------------------------------------------------------ Flower hooks
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Check and remember the global arrays, add per-round values, sample nodes.

        The sampled node ids are remembered: :meth:`aggregate_train` reports
        the ones that do not reply as dropped.

        Raises
        ------
        InitialArraysError
            If ``arrays`` are not the ones the strategy sends
            (:meth:`check_arrays`), before any instruction goes out.
        """
        self.check_arrays(arrays)
        round_config = self.prepare_round(server_round, arrays, config)
        self.nodes_sampled_from = len(list(grid.get_node_ids()))
        messages = list(
            super().configure_train(server_round, arrays, round_config, grid)
        )
        self.note_sent(arrays, len(messages))
        extra = self.instruction_records(server_round)
        if extra:
            messages = [with_records(m, extra) for m in messages]
            self.count_bytes_down(
                sum(record_nbytes(r) for r in extra.values()) * len(messages)
            )
        self._sent = [int(m.metadata.dst_node_id) for m in messages]
        return messages

    def instruction_records(self, server_round: int) -> dict[str, ArrayRecord]:
        """Extra ArrayRecords every train instruction of the round carries.

        Added by :meth:`configure_train` (and counted in ``bytes-down``);
        e.g. SCAFFOLD-LoRA's control variate. Default: none.
        """
        return {}

    def clip_extras(self, update: ClientUpdate) -> ClientUpdate:
        """Move a clipped update's extra records as its arrays were moved.

        Robust norm clipping moves the arrays to ``ref + f (x - ref)``
        (``update.clip_factor`` = f); the extra records of
        :meth:`reply_records` follow here. Default: each scales by ``f`` (a
        record linear in the update). A method whose records depend on the
        update otherwise overrides this (SCAFFOLD-LoRA's control delta).
        """
        f = update.clip_factor
        if f == 1.0 or not update.extras:
            return update
        extras = {
            name: {k: v * f for k, v in record.items()}
            for name, record in update.extras.items()
        }
        return dataclasses.replace(update, extras=extras)

    def count_bytes_down(self, nbytes: int) -> None:
        """Add ``nbytes`` sent beside the global arrays to the round's
        ``bytes-down`` (records a subclass adds to some instructions)."""
        self._bytes_down += int(nbytes)

    def check_arrays(self, arrays: ArrayRecord) -> None:
        """Check the global arrays' keys and shapes against :meth:`expected_arrays`.

        Raises
        ------
        InitialArraysError
            Naming the missing, unexpected and mis-shaped keys and what to
            pass instead (:meth:`initial_arrays_hint`).
        """
        expected = self.expected_arrays()
        if expected is None:
            return
        got = {key: tuple(int(n) for n in arrays[key].shape) for key in arrays}
        shapes = {
            key: (shape, tuple(expected[key]))
            for key, shape in got.items()
            if key in expected and shape != tuple(expected[key])
        }
        missing = sorted(set(expected) - set(got))
        unexpected = sorted(set(got) - set(expected))
        if missing or unexpected or shapes:
            raise InitialArraysError(
                type(self).__name__,
                missing=missing,
                unexpected=unexpected,
                shapes=shapes,
                hint=self.initial_arrays_hint(),
            )

    def prepare_round(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord
    ) -> ConfigRecord:
        """Remember the round's global arrays; return the round's ConfigRecord.

        The ConfigRecord is ``config`` with ``lr`` decayed for the round and
        :meth:`round_config`'s values added. :meth:`configure_train` calls it;
        so does the legacy-API adapter (:mod:`fedlr.strategies.legacy`), whose
        server reports lost replies as failures itself: the nodes sent to are
        forgotten here and only :meth:`configure_train` records them.
        """
        self._current = arrays
        self._sent = self.instructed = None
        round_config = ConfigRecord(dict(config))
        if LR in round_config:
            lr = float(cast(float, round_config[LR]))
            round_config[LR] = lr * self.lr_decay ** (server_round - 1)
        for key, value in self.instruction_config(server_round).items():
            round_config[key] = value
        if self.privacy.dp_sgd is not None:  # the clients' DP-SGD settings
            for key, value in self.privacy.dp_sgd.instruction().items():
                round_config[key] = value
        return round_config

    def note_sent(self, arrays: ArrayRecord, count: int) -> None:
        """Record that ``arrays`` went to ``count`` clients (``bytes-down``,
        client-level DP's denominator ``m``, kept whatever the replies)."""
        self._bytes_down = record_nbytes(arrays) * count
        self.instructed = int(count)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate every reply, aggregate the valid ones, report metrics.

        Dropped, each with a logged reason and counted in ``dropped``: replies
        that fail validation, updates far larger than the round's median
        (:meth:`screen_update_sizes`, ``screen_ratio``), a node's second
        reply, replies from nodes that were not sent an instruction this
        round, and (as ``no reply``) nodes that were sent one but did not
        answer.

        Returns
        -------
        arrays : ArrayRecord
            The next global arrays.
        metrics : MetricRecord
            The clients' own metrics aggregated by ``train_metrics_aggr_fn``
            beside fedlr's (``num-examples``, ``clients``, ``dropped``,
            ``bytes-up``, ``bytes-down``, ``train-loss`` and the method's
            report); fedlr's win on a clash.
        """
        if self._current is None:
            raise RuntimeError(
                "aggregate_train called before configure_train: the strategy does "
                "not know the current global arrays"
            )
        current = record_to_state(self._current)
        updates, dropped = self.accepted_updates(server_round, replies, current)
        valid = len(updates)
        updates, left_out, round_metrics = self.protected_updates(
            server_round, updates, current
        )
        snapshot = copy.deepcopy(self.state_dict())
        report = RoundReport()
        try:
            state, report = self.aggregate_updates(server_round, updates, current)
        except NUMERIC_FAULTS as exc:
            rejection: str | None = (
                f"the aggregation failed: {type(exc).__name__}: {short(str(exc))}"
            )
        else:
            rejection = self.check_new_state(state, current)
        metrics: dict[str, float] = {
            NUM_EXAMPLES: float(sum(u.num_examples for u in updates)),
            "clients": float(valid),
            "dropped": float(len(dropped)),
            "bytes-up": float(sum(u.nbytes for u in updates)),
            "bytes-down": float(self._bytes_down),
            "rejected": 0.0 if rejection is None else 1.0,
            **round_metrics,
        }
        if any(key in u.metrics for u in updates for key in TRAIN_LOSS_ALIASES):
            metrics[TRAIN_LOSS] = self.mean_train_loss(updates)
        clients = self.client_metrics(updates, left_out)
        if rejection is not None:
            self.load_state_dict(snapshot)
            self.reject_round(server_round, rejection, metrics)
            return None, self.merge_metrics(clients, metrics)
        self.last_rejection = None
        metrics["rejected-rounds"] = float(self.rejected_rounds)
        metrics.update(report.metrics)
        self.last_report = RoundReport(metrics=dict(metrics), layers=report.layers)
        log(
            INFO,
            "round %d: aggregated %d replies (%d dropped)",
            server_round,
            len(updates),
            len(dropped),
        )
        return state_to_record(state), self.merge_metrics(clients, metrics)

    def client_metrics(
        self, updates: list[ClientUpdate], left_out: list[ClientUpdate]
    ) -> MetricRecord | None:
        """The clients' own metrics by ``train_metrics_aggr_fn``; those of the
        clients the robust rule left out are aggregated apart (``trimmed-``)."""
        clients = self.train_metrics_aggr_fn(
            [without_helper_metrics(u.content) for u in updates], self.weighted_by_key
        )
        if left_out:
            trimmed = self.train_metrics_aggr_fn(
                [without_helper_metrics(u.content) for u in left_out],
                self.weighted_by_key,
            )
            clients = with_trimmed(clients, trimmed)
        return clients

    def accepted_updates(
        self,
        server_round: int,
        replies: Iterable[Message],
        current: Mapping[str, torch.Tensor],
    ) -> tuple[list[ClientUpdate], list[str]]:
        """The round's valid updates and why the others were dropped.

        In order: who may answer (:meth:`screen_replies`), what the reply holds
        (:meth:`validate_replies`), how large its update is
        (:meth:`screen_update_sizes`); each drop is logged.

        Raises
        ------
        NoValidRepliesError
            With fewer than ``min_replies`` valid updates.
        """
        fresh, dropped = self.screen_replies(list(replies))
        updates, invalid = self.validate_replies(fresh)
        updates, oversized = self.screen_update_sizes(updates, current)
        dropped = invalid + oversized + dropped
        self.last_dropped = dropped
        for reason in dropped:
            log(WARNING, "round %d: dropped a reply: %s", server_round, reason)
        if len(updates) < self.min_replies:
            raise NoValidRepliesError(
                server_round, len(updates), self.min_replies, dropped
            )
        return updates, dropped

    def protected_updates(
        self,
        server_round: int,
        updates: list[ClientUpdate],
        current: Mapping[str, torch.Tensor],
    ) -> tuple[list[ClientUpdate], list[ClientUpdate], dict[str, float]]:
        """The updates the method aggregates, after the robust rule and DP.

        Returns the updates (clipped, re-weighted or trimmed by the robust
        rule, their extra records moved along, clipped and noised by
        client-level DP), the updates the robust rule left out, and the
        round's robust and privacy metrics (with DP-SGD's largest client
        epsilon).
        """
        metrics: dict[str, float] = {}
        left_out: list[ClientUpdate] = []
        self.last_robust = []
        if self.robust.active:
            outcome = robust_aggregate(updates, self.robust_space(current), self.robust)
            for reason in outcome.reasons:
                log(
                    WARNING,
                    "round %d: robust (%s): %s",
                    server_round,
                    self.robust.rule,
                    reason,
                )
            kept_nodes = {u.node_id for u in outcome.updates}
            left_out = [u for u in updates if u.node_id not in kept_nodes]
            updates, metrics = outcome.updates, dict(outcome.metrics)
            updates = [self.clip_extras(u) for u in updates]
            self.last_robust = outcome.reasons
        updates, dp_metrics = protect(self, server_round, updates, current)
        metrics.update(dp_metrics)  # client-level DP, DP-SGD's largest epsilon
        return updates, left_out, metrics

    def reject_round(
        self, server_round: int, rejection: str, metrics: dict[str, float]
    ) -> None:
        """Count and log a rejected round (the previous state was restored)."""
        self.rejected_rounds += 1
        self.last_rejection = rejection
        metrics["rejected-rounds"] = float(self.rejected_rounds)
        self.last_report = RoundReport(metrics=dict(metrics))
        log(
            WARNING,
            "round %d rejected: %s; the previous global model is kept and the "
            "run goes on (%d rejected so far)",
            server_round,
            rejection,
            self.rejected_rounds,
        )

    def check_new_state(
        self, state: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor]
    ) -> str | None:
        """Why the aggregated global state must not be published, or ``None``.

        Refused: any NaN or Inf, and, with ``max_update_ratio`` > 0, a change
        ``||new - current||_F`` above ``max_update_ratio * ||current||_F``
        (over the keys whose shape did not change).
        """
        for key, tensor in state.items():
            if not bool(torch.isfinite(tensor).all()):
                return f"the new global array '{key}' contains NaN or Inf"
        if self.max_update_ratio <= 0:
            return None
        change_sq = 0.0
        norm_sq = 0.0
        for key, tensor in state.items():
            old = current.get(key)
            if old is None or old.shape != tensor.shape:
                continue
            change_sq += float((tensor.double() - old.double()).square().sum())
            norm_sq += float(old.double().square().sum())
        change, norm = math.sqrt(change_sq), math.sqrt(norm_sq)
        if change > self.max_update_ratio * norm:
            return (
                f"the global update norm {change:.4g} exceeds max-update-ratio "
                f"{self.max_update_ratio} x the current norm {norm:.4g}"
            )
        return None

    @staticmethod
    def mean_train_loss(updates: list[ClientUpdate]) -> float:
        """Weighted mean training loss of the updates that report one, else NaN.

        Either spelling counts (:data:`~fedlr.protocol.TRAIN_LOSS_ALIASES`); a
        reported NaN or Inf is kept (a diverged client shows in the mean).
        """
        reported = [
            (train_loss_of(u.metrics), u.num_examples)
            for u in updates
            if any(key in u.metrics for key in TRAIN_LOSS_ALIASES)
        ]
        if not reported:
            return math.nan
        return sum(loss * n for loss, n in reported) / sum(n for _, n in reported)

    def merge_metrics(
        self,
        clients: MetricRecord | None,
        own: Mapping[str, float],
        *,
        quiet: Iterable[str] = (),
    ) -> MetricRecord:
        """The clients' aggregated metrics with fedlr's own on top.

        A key of the clients' that fedlr also reports is replaced by fedlr's
        value, with a warning logged once per key (``num-examples``, the
        training loss and the keys of ``quiet`` are replaced silently).
        """
        values: dict[str, MetricRecordValues] = dict(clients or {})
        quiet = {NUM_EXAMPLES, self.weighted_by_key, *TRAIN_LOSS_ALIASES, *quiet}
        clashes = sorted((set(values) & set(own)) - quiet - self._warned_clashes)
        if clashes:
            self._warned_clashes.update(clashes)
            log(
                WARNING,
                "the clients' aggregated metrics %s clash with fedlr's own; "
                "fedlr's values are reported (rename them in the ClientApp or "
                "the metrics aggregation fn)",
                clashes,
            )
        values.update(own)
        return MetricRecord(values)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """FedAvg's evaluate instructions, with the round's values in the config.

        The ConfigRecord carries :meth:`round_config`'s values (roles, rank,
        projections...), so a client rebuilds its adapter at the shape of
        ``arrays``. Nothing is sent when ``fraction_evaluate`` is 0.
        """
        eval_config = ConfigRecord(dict(config))
        for key, value in self.instruction_config(server_round).items():
            eval_config[key] = value
        return super().configure_evaluate(server_round, arrays, eval_config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Aggregate the evaluate replies' metrics by ``evaluate_metrics_aggr_fn``.

        A reply carries a MetricRecord only (no arrays needed); an error reply
        or one without exactly one MetricRecord and a positive integer weight
        is dropped with a logged reason. ``None`` when no reply is valid. The
        helpers' ids and flags (:data:`fedlr.protocol.HELPER_METRICS`) are not
        averaged.

        When ``evaluate`` was not given and every reply is Flower's ``No
        evaluate function registered`` error, the ClientApp cannot evaluate:
        one warning says so and ``fraction_evaluate`` becomes 0 for the rest
        of the run.
        """
        contents: list[RecordDict] = []
        replies = list(replies)
        if self.no_evaluate_handler(replies):
            log(
                WARNING,
                "round %d: the ClientApps have no @app.evaluate() (%d replies: "
                "'%s'); federated evaluation is off from now on "
                "(fraction_evaluate=0.0). Build the strategy with evaluate=False "
                "to skip it from the start",
                server_round,
                len(replies),
                NO_EVALUATE_HANDLER,
            )
            self.fraction_evaluate = 0.0
            self.min_evaluate_nodes = 0
            return None
        for message in replies:
            node = int(message.metadata.src_node_id)
            try:
                if message.has_error():
                    raise ReplyValidationError(
                        node, f"client error: {message.error.reason}"
                    )
                self.reply_weight(node, message.content)
            except ReplyValidationError as exc:
                log(
                    WARNING,
                    "round %d: dropped an evaluate reply: %s",
                    server_round,
                    exc,
                )
                continue
            contents.append(without_helper_metrics(message.content))
        if not contents:
            return None
        return self.evaluate_metrics_aggr_fn(contents, self.weighted_by_key)

    def no_evaluate_handler(self, replies: list[Message]) -> bool:
        """Whether ``replies`` show that the ClientApp has no evaluate function
        (all of them Flower's error for it), when ``evaluate`` was not given."""
        return (
            self.client_evaluates is None
            and bool(replies)
            and all(
                m.has_error() and NO_EVALUATE_HANDLER in str(m.error.reason)
                for m in replies
            )
        )


keep_ledger(FedLRStrategy)


def with_trimmed(
    clients: MetricRecord | None, trimmed: MetricRecord | None
) -> MetricRecord:
    """The clients' aggregated metrics plus those of the clients a robust rule
    left out, aggregated apart, each key prefixed ``trimmed-``."""
    values: dict[str, MetricRecordValues] = dict(clients or {})
    for key, value in (trimmed or {}).items():
        values[f"trimmed-{key}"] = value
    return MetricRecord(values)


def with_records(message: Message, records: Mapping[str, ArrayRecord]) -> Message:
    """A copy of an instruction with ``records`` added to its content."""
    content = RecordDict(dict(message.content.items()))
    for name, record in records.items():
        content[name] = record
    return Message(
        content=content,
        message_type=message.metadata.message_type,
        dst_node_id=int(message.metadata.dst_node_id),
    )
