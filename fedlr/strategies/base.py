"""Base of every fedlr strategy: a method as a Flower strategy.

A subclass declares which arrays a valid reply carries (:meth:`reply_shapes`)
and implements :meth:`aggregate_updates`, a pure function of the validated
updates and the current global state; where it must, it adds per-round
values (:meth:`round_config`), per-node records (:meth:`instructions`) and
its reply step (``replies_type``). The rest of a round (instructions and
bytes, decoding and validating replies, the screen, the robust rule,
client-level DP, rejected rounds, metrics) is composed steps in
:mod:`fedlr.round`; ``ClientUpdate`` (:mod:`fedlr.wire.updates`) and
``RoundReport`` (:mod:`fedlr.round.publish`) are re-exported from here.
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedlr.adapters.roles import Role
from fedlr.linalg import weighted_mean
from fedlr.options import NoOptions, Options, coerce, kebab
from fedlr.privacy.client_dp import ClientDpLedger, keep_ledger
from fedlr.privacy.settings import PrivacyConfig
from fedlr.robust.heldout import HeldOutCheck
from fedlr.robust.rules import RobustConfig
from fedlr.robust.screen import DEFAULT_SCREEN_RATIO
from fedlr.robust.server_update import ServerUpdate
from fedlr.round.describe import check_settings, evaluate_arguments, log_summary
from fedlr.round.evaluation import (
    aggregate_evaluation,
    aggregate_personal_evaluation,
    no_evaluate_handler,
)
from fedlr.round.instructions import (
    check_arrays,
    train_config,
    train_round,
    with_round_values,
)
from fedlr.round.pipeline import aggregate_round
from fedlr.round.publish import RoundReport
from fedlr.round.replies import Replies, reply_step_type
from fedlr.round.value import LatestRound, Round
from fedlr.strategies.refusals import PrivacyTraits, check_robust
from fedlr.wire.fingerprint import BaseFingerprint
from fedlr.wire.updates import ClientUpdate

__all__ = ["ClientUpdate", "FedLRStrategy", "RoundReport", "weighted_means"]


class FedLRStrategy(LatestRound, FedAvg):
    """A method as a Flower Message-API strategy: the method's hooks and
    Flower's, the rest of the round in composed steps (:mod:`fedlr.round`).

    As a plug-in (Flower's ``strategy.start()``) it keeps Flower's
    conventions: ``FedAvg``'s defaults, the clients' own metrics by
    ``train_metrics_aggr_fn`` / ``evaluate_metrics_aggr_fn`` beside fedlr's,
    lost replies counted. fedlr's ServerApp passes its choices
    (:func:`fedlr.round.describe.app_arguments`) and runs the same hooks
    (:func:`fedlr.round.pipeline.run_round`). Each round is a value
    (:class:`~fedlr.round.value.Round`), the latest kept as ``round``.

    A method overrides :meth:`aggregate_updates` (a pure function of the
    validated updates and the current global state), :meth:`reply_shapes`,
    and where it must :meth:`round_config` (per-round values for every
    instruction), :meth:`instructions` (per-node records),
    :meth:`state_dict` / :meth:`load_state_dict` (what a resumed run needs)
    and ``round_state`` (the attributes ``aggregate_updates`` changes, put
    back when a round is rejected). Its replies' extra records, update space
    and further checks are its reply step, ``replies_type``
    (:class:`fedlr.round.replies.Replies`).

    Class attributes: ``send_roles`` / ``train_roles``, the roles of the
    global arrays sent and of the arrays a client sends back (empty: by key,
    :meth:`reply_shapes`); ``federated_evaluation``, whether fedlr's app runs
    federated evaluation (personalised methods: each client's own model).

    Parameters
    ----------
    min_replies : int, default 1
        Valid replies needed to aggregate a round; fewer raise
        :class:`~fedlr.errors.NoValidRepliesError`.
    lr_decay : float, default 1.0
        If the train config carries ``lr``, round ``t`` sends
        ``lr * lr_decay ** (t - 1)`` (a server-side step-size schedule).
    robust : RobustConfig, optional
        Robust aggregation (:mod:`fedlr.robust.rules`): norm clipping, geometric
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
        A reply whose update norm (in the reply step's ``space``) exceeds this times
        the round's median update norm, and the current state's norm, is
        dropped before aggregation (:func:`fedlr.robust.screen.screen_sizes`); 0
        turns the screen off.
    privacy : PrivacyConfig, optional
        Differential privacy (:mod:`fedlr.privacy`): DP-SGD settings sent to
        the clients, client-level DP applied here after validation. Default:
        none. A mechanism the method cannot have is refused here
        (``PrivacyUnsupportedError``, as for a run config: :attr:`privacy_traits`).
    client_dp_on_nodes : bool, default False
        Client-level DP is distributed (SecAgg+): the nodes clip and noise,
        this strategy keeps the ledger and noises nothing.
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
    asynchronous: ClassVar[bool] = False
    """Run by fedlr's asynchronous engine
    (:class:`~fedlr.strategies.async_lora.AsyncLoraStrategy`)."""
    hetero_variant: ClassVar[type[FedLRStrategy] | None] = None
    """The class a run with ``client-ranks`` builds instead (FedEx-LoRA's,
    FedSpec's; :meth:`fedlr.strategies.registry.MethodSpec.strategy_for`)."""
    extra_columns: tuple[str, ...] = ()
    replies_type: ClassVar[type[Replies]] = Replies
    """The method's reply step: its extra records, update space and checks
    (each class's own, combined along the MRO:
    :func:`~fedlr.round.replies.reply_step_type`)."""
    round_state: ClassVar[tuple[str, ...]] = ()
    """Attributes (besides :meth:`state_dict`) that :meth:`aggregate_updates`
    changes: copied before the method runs and put back if the round is
    rejected (each class of the MRO adds its own)."""
    privacy_traits: ClassVar[PrivacyTraits | None] = None
    """What the configuration-time privacy refusals read of the method's
    registration (set by :func:`~fedlr.strategies.registration.register_method`;
    a subclass inherits its method's): the constructor refuses a ``privacy``
    the method cannot have (:func:`fedlr.strategies.refusals.check_privacy`)."""
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
        client_dp_on_nodes: bool = False,
        **kwargs: Any,
    ) -> None:
        self.method_options: Options = own_options(type(self), options, kwargs)
        kwargs = evaluate_arguments(evaluate, kwargs)
        check_settings(
            min_replies, lr_decay, max_num_examples, max_update_ratio, screen_ratio
        )
        super().__init__(**kwargs)
        self.client_evaluates = evaluate  # None: not said (see the class)
        self.lr_decay = lr_decay
        self.min_replies = min_replies
        self.robust = robust if robust is not None else RobustConfig()
        self.max_num_examples = max_num_examples
        self.max_update_ratio = max_update_ratio
        self.privacy = privacy if privacy is not None else PrivacyConfig()
        check_robust(self.privacy, self.robust)
        traits = type(self).privacy_traits
        if traits is not None:  # the refusal resolve() makes of a run config
            traits.check(self.privacy, self.method_options)
        self.client_dp_ledger = ClientDpLedger.of(self.privacy)
        if client_dp_on_nodes:  # SecAgg+'s distributed DP: no server noise
            self.privacy = dataclasses.replace(self.privacy, client_dp=None)
        self.screen_ratio = screen_ratio
        # Set by the server plan (heldout-check, server-update-share > 0), or
        # by a plug-in user: fedlr.robust.heldout, fedlr.robust.server_update.
        self.heldout_check: HeldOutCheck | None = None
        self.server_update: ServerUpdate | None = None
        self.replies = reply_step_type(type(self))(self)
        """The round's decode, validate and screen steps."""
        for klass in type(self).__mro__:  # client-level DP's releases
            if issubclass(klass, FedLRStrategy):  # checkpointed by every class
                keep_ledger(klass)
        # plug-in use: the server's model's frozen weights, sent with every
        # instruction (fedlr.round.instructions.fingerprint_model); None: not
        self.base_fingerprint: BaseFingerprint | None = None

    # ------------------------------------------------------------ the method
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
        """Combine validated updates into the next global state (every key
        to send next round) and the round's :class:`RoundReport`.

        ``updates`` are validated, screened and protected (robust rule or
        client-level DP), sorted by partition id then node id; weight each
        by ``u.weight``. ``current`` is the global state sent this round.
        """

    def round_config(self, server_round: int) -> dict[str, Any]:
        """Extra per-round values for every train and evaluate instruction's
        ConfigRecord."""
        return {}

    def instructions(
        self,
        server_round: int,
        messages: list[Message],
        arrays: ArrayRecord,
        *,
        train: bool,
    ) -> list[Message]:
        """The method's one per-node hook: the round's sampled train (or
        evaluate, ``train=False``) instructions as they go out, with per-node
        records added or replaced (base weights as changes, personal
        factors, a control variate); their ArrayRecords count as
        ``bytes-down``. Default: unchanged."""
        return messages

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

    # ------------------------------------------------------------ Flower hooks
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Check the global arrays (``InitialArraysError`` before anything is
        sent), add the round's values, sample (``FedAvg``), build each node's
        instruction and begin the round
        (:func:`fedlr.round.instructions.train_round`)."""
        check_arrays(self, arrays)
        round_config = train_config(self, server_round, config)
        population = len(list(grid.get_node_ids()))
        sampled = super().configure_train(server_round, arrays, round_config, grid)
        messages, self.round = train_round(
            self, server_round, arrays, list(sampled), population
        )
        return messages

    def begin_round(
        self,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord | None = None,
        **sent: Any,
    ) -> ConfigRecord:
        """Begin a round on ``arrays`` without sampling (the legacy adapter,
        replies built by hand; ``sent``: other :class:`Round` fields); its
        train ConfigRecord (:func:`~fedlr.round.instructions.train_config`)."""
        before = self.rejected_rounds
        self.round = Round(server_round, arrays, rejected_before=before, **sent)
        return train_config(self, server_round, config or ConfigRecord())

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The round's steps (:func:`fedlr.round.pipeline.aggregate_round`);
        ``None`` arrays when the round is rejected (the previous are kept)."""
        arrays, metrics, self.round = aggregate_round(self, server_round, replies)
        return arrays, metrics

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """FedAvg's evaluate instructions with the round's values
        (:func:`~fedlr.round.instructions.with_round_values`), through
        :meth:`instructions`. Nothing is sent when ``fraction_evaluate`` is 0."""
        config = with_round_values(self, server_round, config)
        messages = list(super().configure_evaluate(server_round, arrays, config, grid))
        if not messages:
            return messages
        return list(self.instructions(server_round, messages, arrays, train=False))

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """The evaluate replies' metrics (:mod:`fedlr.round.evaluation`; a
        personalised method's: the clients' mean and spread, the round's
        ``evaluation``); a ClientApp without an evaluate function turns
        federated evaluation off."""
        if self.personalised:
            metrics, evaluation = aggregate_personal_evaluation(
                self, server_round, replies
            )
            if self.round is not None:
                self.round = dataclasses.replace(self.round, evaluation=evaluation)
            return metrics
        replies = list(replies)
        if no_evaluate_handler(self, server_round, replies):
            self.fraction_evaluate, self.min_evaluate_nodes = 0.0, 0
            return None
        return aggregate_evaluation(self, server_round, replies)

    def summary(self) -> None:
        """Log the fedlr settings (:func:`fedlr.round.describe.settings`),
        then FedAvg's."""
        log_summary(self)
        super().summary()


def own_options(
    cls: type[FedLRStrategy], options: Options | None, kwargs: dict[str, Any]
) -> Options:
    """``options`` (default: ``cls.options_type``'s defaults) with the option
    fields named in ``kwargs`` replaced; those are popped.

    Raises
    ------
    TypeError
        If ``options`` is not an instance of ``cls.options_type``.
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


def weighted_means(
    updates: list[ClientUpdate],
    keys: Iterable[str],
    like: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Per-key weighted mean of the updates, weights ``u.weight``.

    With ``like``, each mean is cast to ``like[key]``'s dtype.
    """
    weights = [u.weight for u in updates]
    means = {
        key: weighted_mean([u.arrays[key] for u in updates], weights) for key in keys
    }
    if like is not None:
        means = {k: v.to(like[k].dtype) for k, v in means.items()}
    return means
