"""Shared base of the LoRA strategies: declared roles, means, Frobenius gap."""

from __future__ import annotations

from collections.abc import Mapping
from logging import INFO, WARNING
from typing import Any, ClassVar, Self

import torch
from flwr.app import ArrayRecord
from flwr.supercore import log

from fedlr.adapters.lora import LoraModel
from fedlr.adapters.plugin import adapted, check_layout, conform_lora, load_from_initial
from fedlr.adapters.roles import AdaptedModel, AdapterLayout, Role
from fedlr.client.features import RoundJob
from fedlr.config.run import RunConfig
from fedlr.errors import ConfigError, ProtocolError, UnsupportedModelError
from fedlr.flower.records import record_to_state, state_to_record
from fedlr.linalg import (
    DEFAULT_COST_MODEL,
    FACTORED,
    StackedResidual,
    StreamedResidual,
    check_factors,
    gap_summary,
    stacked_residual,
)
from fedlr.options import Options
from fedlr.robust.spaces import (
    AGGREGATION_SPACES,
    FACTORS,
    ParameterSpace,
    ProductSpace,
    SumSpace,
    UpdateSpace,
)
from fedlr.round.describe import app_arguments
from fedlr.round.instructions import check_bound_model, fingerprint_model
from fedlr.round.replies import Replies
from fedlr.strategies.base import ClientUpdate, FedLRStrategy, RoundReport
from fedlr.wire import protocol

__all__ = ["LoraStrategy", "lora_model"]


class LoraReplies(Replies):
    """LoraStrategy's reply step (:class:`~fedlr.round.replies.Replies`)."""

    method: LoraStrategy

    def space(self, current: Mapping[str, torch.Tensor]) -> UpdateSpace:
        """The method's declared space (:attr:`LoraStrategy.aggregation_space`).

        ``factors``: the change of every array sent, ``A`` and ``B`` apart
        (:class:`~fedlr.robust.spaces.ParameterSpace`), and, for a method
        that folds the mean of the products into the base weights
        (``folds_base``: FedEx-LoRA), the product change too (their direct
        sum, :class:`~fedlr.robust.spaces.SumSpace`). ``product``: each
        adapted layer's product change ``B_i A_i - B A``, from the factors; a
        factor the client does not send is the global one, the head's change
        is measured as parameters.
        """
        product = ProductSpace(
            current, [(m.a_key, m.b_key) for m in self.method.layout.modules]
        )
        if aggregation_space(self.method) != FACTORS:
            return product
        factors = ParameterSpace(current)
        return SumSpace([factors, product]) if self.method.folds_base else factors


def aggregation_space(method: object) -> str:
    """The ``aggregation_space`` a LoRA strategy declares, checked.

    Raises
    ------
    TypeError
        If it is none of :data:`~fedlr.robust.spaces.AGGREGATION_SPACES`.
    """
    space = getattr(method, "aggregation_space", None)
    if space not in AGGREGATION_SPACES:
        raise TypeError(
            f"{type(method).__name__}.aggregation_space must be one of "
            f"{list(AGGREGATION_SPACES)}, got {space!r}"
        )
    return str(space)


class LoraStrategy(FedLRStrategy):
    """A strategy over LoRA adapters described by an :class:`AdapterLayout`.

    Class attributes declare the protocol: ``send_roles`` are the roles of the
    global arrays sent to clients, ``train_roles`` those clients train and send
    back (told to the ClientApp as ``train-roles`` in the ConfigRecord).

    Parameters
    ----------
    layout : AdapterLayout
        Roles, keys, shapes and scalings of the adapted model.
    **kwargs
        Other parameters: see :class:`~fedlr.strategies.base.FedLRStrategy`.
    """

    replies_type: ClassVar[type[Replies]] = LoraReplies

    aggregation_space: ClassVar[str] = FACTORS
    """Where the method's aggregation works, so where the screen, the robust
    rules and the server-update clip measure a reply
    (:data:`~fedlr.robust.spaces.AGGREGATION_SPACES`): ``factors`` (the
    default, and every method that combines ``A`` and ``B`` apart: a
    rebalanced pair ``(c A, B / c)`` is a large factor change) or ``product``
    (a method whose aggregate depends on a client's factors only through
    ``B_i A_i``)."""

    send_roles: ClassVar[tuple[Role, ...]] = (Role.LORA_A, Role.LORA_B, Role.HEAD)
    train_roles: ClassVar[tuple[Role, ...]] = (Role.LORA_A, Role.LORA_B, Role.HEAD)

    def __init__(self, *, layout: AdapterLayout, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.layout = layout

    @classmethod
    def from_run_config(
        cls, config: RunConfig, layout: AdapterLayout, options: Options | None = None
    ) -> Self:
        """Build from the run config's common keys and the method's options.

        Parameters
        ----------
        config : RunConfig
        layout : AdapterLayout
        options : Options, optional
            The method's registered options (:attr:`options_type`), passed
            on as ``options=``; ``None``: their defaults.

        Always builds ``cls``; which class a run with ``client-ranks`` builds
        is the registry's choice (:meth:`MethodSpec.strategy_for
        <fedlr.strategies.registry.MethodSpec.strategy_for>`).

        Raises
        ------
        ConfigError
            For ``client-ranks`` on a class whose heterogeneous-rank rounds
            are another class (:attr:`hetero_variant`).
        """
        variant = cls.hetero_variant
        if config.rank_list and variant is not None and not issubclass(cls, variant):
            raise ConfigError(
                "client-ranks",
                f"{cls.__name__} trains one rank on every client; build "
                f"{variant.__name__} for client-ranks",
            )
        return cls(
            layout=layout,
            options=options,
            **app_arguments(cls, config),
            **cls.strategy_kwargs(config),
        )

    @classmethod
    def strategy_kwargs(cls, config: RunConfig) -> dict[str, Any]:
        """Constructor arguments from the run config's common keys that are
        no option (none here; the seed, ``client-ranks``)."""
        return {}

    def bind_initial(self, state: Mapping[str, torch.Tensor]) -> None:
        """Be told the model's seeded initial A, B and head (the clients' too).

        Called by fedlr's server plan once the model is built; the SVD family
        keeps them (FFA-LoRA's frozen A, the gap reports of methods whose
        clients never send A). Default: nothing to keep.
        """

    def initial_global_state(
        self, state: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The first round's global arrays from the seeded model's ``send_roles``
        tensors (fedlr's server plan and :meth:`initial_arrays`).

        Default: as they are. ILoRA re-initialises ``A``, ``B`` from the base
        weights (QR) and moves the base weights by the same product.
        """
        return dict(state)

    def summary(self) -> None:
        """Log the settings, then FedAvg's."""
        log(
            INFO,
            "\t├──> %s: %d LoRA modules, rank %d, trains %s, sends %s",
            type(self).__name__,
            len(self.layout.modules),
            self.rank,
            [r.value for r in self.train_roles if self.layout.keys(r)],
            [r.value for r in self.send_roles if self.layout.keys(r)],
        )
        super().summary()

    @property
    def rank(self) -> int:
        """Largest LoRA rank in the layout."""
        return max(m.rank for m in self.layout.modules)

    def send_keys(self) -> list[str]:
        """Keys of the global arrays sent to clients (the initial ArrayRecord)."""
        return self.layout.keys(*self.send_roles)

    def reply_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.layout.shapes(*self.train_roles)

    def round_config(self, server_round: int) -> dict[str, Any]:
        config: dict[str, Any] = {
            protocol.TRAIN_ROLES: protocol.encode_roles(self.train_roles)
        }
        alphas = {float(f"{m.scaling * m.rank:.12g}") for m in self.layout.modules}
        # a client's scaling is lora-alpha / r (fedlr.client.round)
        if len(alphas) == 1:
            config[protocol.LORA_ALPHA] = alphas.pop()
        return config

    # ----------------------------------------------------------------- helpers
    def layer_residuals(
        self, updates: list[ClientUpdate]
    ) -> dict[str, StackedResidual | StreamedResidual]:
        """Each layer's FedEx residual ``sum_i w_i B_i A_i - B_bar A_bar``.

        Built once per layer and shared by :meth:`gap_report` and FedEx's fold.
        The cost model (:meth:`fedlr.linalg.CostModel.residual`) keeps the
        stacked factors (:func:`fedlr.linalg.stacked_residual`, exact QR norms)
        while they are cheap, and streams the clients otherwise
        (:class:`fedlr.linalg.StreamedResidual`: in-place fold with exact
        norms, or a flagged Hutch++ estimate when there is no fold).
        """
        weights = [u.weight for u in updates]
        residuals: dict[str, StackedResidual | StreamedResidual] = {}
        for module in self.layout.modules:
            bs = [u.arrays[module.b_key] for u in updates]
            as_ = [u.arrays[module.a_key] for u in updates]
            d_out, rank, d_in = check_factors(bs, as_)
            path = DEFAULT_COST_MODEL.residual(len(bs), rank, d_out, d_in).path
            if path == FACTORED:
                residuals[module.name] = stacked_residual(bs, as_, weights)
            else:
                residuals[module.name] = StreamedResidual(
                    bs, as_, weights, cost=DEFAULT_COST_MODEL
                )
        return residuals

    def gap_report(
        self,
        updates: list[ClientUpdate],
        residuals: Mapping[str, StackedResidual | StreamedResidual] | None = None,
    ) -> RoundReport:
        """Frobenius gap ``||sum_i w_i B_i A_i - B_bar A_bar||_F`` per layer and total.

        The relative gap divides by ``||sum_i w_i B_i A_i||_F``. Both come from
        ``residuals`` (:meth:`layer_residuals`, built here when not given),
        never from a dense product per client. ``gap-estimated`` (1.0 when a
        layer's gap is a randomized estimate, with many clients and no fold)
        and ``gap-error-bound`` (a bound on the relative error of
        ``frobenius-gap``, 0 when exact) say how it was measured
        (:func:`fedlr.linalg.gap_summary`).
        """
        if residuals is None:
            residuals = self.layer_residuals(updates)
        norms = {m.name: residuals[m.name].gap_norms() for m in self.layout.modules}
        return RoundReport.from_layers(
            {name: n.pair for name, n in norms.items()},
            rank=float(self.rank),
            **gap_summary(norms.values()),
        )

    # ------------------------------------------------------ plug-in users
    @classmethod
    def for_model(cls, model: torch.nn.Module | AdaptedModel, **kwargs: Any) -> Self:
        """The strategy for a user's own LoRA model, its layout declared from it.

        Parameters
        ----------
        model : peft.PeftModel or LoraModel
            The server's copy of the model every node builds (LoRA on
            ``nn.Linear`` layers, the head in ``modules_to_save``).
        **kwargs
            The strategy's other parameters.

        Raises
        ------
        UnsupportedModelError
            If ``model`` is not a LoRA model.
        """
        view = _lora_view(model)
        strategy = cls(layout=view.layout, **kwargs)
        strategy.base_fingerprint = fingerprint_model(strategy, view)
        return strategy

    def initial_arrays(self, model: torch.nn.Module | AdaptedModel) -> ArrayRecord:
        """The first round's global arrays: the ``send_roles`` tensors of ``model``.

        Give it to ``strategy.start(initial_arrays=...)``. Keys and shapes are
        the layout's (peft's adapter keys, ``...base_layer.weight`` for the
        base weights FedEx sends); ``ArrayRecord(model.state_dict())`` carries
        every weight under other keys and is refused.

        Raises
        ------
        UnsupportedModelError
            If ``model`` is not a LoRA model.
        ShapeMismatchError
            If ``model`` does not match the strategy's layout.
        """
        view = _lora_view(model)
        check_layout(self.layout, view.layout, self.send_roles, what="the model")
        check_bound_model(self, view, what="the model given to initial_arrays")
        return state_to_record(
            self.initial_global_state(view.state(self.send_roles)), self.send_keys()
        )

    def load_into(
        self,
        model: torch.nn.Module | AdaptedModel,
        arrays: ArrayRecord | Mapping[str, torch.Tensor],
    ) -> None:
        """Load global arrays into ``model`` (e.g. in a server ``evaluate_fn``).

        Every LoRA layer is rebuilt at the rank of the arrays' ``A`` (or
        ``B``) when it differs (FedSpec grows the rank) and given the scaling
        ``alpha / r`` with the strategy's alpha, so the model's update is the
        one the strategy aggregated. Tensors the arrays leave out keep their
        initial values (:func:`fedlr.adapters.plugin.initial_state`).

        Parameters
        ----------
        model : peft.PeftModel or LoraModel
        arrays : ArrayRecord or mapping of str to torch.Tensor
            Global arrays of any round, keyed as the layout.

        Raises
        ------
        UnsupportedModelError
            If ``model`` is not a LoRA model.
        UnknownKeyError, ShapeMismatchError
            If the arrays do not fit the model.
        """
        state = (
            record_to_state(arrays) if isinstance(arrays, ArrayRecord) else dict(arrays)
        )
        view = _lora_view(model)
        targets: dict[str, tuple[int, float]] = {}
        for m in self.layout.modules:
            if m.a_key in state:
                rank = int(state[m.a_key].shape[0])
            elif m.b_key in state:
                rank = int(state[m.b_key].shape[1])
            else:
                rank = m.rank
            targets[m.name] = (rank, m.scaling * m.rank / rank)
        changes = conform_lora(view.model, targets)
        for change in changes:
            if change.alpha_changed:
                log(WARNING, "%s: set to the strategy's LoRA alpha", change)
        if changes:
            view = _lora_view(view.model)
        check_bound_model(self, view, what="the model given to load_into")
        load_from_initial(view, state)


def saved_tensors(
    owner: object,
    state: Mapping[str, Any],
    name: str,
    shapes: Mapping[str, tuple[int, ...]],
    *,
    complete: bool,
) -> dict[str, torch.Tensor] | None:
    """Checked copies of the tensors ``state[name]`` a strategy saved by key.

    ``state`` may hold no other key than ``name``; each tensor must have its
    key's shape in ``shapes`` (with ``complete``, every key of ``shapes``
    must be there). ``None`` when ``state`` has no ``name``.

    Raises
    ------
    ValueError
        Naming the owner's class and what does not fit.
    """
    who = type(owner).__name__
    unknown = sorted(set(state) - {name})
    if unknown:
        raise ValueError(f"{who}: unknown state keys {unknown}")
    saved = state.get(name)
    if saved is None:
        return None
    bad = sorted(k for k, v in saved.items() if shapes.get(k) != tuple(v.shape))
    if bad or (complete and set(saved) != set(shapes)):
        raise ValueError(
            f"{who}: the saved {name} does not fit the layout (keys or shapes: "
            f"{bad or sorted(set(shapes) ^ set(saved))})"
        )
    return {k: v.clone() for k, v in saved.items()}


def lora_model(job: RoundJob, doing: str) -> LoraModel:
    """The round's model as a :class:`LoraModel`, for a client feature that
    needs LoRA layers (``doing``: what its instruction key asks of them).

    Raises
    ------
    ProtocolError
        ``"<doing>; the model has a <layout>"`` for any other model.
    """
    if not isinstance(job.adapted, LoraModel):
        raise ProtocolError(
            f"{doing}; the model has a {type(job.adapted.layout).__name__}"
        )
    return job.adapted


def _lora_view(model: torch.nn.Module | AdaptedModel) -> LoraModel:
    """``model`` as a :class:`LoraModel` (UnsupportedModelError otherwise)."""
    view = adapted(model)
    if not isinstance(view, LoraModel):
        raise UnsupportedModelError(
            f"a LoRA strategy needs a LoRA model, got one with a "
            f"{type(view.layout).__name__}"
        )
    return view
