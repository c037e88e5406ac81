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
import math
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
from fedlr.robust.screen import DEFAULT_SCREEN_RATIO, ScreenOutcome
from fedlr.robust.server_update import ServerUpdate
from fedlr.round.describe import log_summary
from fedlr.round.evaluation import (
    aggregate_evaluation,
    aggregate_personal_evaluation,
)
from fedlr.round.instructions import evaluate_instructions, train_instructions
from fedlr.round.pipeline import aggregate_round
from fedlr.round.publish import RoundReport
from fedlr.round.replies import Replies, reply_step_type
from fedlr.strategies.refusals import PrivacyTraits, check_robust
from fedlr.wire.fingerprint import BaseFingerprint
from fedlr.wire.updates import ClientUpdate

__all__ = ["ClientUpdate", "FedLRStrategy", "RoundReport", "weighted_means"]


class FedLRStrategy(FedAvg):
    """A method as a Flower Message-API strategy: the method's hooks and
    Flower's, the rest of the round in composed steps (:mod:`fedlr.round`).

    Used as a plug-in in a user's own ServerApp (Flower's ``strategy.start()``)
    it keeps Flower's conventions: ``FedAvg``'s defaults (``fraction_evaluate``
    1.0, ``min_*_nodes`` 2), the clients' own metrics aggregated by
    ``train_metrics_aggr_fn`` / ``evaluate_metrics_aggr_fn`` (by default a
    weighted average by ``num-examples``) beside fedlr's, and lost replies
    counted. fedlr's own ServerApp passes its choices explicitly
    (:func:`fedlr.round.describe.app_arguments`) and drives rounds with
    :func:`fedlr.round.pipeline.run_round`, which runs the same hooks as
    ``start()``.

    A method overrides :meth:`aggregate_updates` (a pure function of the
    validated updates and the current global state), :meth:`reply_shapes`,
    and where it must :meth:`round_config` (per-round values for every
    instruction), :meth:`instructions` (per-node records),
    :meth:`state_dict` / :meth:`load_state_dict` (what a resumed run needs)
    and ``round_state`` (the attributes ``aggregate_updates`` changes, put
    back when a round is rejected). Its replies' extra records, update space
    and further checks are its reply step, ``replies_type``
    (:class:`fedlr.round.replies.Replies`).

    Class attributes: ``send_roles`` and ``train_roles`` are the roles of the
    global arrays sent to clients and of the arrays a client sends back
    (empty: the strategy declares its arrays by key, see
    :meth:`reply_shapes`); ``federated_evaluation``
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
    """The class a run with ``client-ranks`` builds instead of this one (set by
    FedEx-LoRA and FedSpec, whose heterogeneous-rank rounds are another
    class); read by :meth:`fedlr.strategies.registry.MethodSpec.strategy_for`."""
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
        **kwargs: Any,
    ) -> None:
        self.method_options: Options = own_options(type(self), options, kwargs)
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
        traits = type(self).privacy_traits
        if traits is not None:  # the refusal resolve() makes of a run config
            traits.check(self.privacy, self.method_options)
        self.screen_ratio = screen_ratio
        self.last_screen: ScreenOutcome | None = None
        self.rejected_rounds = 0
        self.last_rejection: str | None = None
        self.last_robust: list[str] = []
        self.heldout_check: HeldOutCheck | None = None
        """The held-out check (:mod:`fedlr.robust.heldout`), set by the server
        plan with ``heldout-check = true``; a plug-in user may set one."""
        self.server_update: ServerUpdate | None = None
        """The server's own update (:mod:`fedlr.robust.server_update`), set by
        the server plan with ``server-update-share > 0``; a plug-in user may
        set one."""
        self.server_instruction: Message | None = None
        """The round's first train instruction (what the server's own update
        trains), kept by :meth:`configure_train`."""
        self.last_timing: dict[str, float] = {}
        self._current: ArrayRecord | None = None
        self._bytes_down = 0
        self._sent: list[int] | None = None
        self.instructed: int | None = None  # nodes sent an instruction this round
        self.client_dp_ledger = ClientDpLedger.of(self.privacy)
        self._warned_clashes: set[str] = set()
        self.last_report: RoundReport = RoundReport()
        self.replies = reply_step_type(type(self))(self)
        """The round's decode, validate and screen steps."""
        for klass in type(self).__mro__:  # client-level DP's releases
            if issubclass(klass, FedLRStrategy):  # checkpointed by every class
                keep_ledger(klass)
        self.nodes_sampled_from = 0
        self.last_dropped: list[str] = []
        self.base_fingerprint: BaseFingerprint | None = None
        """Plug-in use: the server's model's frozen weights (:meth:`bind_model`),
        sent with every instruction; ``None``: not sent, not checked."""

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
        """Combine validated updates into the next global state.

        Parameters
        ----------
        server_round : int
        updates : list of ClientUpdate
            Validated, screened and protected (robust rule or client-level
            DP), sorted by partition id then node id; weight each by
            ``u.weight``.
        current : dict of str to torch.Tensor
            The global state sent this round.

        Returns
        -------
        state : dict of str to torch.Tensor
            The next global state (every key to send next round).
        report : RoundReport
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
        """The method's one per-node hook: the round's sampled instructions
        (train, or evaluate with ``train=False``), each with the global
        ``arrays`` and the round's values, as they go out.

        A method returns them with per-node records added or replaced (a
        node's base weights as changes, its personal factors, a control
        variate). Whatever ArrayRecords they carry count as ``bytes-down``.
        Default: unchanged.
        """
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
        """Check and remember the global arrays, sample, build each node's
        instruction (:func:`fedlr.round.instructions.train_instructions`).

        Raises
        ------
        InitialArraysError
            If ``arrays`` are not the ones the strategy sends, before any
            instruction goes out.
        """
        return train_instructions(self, server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The round's steps (:func:`fedlr.round.pipeline.aggregate_round`):
        decode, validate and screen every reply, the robust rule or
        client-level DP, :meth:`aggregate_updates`, check and publish.

        Returns ``None`` arrays when the round is rejected (the previous
        global arrays are kept).
        """
        return aggregate_round(self, server_round, replies)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """FedAvg's evaluate instructions with the round's values, through
        :meth:`instructions`
        (:func:`fedlr.round.instructions.evaluate_instructions`)."""
        return evaluate_instructions(self, server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """The evaluate replies' metrics by ``evaluate_metrics_aggr_fn``
        (:func:`fedlr.round.evaluation.aggregate_evaluation`); a personalised
        method's, the mean and spread of the clients' accuracies on their own
        models (:func:`~fedlr.round.evaluation.aggregate_personal_evaluation`)."""
        if self.personalised:
            return aggregate_personal_evaluation(self, server_round, replies)
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
