"""Client features: what a method asks of a node beyond the common round.

The counterpart of PEFT's ``tuners/<method>/layer.py``. The common round
(:func:`fedlr.client.round.apply_round`) decodes and checks the instruction,
conforms the model's rank and scaling, loads the arrays and sets what
trains; everything a particular method adds is a :class:`ClientFeature`
that lives in that method's module and is listed in its registration::

    PROXIMAL_MU = "proximal-mu"

    class ProximalTerm(ClientFeature):
        keys = (Bound(PROXIMAL_MU, "float", 0.0),)
        loss_reads_data = False
        order = 40

        @classmethod
        def for_round(cls, job):
            mu = config_float(job.config, PROXIMAL_MU, 0.0)
            return cls(mu) if job.is_train and mu > 0 else None

        def loss(self, job):
            ...

    @register_method("fedprox-lora", ..., client=(ProximalTerm,))
    class FedProxLoRA(...): ...

A feature is switched on by the instruction, not by the method's name (the
plug-in helpers see only the message): :meth:`ClientFeature.for_round`
returns an instance for this round, or ``None``. Every feature registered by
any method is asked, in ``order`` (ties: by class name), so a strategy that
sends ``proximal-mu`` gets the proximal term on any node.

A feature owns its surface, declared on its class:

* its **wire keys** (:attr:`ClientFeature.keys`), each a
  :class:`~fedlr.client.checks.Bound`: creating the class registers
  them with the node's instruction check
  (:func:`fedlr.client.checks.declare_bounds`), so a new key needs no
  edit of :mod:`fedlr.client.checks` or :mod:`fedlr.wire.protocol`;
* its **node state** (:attr:`~ClientFeature.node_state`: what it keeps in
  ``context.state``), the **extra records** it receives in instructions and
  sends in replies (:attr:`~ClientFeature.receives`,
  :attr:`~ClientFeature.sends`) and the **reply metrics** it writes
  (:attr:`~ClientFeature.metrics`), each a :class:`Record`: a user's own
  metrics may not reuse those names, and a method whose features send
  records cannot have client-level DP (refused at configuration,
  :func:`fedlr.strategies.refusals.check_privacy`);
* whether its loss term **reads the data** (:attr:`~ClientFeature.loss_reads_data`):
  DP-SGD adds the gradient of a term that does not after its per-example
  clipping and noise, and refuses one that does;
* its rows in docs/reliability.md and docs/privacy.md, generated from these
  declarations (:mod:`fedlr.configdoc.features`).

Hooks, each optional, at the three moments of a round:

* the instruction arrives: :meth:`~ClientFeature.load` edits the state about
  to be loaded into the model (base weights, a folded tail, personal arrays);
* training: :meth:`~ClientFeature.loss` adds a term to the loss,
  :meth:`~ClientFeature.after_backward` transforms the gradients after each
  ``backward`` (SCAFFOLD's correction, per-sample clipping),
  :meth:`~ClientFeature.wrap_optimizer` replaces the optimizer;
* the reply: :meth:`~ClientFeature.reply_arrays` transforms the arrays sent
  back (pruning, re-factoring), :meth:`~ClientFeature.reply_records` adds
  metrics and extra records.

One feature may also run the training loop itself
(:meth:`~ClientFeature.loop`, a :class:`fedlr.client.train.LoopControl`: its batches,
its loss, its optimizer step), as sample-level DP-SGD does.

Common features. A feature that any method can carry, whatever its
registration lists, is registered once with :func:`common_feature` (DP-SGD,
:class:`fedlr.privacy.dp_sgd.DpSgd`): every node asks it too, and it switches
itself on when the instruction carries its keys, refusing a model it cannot
serve by name.

Nothing here imports Flower's server side or a strategy; the features'
modules import this one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self, TypeVar

import torch

from fedlr.client.checks import (
    Bound,
    Expected,
    Incoming,
    RecordRule,
    check_records,
    declare_bounds,
)

if TYPE_CHECKING:
    from flwr.app import ConfigRecord, Context, Message, MetricRecordValues, RecordDict

    from fedlr.adapters.roles import AdaptedModel, Role
    from fedlr.client.pruning import RankPruning
    from fedlr.client.train import LoopControl

__all__ = [
    "Bound",
    "ClientFeature",
    "Expected",
    "Incoming",
    "Record",
    "RoundJob",
    "StepTogether",
    "check_received",
    "common_feature",
    "common_features",
    "ordered",
]


@dataclass(frozen=True)
class Record:
    """A named thing a feature keeps or puts on the wire, and what it holds.

    Attributes
    ----------
    name : str
        The record's name (an ArrayRecord or ConfigRecord of the message, of
        ``context.state``) or the metric's key.
    holds : str
        What it holds, one line of Markdown (the generated docs' tables).
    expects : callable, optional
        For a record the feature receives (:attr:`ClientFeature.receives`),
        required there: ``expects(incoming)`` gives the keys and shapes the
        record must hold in this instruction
        (:class:`~fedlr.client.checks.Expected`), or ``None`` when the feature
        does not read it then. The node checks it before anything changes
        (:func:`check_received`): absent, missing or unknown keys, other
        shapes or dtypes, NaN or Inf are refused by name.
    """

    name: str
    holds: str
    expects: RecordRule | None = None


class StepTogether(torch.optim.Optimizer):
    """The round's optimizer and a feature's own one, stepped together.

    For :meth:`ClientFeature.wrap_optimizer`: the round's optimizer keeps its
    parameter groups, defaults and state (what DP-SGD and the learning-rate
    schedule see); ``extra`` steps the parameters the feature trains on its
    own (FedDPA's local adapter, FedLEASE's router).
    """

    def __init__(self, main: torch.optim.Optimizer, extra: torch.optim.Optimizer):
        self.main, self.extra = main, extra
        self.param_groups = main.param_groups
        self.defaults = main.defaults
        self.state = main.state

    @classmethod
    def beside(
        cls, main: torch.optim.Optimizer, params: Iterable[torch.Tensor]
    ) -> StepTogether:
        """``main`` stepped with an AdamW over ``params`` at ``main``'s first
        group's learning rate and weight decay."""
        group = main.param_groups[0]
        extra = torch.optim.AdamW(
            list(params),
            lr=float(group["lr"]),
            weight_decay=float(group.get("weight_decay", 0.0)),
        )
        return cls(main, extra)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.main.zero_grad(set_to_none=set_to_none)
        self.extra.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        self.main.step()
        self.extra.step()


class RoundJob(Protocol):
    """What a feature sees of the round (:class:`fedlr.client.round.ClientRound`)."""

    model: torch.nn.Module
    adapted: AdaptedModel
    message: Message
    context: Context
    config: ConfigRecord
    train_roles: tuple[Role, ...]
    keep_roles: tuple[Role, ...]
    personal_loaded: bool
    base_version: int | None
    pruning: RankPruning | None

    @property
    def is_train(self) -> bool: ...

    @property
    def personal_split(self) -> bool: ...

    @property
    def has_penalty(self) -> bool: ...

    def penalty(self) -> torch.Tensor: ...

    def parameters(self) -> list[torch.nn.Parameter]: ...


class ClientFeature:
    """One method's client behaviour in one round (see the module docstring).

    Class attributes
    ----------------
    keys : tuple of Bound or str
        The instruction's ConfigRecord keys the feature reads, each with what
        a node accepts (:class:`~fedlr.client.checks.Bound`); defining
        the class registers them with every node's instruction check. A plain
        ``str`` is a key the feature checks itself when it builds its
        settings (DP-SGD's). A key of the common round
        (:data:`fedlr.client.checks.BOUNDS`: ``leading-rank``,
        ``keep-roles``...) is read, not declared.
    node_state : tuple of Record
        What the feature keeps in the node's ``context.state``.
    receives, sends : tuple of Record
        The extra records of an instruction it reads, and of a reply it adds
        (:meth:`reply_records`): beside ``arrays``, on the wire. Each
        received record declares what it must hold (:attr:`Record.expects`),
        checked before training (:func:`check_received`).
    metrics : tuple of Record
        The reply metrics it writes (a user's metrics may not reuse them).
    loss_reads_data : bool
        Whether its :meth:`loss` term reads the node's training data (default
        ``True``, the safe assumption). A term that does not (FedProx's
        proximal term: a function of the parameters and the global ones) is
        added by DP-SGD after the per-example clipping and noise, which
        covers the data; one that does is refused with DP-SGD.
    order : int
        Where the feature runs among the round's active features (lower
        first); the order of loss terms and array transforms is part of a
        method's result, so it is fixed here, not by import order.
    """

    keys: ClassVar[tuple[Bound | str, ...]] = ()
    node_state: ClassVar[tuple[Record, ...]] = ()
    receives: ClassVar[tuple[Record, ...]] = ()
    sends: ClassVar[tuple[Record, ...]] = ()
    metrics: ClassVar[tuple[Record, ...]] = ()
    loss_reads_data: ClassVar[bool] = True
    order: ClassVar[int] = 100

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Register the class's own ``keys`` with the node's instruction check."""
        super().__init_subclass__(**kwargs)
        if "keys" in vars(cls):
            declare_bounds(f"{cls.__module__}.{cls.__qualname__}", cls.keys)
        unchecked = [r.name for r in vars(cls).get("receives", ()) if r.expects is None]
        if unchecked:
            raise TypeError(
                f"{cls.__qualname__} receives {unchecked} without declaring what "
                "they hold: give each Record an `expects` rule"
            )

    @classmethod
    def _overrides(cls, *hooks: str) -> bool:
        """Whether the class overrides any of the ``hooks`` (method names)."""
        return any(getattr(cls, h) is not getattr(ClientFeature, h) for h in hooks)

    @classmethod
    def adds_loss(cls) -> bool:
        """Whether the feature may add a loss term (it overrides :meth:`loss`)."""
        return cls._overrides("loss")

    @classmethod
    def changes_gradients(cls) -> bool:
        """Whether the feature transforms gradients or the optimizer step, or
        runs the loop (:meth:`after_backward`, :meth:`wrap_optimizer`,
        :meth:`loop`)."""
        return cls._overrides("after_backward", "wrap_optimizer", "loop")

    @classmethod
    def training_change(cls, options: Any) -> str | None:
        """What the feature adds to local training under the method's
        options (a loss term, a gradient transform), in words, or ``None``.

        Read at configuration time (:func:`fedlr.strategies.refusals.check_privacy`):
        sample-level DP-SGD clips each example's gradient of the loss alone;
        it adds a loss term's gradient after the clipping and noise when the
        term does not read the data (:attr:`loss_reads_data`), and refuses a
        change that reads the data or transforms the gradients.
        """
        return None

    @classmethod
    def for_round(cls, job: RoundJob) -> Self | None:
        """This round's instance of the feature, or ``None`` when it is off.

        Called after the model was conformed and the roles decoded, before
        the arrays are loaded. Raise :class:`~fedlr.errors.ProtocolError` for
        an instruction value the feature cannot accept.
        """
        raise NotImplementedError

    def load(
        self,
        job: RoundJob,
        received: dict[str, torch.Tensor],
        state: dict[str, torch.Tensor],
    ) -> None:
        """Edit ``state`` (what the model is about to load) in place.

        ``received`` is the instruction's arrays as sent (before a
        heterogeneous-rank cut).
        """

    def loss(self, job: RoundJob) -> Callable[[], torch.Tensor] | None:
        """A term added to every training step's loss (after roles are set).

        Declare :attr:`loss_reads_data` ``False`` when the term is a function
        of the parameters and of what the node received or kept, not of its
        training data (then DP-SGD can serve the method).
        """
        return None

    def train_also(self, job: RoundJob) -> list[torch.nn.Parameter]:
        """Parameters this training round also trains beyond ``train-roles``,
        made trainable after the roles are set (so the round's optimizer gets
        them) and never sent back (RAVAN's ``B``, whose steps its feature maps
        to the cores it sends). Default: none."""
        return []

    def after_backward(self, job: RoundJob) -> None:
        """Transform the trained parameters' ``.grad`` after each ``backward``."""

    def wrap_optimizer(
        self, job: RoundJob, optimizer: torch.optim.Optimizer
    ) -> torch.optim.Optimizer:
        """The optimizer to step with (default: ``optimizer`` itself)."""
        return optimizer

    def loop(self, job: RoundJob) -> LoopControl | None:
        """The control of the training loop, if the feature runs it (at most
        one active feature may)."""
        return None

    def reply_arrays(
        self, job: RoundJob, trained: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The arrays to send back (and keep), from the trained ones."""
        return trained

    def reply_records(
        self,
        job: RoundJob,
        trained: dict[str, torch.Tensor],
        metrics: dict[str, MetricRecordValues],
        content: RecordDict,
    ) -> None:
        """Add reply metrics to ``metrics`` and extra records to ``content``."""

    @property
    def trains(self) -> bool:
        """Whether the feature acts during training (a loss term excluded)."""
        return self._overrides("after_backward", "wrap_optimizer")


def check_received(features: Iterable[type[ClientFeature]], incoming: Incoming) -> None:
    """Check every record the ``features`` declare they receive, before the
    node acts on the instruction (:func:`fedlr.client.checks.check_records`).

    Raises
    ------
    FeatureRecordError
        Naming the record and the array refused.
    """
    rules = [(r.name, r.expects) for f in features for r in f.receives if r.expects]
    check_records(incoming, rules)


_COMMON: dict[str, type[ClientFeature]] = {}
_F = TypeVar("_F", bound=type[ClientFeature])


def common_feature(cls: _F) -> _F:
    """Class decorator: every node asks ``cls``, whatever the method.

    For a feature that is not one method's but any method's, switched on by
    its instruction keys (DP-SGD's ``dp-max-grad-norm``). Registering the same
    class twice is a no-op.

    Raises
    ------
    TypeError
        If ``cls`` is not a :class:`ClientFeature` subclass.
    """
    if not (isinstance(cls, type) and issubclass(cls, ClientFeature)):
        raise TypeError(f"{cls!r} is not a ClientFeature subclass")
    _COMMON[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return cls


def common_features() -> list[type[ClientFeature]]:
    """The features registered with :func:`common_feature`."""
    return list(_COMMON.values())


def ordered(features: Iterable[type[ClientFeature]]) -> list[type[ClientFeature]]:
    """Distinct feature classes by ``order``, then qualified name."""
    unique = {f"{cls.__module__}.{cls.__qualname__}": cls for cls in features}
    return sorted(
        unique.values(), key=lambda c: (c.order, c.__module__, c.__qualname__)
    )
