"""A plug-in user's own adapted model, seen through fedlr's declared roles.

fedlr's client helpers (:mod:`fedlr.client.round`) and the strategies' plug-in
methods (``for_model``, ``initial_arrays``, ``load_into``) take the model a
user built themselves:

* a peft ``PeftModel`` with LoRA (``peft.get_peft_model`` with a
  ``LoraConfig``), seen as a :class:`~fedlr.adapters.lora.LoraModel`;
* a peft ``PeftModel`` with VeRA (``VeraConfig``), seen as a
  :class:`~fedlr.adapters.vera.VeraModel` (projections shared by
  ``projection_prng_key``);
* a fedlr :class:`~fedlr.adapters.roles.AdaptedModel`, e.g. the SORF-VeRA
  wrapping model of :func:`~fedlr.adapters.sorf_vera.build_sorf_vera_model`,
  used as it is.

Which tensor is which is found by walking the modules (:func:`lora_layout`,
:func:`vera_layout`), never from key names. The first time a torch module is
seen, the values of every declared tensor are remembered (weakly, per
module): every later load starts from them, so a model that a process reuses
for many clients never carries one client's tensors into another's round.

:func:`unsaved_heads` finds what fedlr would silently leave at its initial
values: a module named like a task head (:data:`HEAD_NAMES`) or with
trainable parameters that is neither adapted nor in peft's
``modules_to_save``; the strategies' plug-in methods warn about it
(:func:`warn_unsaved_heads`, once per model).

:func:`conform_lora` rebuilds a LoRA model's layers at another rank and sets
their scaling (FedSpec grows the rank; the scaling must be the ``alpha / r``
the server aggregated for).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from logging import WARNING, getLogger
from typing import cast
from weakref import WeakKeyDictionary

import torch
from peft import LoraConfig, PeftModel, VeraConfig
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.tuners.vera import VeraLayer
from peft.utils import AuxiliaryTrainingWrapper

from fedlr.adapters.lora import LoraModel, lora_layout
from fedlr.adapters.roles import AdaptedModel, Role, RoleLayout
from fedlr.adapters.sorf_vera import SorfVeraLayout, SorfVeraLinear
from fedlr.adapters.vera import (
    VeraLayout,
    VeraModel,
    VeraSettings,
    check_projection,
    shared_projections,
    vera_layout,
)
from fedlr.errors import ShapeMismatchError, UnknownKeyError, UnsupportedModelError

__all__ = [
    "HEAD_NAMES",
    "LoraLayerChange",
    "adapted",
    "check_layout",
    "check_projection_model",
    "conform_lora",
    "initial_state",
    "load_from_initial",
    "lora_layers",
    "unsaved_heads",
    "vera_view",
    "warn_unsaved_heads",
]

_LOG = getLogger("fedlr")

HEAD_NAMES = ("classifier", "score", "qa_outputs", "head")
"""Module names that look like a task head (the last part of the module
path): transformers' ``*ForSequenceClassification`` / ``*ForTokenClassification``
(``classifier``, ``score``), ``*ForQuestionAnswering`` (``qa_outputs``), and
the common ``head``; the names peft's task types put in ``modules_to_save``."""

_WARNED: WeakKeyDictionary[torch.nn.Module, set[str]] = WeakKeyDictionary()

_FEDLR_SEEN = (BaseTunerLayer, AuxiliaryTrainingWrapper, SorfVeraLinear)
"""Modules whose tensors fedlr declares: adapted layers, ``modules_to_save``."""

_INITIAL: WeakKeyDictionary[torch.nn.Module, dict[str, torch.Tensor]] = (
    WeakKeyDictionary()
)


def adapted(model: torch.nn.Module | AdaptedModel) -> AdaptedModel:
    """The :class:`AdaptedModel` view of a user's model (layout, load, train_only).

    Parameters
    ----------
    model : peft.PeftModel or AdaptedModel
        A peft model whose active adapter is LoRA or VeRA, or a fedlr adapted
        model (returned unchanged).

    Returns
    -------
    LoraModel or VeraModel or AdaptedModel
        For a peft model, a fresh view (its layout follows the model's current
        rank); the pristine base weights are those of the model when fedlr
        first saw it.

    Raises
    ------
    UnsupportedModelError
        If ``model`` is neither, or its active adapter has no LoRA or VeRA
        layer.
    """
    if isinstance(model, AdaptedModel):
        return model
    if not isinstance(model, PeftModel):
        raise UnsupportedModelError(
            f"expected a peft PeftModel (LoRA or VeRA) or a fedlr AdaptedModel "
            f"(e.g. build_sorf_vera_model(...)), got {type(model).__name__}"
        )
    adapter = model.active_adapter
    has_lora = any(
        isinstance(m, LoraLayer) and adapter in m.lora_A for m in model.modules()
    )
    has_vera = any(
        isinstance(m, VeraLayer) and adapter in m.vera_lambda_b for m in model.modules()
    )
    if has_lora:
        layout = lora_layout(model)
        pristine = _first_seen(model, layout, LoraModel(model, layout, {}))
        return LoraModel(
            model=model,
            layout=layout,
            pristine_base={k: pristine[k] for k in layout.keys(Role.BASE)},
        )
    if has_vera:
        config = model.peft_config[adapter]
        if not isinstance(config, VeraConfig):
            raise UnsupportedModelError(
                f"VeRA layers under a {type(config).__name__}, expected a VeraConfig"
            )
        settings = VeraSettings(
            rank=int(config.r), projection_seed=int(config.projection_prng_key)
        )
        vlayout = vera_layout(model, settings)
        a, b = shared_projections(model)
        view = VeraModel(
            model=model,
            layout=vlayout,
            projection_a=a,
            projection_b=b,
            pristine_base={},
        )
        pristine = _first_seen(model, vlayout, view)
        view.pristine_base = {k: pristine[k] for k in vlayout.keys(Role.BASE)}
        return view
    raise UnsupportedModelError(
        f"the peft model's active adapter '{adapter}' has no LoRA or VeRA layer "
        f"(peft config: {type(model.peft_config[adapter]).__name__})"
    )


def _first_seen(
    module: torch.nn.Module, layout: RoleLayout, view: AdaptedModel
) -> dict[str, torch.Tensor]:
    """The remembered values of ``module`` (recorded now if it is new)."""
    if module not in _INITIAL:
        roles = {role for role, _, _ in layout.entries()}
        state = view.state(roles)
        _INITIAL[module] = state
    return _INITIAL[module]


def initial_state(model: AdaptedModel) -> dict[str, torch.Tensor]:
    """Every declared tensor's value when fedlr first saw ``model``'s module.

    Entries whose shape no longer fits the layout (a LoRA rank changed since)
    are left out.

    Returns
    -------
    dict of str to torch.Tensor
        Keyed as the layout; CPU copies.
    """
    saved = _first_seen(model.model, model.layout, model)
    shapes = {key: shape for _, key, shape in model.layout.entries()}
    return {
        k: v for k, v in saved.items() if k in shapes and tuple(v.shape) == shapes[k]
    }


def load_from_initial(model: AdaptedModel, state: Mapping[str, torch.Tensor]) -> None:
    """Load ``state`` over the model's initial values (:func:`initial_state`).

    Raises
    ------
    UnknownKeyError, ShapeMismatchError
        If a key of ``state`` is not declared or has another shape.
    """
    model.layout.check_shapes({k: v.shape for k, v in state.items()})
    model.load({**initial_state(model), **state})


def check_layout(
    expected: RoleLayout, got: RoleLayout, roles: Iterable[Role], *, what: str
) -> None:
    """The tensors with ``roles`` have the same keys and shapes in both layouts.

    Parameters
    ----------
    expected : RoleLayout
        The strategy's.
    got : RoleLayout
        The model's.
    roles : iterable of Role
    what : str
        Names the model in the message.

    Raises
    ------
    ShapeMismatchError
        Naming up to three keys missing on either side, the first key whose
        shape differs, or (with ``Role.BASE`` among ``roles``) the first layer
        stored the other way round (``nn.Linear`` against ``Conv1D``:
        ``fan_in_fan_out``).
    """
    roles = tuple(roles)
    want, have = expected.shapes(*roles), got.shapes(*roles)
    if set(want) != set(have):
        missing = sorted(set(want) - set(have))[:3]
        extra = sorted(set(have) - set(want))[:3]
        raise ShapeMismatchError(
            f"{what} does not match the strategy's layout: keys missing {missing}, "
            f"unexpected {extra}; build the strategy from this model "
            f"(Strategy.for_model(model))"
        )
    for key, shape in want.items():
        if tuple(have[key]) != tuple(shape):
            raise ShapeMismatchError(
                f"{what}: '{key}' has shape {tuple(have[key])}, the strategy's "
                f"layout declares {tuple(shape)}"
            )
    if Role.BASE not in roles:  # the orientation matters only for W0
        return
    want_t, have_t = _orientations(expected), _orientations(got)
    for name in sorted(want_t.keys() & have_t.keys()):
        if want_t[name] != have_t[name]:
            raise ShapeMismatchError(
                f"{what}: layer '{name}' has fan_in_fan_out={have_t[name]}, the "
                f"strategy's layout declares {want_t[name]} (nn.Linear stores "
                "W0 as (d_out, d_in), Conv1D as (d_in, d_out))"
            )


def _orientations(layout: RoleLayout) -> dict[str, bool]:
    """``fan_in_fan_out`` of every module of a LoRA or VeRA layout, by name."""
    modules = getattr(layout, "modules", ())
    return {
        m.name: bool(m.fan_in_fan_out) for m in modules if hasattr(m, "fan_in_fan_out")
    }


def unsaved_heads(model: torch.nn.Module | AdaptedModel) -> list[str]:
    """Module paths of a head-like or trainable module fedlr would never send.

    A module outside every adapted layer and every peft ``modules_to_save``
    wrapper, whose parameters are not declared in the layout, is reported
    when its name is one of :data:`HEAD_NAMES` (and it has parameters) or
    when it has a parameter with ``requires_grad``. Such a module keeps its
    initial values on every node and on the server: it is neither trained by
    :func:`fedlr.apply_round` (which freezes it) nor sent.

    Parameters
    ----------
    model : peft.PeftModel or AdaptedModel

    Returns
    -------
    list of str
        Module paths, outermost first (a reported module's children are not
        listed).
    """
    view = adapted(model)
    module = view.model
    declared = set(view.layout.all_keys())
    found: list[str] = []
    skip: list[str] = []
    for name, sub in module.named_modules():
        if not name or any(name == s or name.startswith(f"{s}.") for s in skip):
            continue
        if isinstance(sub, _FEDLR_SEEN):
            skip.append(name)
            continue
        params = [f"{name}.{p}" for p, _ in sub.named_parameters(recurse=True)]
        if not params or all(p in declared for p in params):
            continue
        own_trainable = any(p.requires_grad for p in sub.parameters(recurse=False))
        head_like = name.rsplit(".", 1)[-1] in HEAD_NAMES and not any(
            isinstance(m, _FEDLR_SEEN) for m in sub.modules()
        )  # a "head" holding adapted layers or saved modules is handled
        if head_like or own_trainable:
            found.append(name)
            skip.append(name)
    return found


def warn_unsaved_heads(model: torch.nn.Module | AdaptedModel) -> list[str]:
    """Log a warning for each module of :func:`unsaved_heads` (the first time
    a model is seen; later calls with the same model return at once).

    Returns
    -------
    list of str
        The modules warned about now.
    """
    view = adapted(model)
    if view.model in _WARNED:  # checked already: heads do not come and go
        return []
    warned = _WARNED.setdefault(view.model, set())
    new = unsaved_heads(view)
    for name in new:
        _LOG.log(
            WARNING,
            "module '%s' looks like a task head (or is trainable) but is neither "
            "adapted nor in modules_to_save: fedlr never trains or sends it, so it "
            "keeps its initial values on every node and on the server; if it is "
            "your head, add it to modules_to_save (e.g. LoraConfig(..., "
            "modules_to_save=['%s']))",
            name,
            name.rsplit(".", 1)[-1],
        )
    warned.update(new)
    return new


def vera_view(
    model: torch.nn.Module | AdaptedModel, layout_type: type[RoleLayout]
) -> VeraModel:
    """``model`` as a :class:`VeraModel` whose layout is a ``layout_type``.

    Raises
    ------
    UnsupportedModelError
        If the model is of another family (e.g. LoRA for a VeRA strategy, or
        peft VeRA for SORF-VeRA).
    """
    view = adapted(model)
    if not isinstance(view, VeraModel) or not isinstance(view.layout, layout_type):
        raise UnsupportedModelError(
            f"expected a model with a {layout_type.__name__}, got a "
            f"{type(view).__name__} with a {type(view.layout).__name__}"
        )
    return view


def check_projection_model(
    expected: RoleLayout, view: VeraModel, roles: Iterable[Role]
) -> None:
    """A VeRA-family model has the strategy's projections and layout.

    Parameters
    ----------
    expected : VeraLayout or SorfVeraLayout
        The strategy's layout (with ``projection_seed`` and ``rank``).
    view : VeraModel
    roles : iterable of Role
        The roles whose keys and shapes must agree.

    Raises
    ------
    ProjectionMismatchError
        If the projection seed or rank differ.
    ShapeMismatchError
        If the layouts differ.
    """
    want, got = expected, view.layout
    if not isinstance(want, (VeraLayout, SorfVeraLayout)) or not isinstance(
        got, (VeraLayout, SorfVeraLayout)
    ):
        raise UnsupportedModelError(
            f"projections are compared between VeRA-family layouts, got "
            f"{type(want).__name__} and {type(got).__name__}"
        )
    check_projection(
        int(got.projection_seed),
        int(got.rank),
        int(want.projection_seed),
        int(want.rank),
    )
    check_layout(expected, view.layout, roles, what="the model")


# ----------------------------------------------------------------- LoRA rank
@dataclass(frozen=True)
class LoraLayerChange:
    """What :func:`conform_lora` changed in one LoRA layer.

    Attributes
    ----------
    name : str
        The layer's module path.
    old_rank, rank : int
    old_scaling, scaling : float
    """

    name: str
    old_rank: int
    rank: int
    old_scaling: float
    scaling: float

    @property
    def alpha_changed(self) -> bool:
        """Whether ``scaling * r`` (the effective alpha) changed, not just ``r``."""
        return not math.isclose(
            self.old_scaling * self.old_rank, self.scaling * self.rank, rel_tol=1e-6
        )

    def __str__(self) -> str:
        rank = (
            f"rank {self.rank}"
            if self.rank == self.old_rank
            else f"rank {self.old_rank} -> {self.rank}"
        )
        return (
            f"layer '{self.name}': {rank}, scaling "
            f"{self.old_scaling:.6g} (alpha {self.old_scaling * self.old_rank:.6g}) "
            f"-> {self.scaling:.6g} (alpha {self.scaling * self.rank:.6g})"
        )


def lora_layers(model: PeftModel) -> dict[str, LoraLayer]:
    """The LoRA layers of the active adapter, by module path (as in the layout)."""
    adapter = model.active_adapter
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer) and adapter in module.lora_A
    }


def conform_lora(
    model: PeftModel, targets: Mapping[str, tuple[int, float]]
) -> list[LoraLayerChange]:
    """Give LoRA layers a rank and a scaling, in place.

    A layer whose rank changes gets new ``lora_A`` (r', d_in) and ``lora_B``
    (d_out, r') (``A`` as ``nn.Linear`` initialises it, ``B`` zero, so the
    update is zero until the caller loads values); its ``r``, ``lora_alpha``
    and ``scaling`` follow. The peft config's ``r`` and ``lora_alpha`` are
    updated when every layer ends with one rank and one alpha.

    Parameters
    ----------
    model : peft.PeftModel
    targets : mapping of str to (int, float)
        Layer module path (:attr:`LoraModule.name`) -> (rank, scaling).

    Returns
    -------
    list of LoraLayerChange
        One per layer whose rank or scaling changed.

    Raises
    ------
    UnknownKeyError
        If a target is not a LoRA layer of the active adapter.
    ShapeMismatchError
        If a rank is below 1 or above the layer's smaller side.
    UnsupportedModelError
        If a layer whose rank changes uses a LoRA variant (DoRA, ...).
    """
    adapter = model.active_adapter
    layers = lora_layers(model)
    unknown = sorted(set(targets) - set(layers))
    if unknown:
        raise UnknownKeyError(f"not LoRA layers of the model: {unknown[:5]}")
    changes: list[LoraLayerChange] = []
    for name, (rank, scaling) in targets.items():
        layer = layers[name]
        old_a = cast(torch.nn.Linear, layer.lora_A[adapter])
        old_rank = int(old_a.weight.shape[0])
        old_scaling = float(layer.scaling[adapter])
        if rank != old_rank:
            _rebuild_at_rank(name, layer, adapter, rank)
        if rank != old_rank or not math.isclose(old_scaling, scaling, rel_tol=1e-9):
            layer.scaling[adapter] = scaling
            layer.lora_alpha[adapter] = scaling * rank
            changes.append(
                LoraLayerChange(
                    name=name,
                    old_rank=old_rank,
                    rank=rank,
                    old_scaling=old_scaling,
                    scaling=scaling,
                )
            )
    if changes:
        _sync_config(model, list(layers.values()), adapter)
    return changes


def _rebuild_at_rank(name: str, layer: LoraLayer, adapter: str, rank: int) -> None:
    """New zero-update ``lora_A`` (rank, d_in) and ``lora_B`` (d_out, rank)
    for ``layer``, ``A`` initialised as ``nn.Linear`` does (:func:`conform_lora`)."""
    old_a = cast(torch.nn.Linear, layer.lora_A[adapter])
    old_b = cast(torch.nn.Linear, layer.lora_B[adapter])
    d_in, d_out = int(old_a.weight.shape[1]), int(old_b.weight.shape[0])
    if not 1 <= rank <= min(d_in, d_out):
        raise ShapeMismatchError(
            f"layer '{name}' ({d_out} x {d_in}) cannot take LoRA rank {rank}"
        )
    if adapter in getattr(layer, "lora_variant", {}):
        raise UnsupportedModelError(
            f"layer '{name}' uses a LoRA variant "
            f"({type(layer.lora_variant[adapter]).__name__}); fedlr "
            "rebuilds plain LoRA layers only"
        )
    like = {"device": old_a.weight.device, "dtype": old_a.weight.dtype}
    new_a = torch.nn.Linear(d_in, rank, bias=False, **like)
    new_b = torch.nn.Linear(rank, d_out, bias=old_b.bias is not None, **like)
    torch.nn.init.zeros_(new_b.weight)
    if new_b.bias is not None:
        torch.nn.init.zeros_(new_b.bias)
    layer.lora_A[adapter] = new_a
    layer.lora_B[adapter] = new_b
    layer.r[adapter] = rank


def _sync_config(model: PeftModel, layers: Sequence[LoraLayer], adapter: str) -> None:
    """The peft config's ``r`` and ``lora_alpha``, when every layer has one."""
    ranks = {int(layer.r[adapter]) for layer in layers}
    alphas = {
        round(float(layer.scaling[adapter]) * int(layer.r[adapter]), 9)
        for layer in layers
    }
    config = model.peft_config[adapter]
    if isinstance(config, LoraConfig) and len(ranks) == 1:
        config.r = ranks.pop()
    if isinstance(config, LoraConfig) and len(alphas) == 1:
        config.lora_alpha = cast(int, alphas.pop())  # peft accepts floats
