"""Client helpers for plug-in users: apply a fedlr round to your own model.

A Flower user who writes their own ``ClientApp`` and drives a fedlr strategy
with Flower's ``strategy.start()`` hands each incoming message and their own
adapted model to :func:`apply_round`, trains as they like, and answers with
:meth:`ClientRound.reply`::

    @app.train()
    def train(message: Message, context: Context) -> Message:
        job = apply_round(build_model(), message, context)
        optimizer = torch.optim.SGD(job.parameters(), lr=job.lr)
        ...  # your loop: add job.penalty() to the loss, call
        ...  # job.after_backward() after each backward()
        return job.reply(num_examples=n, metrics={"train-loss": loss})

The model is a peft ``PeftModel`` with LoRA (``get_peft_model`` with a
``LoraConfig``) or VeRA (``VeraConfig``), or fedlr's SORF-VeRA model
(:func:`~fedlr.adapters.build_sorf_vera_model`). Build it from a fixed seed:
methods that never send a frozen factor (FFA-LoRA's ``A``) rely on every node
holding the same one.

What :func:`apply_round` does with the instruction (:mod:`fedlr.wire.protocol`).
The common round is here; what one method adds is a client feature
(:class:`fedlr.client.features.ClientFeature`) in that method's module, switched on
by the instruction's keys (the method named after each item below):

* **rank and scaling** (LoRA): rebuilds the adapter at the round's
  ``lora-rank`` (FedSpec grows it) and sets every layer's scaling to
  ``lora-alpha / r``, the scaling the server aggregated for; a model built
  with another alpha is corrected, with a warning naming the layer;
* **projections** (VeRA family): checks that the model's projection seed and
  rank are the ``projection-seed`` and ``projection-rank`` every node uses
  (else :class:`~fedlr.errors.ProjectionMismatchError`);
* **fingerprint** (strategies made by ``for_model``): checks that the
  model's frozen base weights and never-sent factors, as built, are the
  server's (``base-fingerprint``, :mod:`fedlr.wire.fingerprint`; else
  :class:`~fedlr.errors.BaseMismatchError`, naming the layer);
* **arrays**: loads the ArrayRecord ``arrays`` over the model's initial
  values, then the node's personal arrays: an ArrayRecord ``personal`` in the
  instruction (Global SVD), kept in ``context.state``, or the ``keep-roles``
  a previous round left there (FedSA-LoRA, Local SVD);
* **base weights** (FedEx-LoRA, VeRA-FedEx): dense base weights in
  ``arrays`` are kept in ``context.state`` with their ``base-version``; an
  instruction without them brings the kept ones up to date with its
  ``base-delta`` changes and checks them against ``base-check``
  (:func:`fedlr.wire.downlink.receive_base`; a node that cannot raises
  :class:`~fedlr.errors.BaseOutOfSyncError` and is sent dense weights next
  time);
* **heterogeneous ranks** (``leading-rank``: FlexLoRA, HetLoRA, FLoRA, FedSpec
  with ``client-ranks``):
  the model keeps its own rank ``r``; wider global ``A``, ``B`` are cut to
  their leading ``r`` components, scaled by ``sqrt(r / R)``; with
  ``fold-tail`` (FedEx-LoRA with ``client-ranks``) the cut components are
  added to the base weights used this round (the kept copy stays the
  server's, :func:`fedlr.adapters.ranks.fold_tail`);
* **rank self-pruning** (``prune-gamma`` < 1 with ``leading-rank``: HetLoRA
  with ``hetlora-prune-gamma``): the model of rank ``r`` regularises its tail
  components ``[r', r)``, ``r' = max(1, floor(gamma r))``, with
  ``prune-lambda`` times their norm (:func:`tail_norm`, part of
  :meth:`ClientRound.penalty`); if that norm went down during training,
  :meth:`ClientRound.reply` answers at rank ``r'`` (the leading components,
  rescaled) and the node keeps rank ``r'`` in ``context.state`` from then
  on: later rounds conform the model to it (a model that serves several
  nodes is given each node's own rank: pass ``rank=``);
* **what trains**: freezes every parameter except those of ``train-roles``
  and ``keep-roles`` (:meth:`ClientRound.parameters`); FedProx's
  ``proximal-mu`` and the pruning term become :meth:`ClientRound.penalty`
  (under DP-SGD, terms that read no data are added after its clipping and
  noise, :meth:`ClientRound.loop_control`).

The round's LoRA rank (the instruction's ``lora-rank``, the rank the node
pruned itself to, or its own) is decided once, by
:func:`fedlr.client.pruning.round_rank`, when the instruction is checked; the model
is conformed to that rank. The instruction check covers the common round's
keys and every client feature's declared keys
(:attr:`fedlr.client.features.ClientFeature.keys`): the features are loaded first.

:meth:`ClientRound.reply` builds the reply: exactly the arrays of
``train-roles`` (Local SVD's ``client-svd``: re-factored as balanced singular
factors first), the ``keep-roles`` stored in ``context.state`` (and FedSA's
``personal-gram``, ``B^T B`` per layer, as an extra record), and one
MetricRecord with ``num-examples``, the user's metrics unchanged, and the
protocol's own (``partition-id``, ``personal-loaded``, VeRA's
``projection-seed`` and ``projection-rank``, FedEx's ``base-held``, HetLoRA's
``rank-pruned``). For an
``evaluate`` message the reply is one MetricRecord: ``num-examples`` and the
user's metrics.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import reduce
from logging import INFO, WARNING, getLogger
from typing import cast

import torch
from flwr.app import (
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    MetricRecordValues,
    RecordDict,
)

from fedlr.adapters.lora import LoraModel
from fedlr.adapters.plugin import LoraLayerChange, adapted, conform_lora, initial_state
from fedlr.adapters.ranks import leading_rank
from fedlr.adapters.roles import AdaptedModel, AdapterLayout, Role, RoleLayout
from fedlr.adapters.sorf_vera import SorfVeraLayout
from fedlr.adapters.vera import VeraLayout, check_projection
from fedlr.client.checks import check_model_instruction
from fedlr.client.features import ClientFeature, Incoming, check_received
from fedlr.client.method_features import client_features
from fedlr.client.pruning import RankPruning, RoundRank, keep_rank, tail_norm
from fedlr.client.train import LoopControl
from fedlr.errors import ProtocolError
from fedlr.flower.records import (
    config_float,
    config_int,
    config_record,
    state_to_record,
)
from fedlr.wire import protocol
from fedlr.wire.fingerprint import check_instruction

__all__ = ["ClientRound", "RankPruning", "apply_round", "tail_norm"]

_LOG = getLogger("fedlr")

_DEFAULT_ROLES: dict[type[RoleLayout], tuple[Role, ...]] = {
    AdapterLayout: (Role.LORA_A, Role.LORA_B, Role.HEAD),
    VeraLayout: (Role.VERA_LAMBDA_B, Role.VERA_LAMBDA_D, Role.HEAD),
    SorfVeraLayout: (Role.SORF_D_SCALE, Role.SORF_D_ANGLES, Role.HEAD),
}
"""``train-roles`` when an instruction does not say (not a fedlr strategy)."""

_RESERVED = (
    protocol.NUM_EXAMPLES,
    protocol.PARTITION_ID,
    protocol.PROJECTION_SEED,
    protocol.PROJECTION_RANK,
)
"""Reply metrics the common round writes; with the client features' declared
metrics (:func:`reserved_metrics`), what a user's metrics may not carry."""


def reserved_metrics() -> tuple[str, ...]:
    """Reply metrics fedlr's helpers write: the common round's and every
    client feature's (:attr:`fedlr.client.features.ClientFeature.metrics`)."""
    declared = (m.name for f in client_features() for m in f.metrics)
    return tuple(dict.fromkeys((*_RESERVED, *declared)))


@dataclass(kw_only=True)
class ClientRound:
    """One instruction applied to a user's model (see :func:`apply_round`).

    Attributes
    ----------
    model : torch.nn.Module
        The module to train or evaluate (the peft model, or the SORF-VeRA
        wrapped module), with this round's arrays loaded.
    adapted : AdaptedModel
        The same model seen through its declared roles.
    message : flwr.app.Message
        The instruction.
    context : flwr.app.Context
        The node's context (``context.state`` keeps personal arrays).
    config : flwr.app.ConfigRecord
        The round's ConfigRecord: your ``train_config`` (``lr`` ...) plus the
        strategy's keys.
    train_roles, keep_roles : tuple of Role
        What trains and is sent back, and what trains but stays on the node.
    personal_loaded : bool
        Whether personal arrays (kept or received) were loaded.
    changes : tuple of LoraLayerChange
        LoRA layers rebuilt at another rank or given another scaling.
    base_version : int or None
        The version of the base weights loaded (FedEx methods), kept in
        ``context.state``; ``None`` when the strategy does not version them.
    pruning : RankPruning or None
        The round's rank self-pruning (a ``train`` instruction with
        ``prune-gamma`` < 1), else ``None``.
    features : tuple of ClientFeature
        The methods' client features this instruction switched on
        (:mod:`fedlr.client.features`), in the order they run.
    """

    model: torch.nn.Module
    adapted: AdaptedModel
    message: Message
    context: Context
    config: ConfigRecord
    train_roles: tuple[Role, ...]
    keep_roles: tuple[Role, ...]
    personal_loaded: bool = False
    changes: tuple[LoraLayerChange, ...] = ()
    base_version: int | None = None
    pruning: RankPruning | None = None
    features: tuple[ClientFeature, ...] = ()
    _penalty: Callable[[], torch.Tensor] | None = field(default=None, repr=False)
    _loss_features: tuple[ClientFeature, ...] = field(default=(), repr=False)

    # ------------------------------------------------------------ the round
    @property
    def is_train(self) -> bool:
        """Whether the instruction is a ``train`` message (else ``evaluate``)."""
        return _is_train(self.message)

    @property
    def server_round(self) -> int:
        """``server-round`` of the ConfigRecord (0 if absent)."""
        return config_int(self.config, protocol.SERVER_ROUND, 0)

    @property
    def lr(self) -> float:
        """``lr`` of the ConfigRecord (your ``train_config``, decayed per round).

        Raises
        ------
        RecordMissingError
            If the ConfigRecord has no ``lr``.
        """
        return config_float(self.config, protocol.LR)

    @property
    def personal_split(self) -> bool:
        """Personalised methods ask to train and evaluate on the node's own
        train and held-out parts (``personal-split``)."""
        return bool(self.config.get(protocol.PERSONAL_SPLIT, False))

    def parameters(self) -> list[torch.nn.Parameter]:
        """The parameters this round trains (give these to your optimizer)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    @property
    def has_penalty(self) -> bool:
        """Whether :meth:`penalty` is more than a constant zero this round."""
        return self._penalty is not None

    def penalty(self) -> torch.Tensor:
        """A term to add to your training loss.

        The sum of the active features' loss terms: FedProx's proximal term
        ``(mu / 2) sum_p ||p - p_0||^2`` over the trained parameters, ``p_0``
        their values as received, when the strategy sends ``proximal-mu`` > 0;
        HetLoRA's pruning term ``lambda * tail_norm`` (:class:`RankPruning`,
        :func:`tail_norm`) when it sends ``prune-gamma`` < 1 and
        ``prune-lambda`` > 0; otherwise zero. A scalar tensor on the
        parameters' device.
        """
        if self._penalty is None:
            return torch.zeros(())
        return self._penalty()

    @property
    def has_gradient_hooks(self) -> bool:
        """Whether :meth:`after_backward` or :meth:`optimizer` do anything."""
        return any(f.trains for f in self.features)

    def after_backward(self) -> None:
        """Call after each ``loss.backward()``, before ``optimizer.step()``.

        Applies the active features' gradient transforms to the trained
        parameters' ``.grad`` (SCAFFOLD-LoRA's control-variate correction);
        a no-op when none is active.
        """
        for feature in self.features:
            feature.after_backward(self)

    def loop_control(self) -> LoopControl | None:
        """The active feature that runs the training loop (DP-SGD), if any.

        Pass it to :func:`fedlr.client.train.train_steps` (``control=``). The
        round's loss terms that read no data (FedProx's proximal term,
        HetLoRA's tail regulariser; :attr:`ClientFeature.loss_reads_data
        <fedlr.client.features.ClientFeature.loss_reads_data>` ``False``) go with
        it: DP-SGD adds their gradient after its clipping and noise.

        Raises
        ------
        ProtocolError
            If two features would run the loop, or the one that does is
            combined with a gradient transform (SCAFFOLD) or a loss term that
            reads the data, whose gradients its per-example clipping would
            not see.
        """
        controls = [(f, c) for f in self.features if (c := f.loop(self)) is not None]
        if not controls:
            return None
        runs = {id(f) for f, _ in controls}
        clash = [type(f).__name__ for f, _ in controls[1:]] + [
            type(f).__name__ for f in self.features if id(f) not in runs and f.trains
        ]
        reads = [type(f).__name__ for f in self._loss_features if f.loss_reads_data]
        if clash or reads:
            what = clash or f"{reads} (a loss term that reads the data)"
            raise ProtocolError(
                f"{type(controls[0][0]).__name__} runs the training loop "
                "(per-example clipping and noise) and cannot be combined with "
                f"{what} this round (its clipping would not see "
                "their gradients); switch one of them off"
            )
        return controls[0][1]

    def optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer to step with: ``optimizer`` as the features wrap it."""
        for feature in self.features:
            optimizer = feature.wrap_optimizer(self, optimizer)
        return optimizer

    # ------------------------------------------------------------ the reply
    def reply(
        self,
        *,
        num_examples: int,
        metrics: Mapping[str, MetricRecordValues] | None = None,
    ) -> Message:
        """The reply to the instruction.

        Parameters
        ----------
        num_examples : int
            The node's weight in the aggregation: a positive integer (the
            examples it trained or evaluated on).
        metrics : mapping of str to int, float or list, optional
            Your own metrics (``train-loss`` for training; ``accuracy`` and
            ``loss`` for evaluation, which personalised methods average),
            passed through unchanged.

        Returns
        -------
        flwr.app.Message
            ``train``: ArrayRecord ``arrays`` (exactly the ``train-roles``, as
            the active features transform them: pruned, re-factored), the
            features' extra records, MetricRecord ``metrics``; ``evaluate``:
            MetricRecord ``metrics`` only.

        Raises
        ------
        ProtocolError
            If ``num_examples`` is not a positive integer or ``metrics`` uses
            a key the helpers write (``num-examples``, ``partition-id``, ...).
        """
        if (
            isinstance(num_examples, bool)
            or not isinstance(num_examples, numbers.Integral)
            or int(num_examples) < 1
        ):
            raise ProtocolError(
                f"num_examples must be a positive integer, got {num_examples!r}"
            )
        user = dict(metrics or {})
        clash = sorted(set(user) & set(reserved_metrics()))
        if clash:
            raise ProtocolError(
                f"metrics {clash} are written by fedlr.client.round; pass "
                "num_examples= and leave the others out"
            )
        values: dict[str, MetricRecordValues] = {
            protocol.NUM_EXAMPLES: int(num_examples),
            **user,
        }
        if not self.is_train:
            content = RecordDict({protocol.METRICS: MetricRecord(values)})
            return Message(content, reply_to=self.message)
        node = self.context.node_config
        if protocol.PARTITION_ID in node:  # orders the updates on the server
            values[protocol.PARTITION_ID] = int(node[protocol.PARTITION_ID])
        layout = self.adapted.layout
        if isinstance(layout, (VeraLayout, SorfVeraLayout)):
            values[protocol.PROJECTION_SEED] = int(layout.projection_seed)
            values[protocol.PROJECTION_RANK] = int(layout.rank)
        trained = self.adapted.state(self.train_roles + self.keep_roles)
        for feature in self.features:
            trained = feature.reply_arrays(self, trained)
        content = RecordDict(
            {protocol.ARRAYS: state_to_record(trained, layout.keys(*self.train_roles))}
        )
        for feature in self.features:
            feature.reply_records(self, trained, values, content)
        content[protocol.METRICS] = MetricRecord(values)
        return Message(content, reply_to=self.message)


def apply_round(
    model: torch.nn.Module | AdaptedModel,
    message: Message,
    context: Context,
    *,
    rank: int | None = None,
) -> ClientRound:
    """Apply a fedlr strategy's instruction to ``model``, in place.

    The common round: conform the rank and scaling, check the projections,
    decode the roles and the arrays, then let the active client features
    (:mod:`fedlr.client.features`) edit what is loaded, load it, set what trains and
    collect the features' loss terms.

    Parameters
    ----------
    model : peft.PeftModel or AdaptedModel
        Your LoRA or VeRA peft model, or fedlr's SORF-VeRA model. Built from a
        fixed seed, the same way on every node and on the server.
    message : flwr.app.Message
        A ``train`` or ``evaluate`` instruction from a fedlr strategy.
    context : flwr.app.Context
        The node's context; ``context.state`` keeps the node's personal
        arrays (and a self-pruned rank) across rounds.
    rank : int, optional
        Heterogeneous ranks: the node's own LoRA rank, when ``model`` may
        come at another (a model that serves several nodes, whose rank an
        earlier node's pruning changed). The model is conformed to the rank
        the node pruned itself to, if any, else to ``rank``; a ``lora-rank``
        in the instruction wins over both. Default: the model's rank.

    Returns
    -------
    ClientRound
        The loaded model, what to train, and :meth:`ClientRound.reply`.

    Raises
    ------
    InstructionError
        Before anything changes, naming the key: a ConfigRecord value or an
        array outside what the node accepts (:mod:`fedlr.client.checks`).
    UnsupportedModelError
        If ``model`` is not a LoRA or VeRA peft model or an AdaptedModel.
    ProjectionMismatchError
        If a VeRA-family model was built from another projection seed or rank
        than the server's.
    BaseMismatchError
        If the model's frozen weights, as built, differ from the server's
        model's (another seed or checkpoint; the instruction's
        ``base-fingerprint``).
    ProtocolError
        If the ConfigRecord names roles the model does not have, a
        ``lora-rank`` / ``lora-alpha`` that is not positive, a
        ``prune-gamma`` outside (0, 1] or a negative ``prune-lambda``, or
        pruning for a model that is not LoRA with one rank on every layer.
    BaseOutOfSyncError
        If the instruction sends base-weight changes this node cannot apply
        (its kept base weights are lost, too old, or drifted).
    UnknownKeyError, ShapeMismatchError
        If the received arrays do not fit the model (another architecture, or
        another rank where the strategy does not send ``lora-rank``).
    RecordMissingError, RecordTypeError
        If the message has no ArrayRecord ``arrays`` or a mistyped record.
    """
    content = message.content
    config = (
        config_record(content, protocol.CONFIG)
        if protocol.CONFIG in content
        else ConfigRecord()
    )
    if rank is not None and rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    # The methods' features first: the check covers the keys they declare.
    features = client_features()
    # Everything the node acts on is checked before anything changes; the
    # check decides the round's LoRA rank (fedlr.client.pruning.round_rank).
    checked = check_model_instruction(
        model, content, config, context.node_config, rank=rank, state=context.state
    )
    default = _DEFAULT_ROLES.get(type(checked.layout), ())
    roles = protocol.decode_roles(config, protocol.TRAIN_ROLES, default)
    incoming = Incoming(
        checked.layout, content, config, context.state, _is_train(message), roles
    )
    check_received(features, incoming)  # the features' extra records
    leading = bool(config.get(protocol.LEADING_RANK, False))
    view, changes = _conform_model(model, context, config, checked.rank)
    _check_projection(view.layout, config)
    keep = protocol.decode_roles(config, protocol.KEEP_ROLES)
    _check_roles(view.layout, roles + keep)
    job = ClientRound(
        model=view.model,
        adapted=view,
        message=message,
        context=context,
        config=config,
        train_roles=roles,
        keep_roles=keep,
        changes=tuple(changes),
    )
    active = (feature.for_round(job) for feature in features)
    job.features = tuple(f for f in active if f is not None)
    check_instruction(view, config)  # built like the server's model (fingerprint)
    _load_arrays(job, checked.arrays, leading)
    for param in view.model.parameters():
        param.requires_grad_(False)
    if job.is_train:
        _set_training(job)
    return job


def _load_arrays(
    job: ClientRound, received: dict[str, torch.Tensor], leading: bool
) -> None:
    """Load the instruction's arrays over the model's initial values (cut to
    the leading rank where the instruction says), as the features edit them."""
    view = job.adapted
    state = initial_state(view)
    loaded = received
    if leading and isinstance(view, LoraModel):
        loaded = leading_rank(view.layout, received)
    view.layout.check_shapes({k: v.shape for k, v in loaded.items()})
    state.update(loaded)
    for feature in job.features:
        feature.load(job, received, state)
    view.load(state)


def _set_training(job: ClientRound) -> None:
    """Unfreeze what the round trains and collect the features' loss terms."""
    job.adapted.train_only(job.train_roles + job.keep_roles)
    for feature in job.features:
        for param in feature.train_also(job):
            param.requires_grad_(True)
    terms = [(f, term) for f in job.features if (term := f.loss(job)) is not None]
    job._loss_features = tuple(f for f, _ in terms)
    if terms:  # one term from several, added in the features' order
        job._penalty = lambda: reduce(operator.add, (term() for _, term in terms))


def _conform_model(
    model: torch.nn.Module | AdaptedModel,
    context: Context,
    config: ConfigRecord,
    decided: RoundRank | None,
) -> tuple[AdaptedModel, list[LoraLayerChange]]:
    """The model seen by role, LoRA layers at the round's rank (``decided``,
    from the check) and scaling."""
    view = adapted(model)
    if not isinstance(view, LoraModel) or decided is None:
        return view, []
    # A fresh view: a model that serves many nodes (a Ray actor) may have
    # been given another rank by an earlier round than its stored layout.
    view = cast(LoraModel, adapted(view.model))
    if decided.adopted and decided.rank is not None:
        _LOG.log(
            INFO,
            "node %s: the server sends rank %d, below the node's %d: it "
            "knows the node at a pruned rank; training at rank %d",
            context.node_id,
            decided.rank,
            decided.instead,
            decided.rank,
        )
        keep_rank(context, decided.rank)
    changes = _conform(view, config, decided.rank)
    if changes:
        view = cast(LoraModel, adapted(view.model))  # the layout follows the rank
    return view, changes


def _is_train(message: Message) -> bool:
    """``train`` or ``train.<action>`` (Flower's named train functions)."""
    kind = message.metadata.message_type.partition(".")[0]
    return kind == MessageType.TRAIN


def _conform(
    view: LoraModel, config: ConfigRecord, rank: int | None
) -> list[LoraLayerChange]:
    """Rank ``rank`` (the round's, :func:`fedlr.client.pruning.round_rank`; ``None``:
    each layer keeps its own) and scaling ``lora-alpha / r`` on every LoRA
    layer."""
    alpha: float | None = None
    if protocol.LORA_ALPHA in config:
        alpha = config_float(config, protocol.LORA_ALPHA)
        if not (math.isfinite(alpha) and alpha > 0):
            raise ProtocolError(f"'{protocol.LORA_ALPHA}' must be > 0, got {alpha}")
    targets: dict[str, tuple[int, float]] = {}
    for m in view.layout.modules:
        r = m.rank if rank is None else rank
        # Without lora-alpha, a layer keeps its own alpha (scaling * r).
        scaling = alpha / r if alpha is not None else m.scaling * m.rank / r
        targets[m.name] = (r, scaling)
    changes = conform_lora(view.model, targets)
    for change in changes:
        if change.alpha_changed:
            _LOG.log(
                WARNING,
                "%s: the model's LoRA alpha differs from the server's "
                "lora-alpha; using the server's scaling so that the model is "
                "the global one",
                change,
            )
    return changes


def _check_projection(layout: RoleLayout, config: ConfigRecord) -> None:
    """VeRA family: the model's projection seed and rank are the server's."""
    if not isinstance(layout, (VeraLayout, SorfVeraLayout)):
        return
    seed, rank = int(layout.projection_seed), int(layout.rank)
    check_projection(
        seed,
        rank,
        config_int(config, protocol.PROJECTION_SEED, seed),
        config_int(config, protocol.PROJECTION_RANK, rank),
    )


def _check_roles(layout: RoleLayout, roles: tuple[Role, ...]) -> None:
    """Every adapter role asked for exists in the model (the head may not)."""
    present = {role for role, _, _ in layout.entries()}
    absent = [r.value for r in roles if r is not Role.HEAD and r not in present]
    if absent:
        have = sorted({r.value for r in present})
        raise ProtocolError(
            f"the strategy asks to train {absent}, which this model "
            f"({type(layout).__name__}) does not have (its roles: {have}); build "
            "the model of the strategy's family (LoRA, VeRA or SORF-VeRA)"
        )
