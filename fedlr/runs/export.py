"""The final global adapter of a run as a PEFT directory.

At the end of every LoRA- or VeRA-family run the server writes
``<run dir>/adapter/``:

``adapter_config.json``, ``adapter_model.safetensors``
    peft's ``save_pretrained`` of the final global adapter (and the trained
    classifier head, peft's ``modules_to_save``): ``PeftModel.from_pretrained``
    loads it on the same base model and gives the server's final evaluation.
``base_weights.safetensors`` (methods that fold into the base)
    FedEx-LoRA, VeRA-FedEx and FLoRA add their residuals to the frozen base
    weights ``W0``: the adapted layers' base weights that differ from the
    model as built, keyed by their names in the *base* model
    (``bert.encoder.layer.0.attention.self.query.weight``). Load them into the
    base before the adapter (``base.load_state_dict(..., strict=False)``), or
    let :func:`load_adapter` do both: it refuses a directory whose base
    weights are missing (:class:`MissingBaseWeightsError`). PEFT cannot carry
    them (``PeftModel.from_pretrained`` loads adapter and ``modules_to_save``
    tensors only), so the directory is marked for plain PEFT users: its
    ``adapter_config.json`` has the key :data:`BASE_WEIGHTS_MARKER` (peft
    ignores it with a ``UserWarning`` naming it) and peft's ``README.md``
    starts with the instruction.
``fedlr_export.json``, ``README.txt``
    What the directory holds (``content``: ``adapter``,
    ``adapter+folded-base`` or ``shared-part``), the method, the model, and
    how to load it.

Personalised methods (FedSA-LoRA, Global-SVD, Local-SVD) have no single
global model: the directory holds the shared part the server keeps (the
arrays it averages, the others as built), and says so. SORF-VeRA's layers are
fedlr's own module, not a peft method: its run writes no adapter directory
(``final_arrays.pt`` has its arrays). Nothing here knows about Flower.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file, save_file

from fedlr.adapters import Role
from fedlr.adapters.lora import LoraModel
from fedlr.adapters.roles import AdaptedModel
from fedlr.adapters.vera import VeraModel
from fedlr.errors import FedLRError, UnknownKeyError
from fedlr.strategies.registry import MethodConfig, MethodSpec
from fedlr.tasks.text import published_rank, server_config, text_task
from fedlr.tasks.vera import VeraOptions, build_vera_text_model

__all__ = [
    "BASE_WEIGHTS",
    "BASE_WEIGHTS_MARKER",
    "EXPORT_DIR",
    "EXPORT_INFO",
    "MissingBaseWeightsError",
    "build_export_model",
    "export_adapter",
    "folded_base_weights",
    "load_adapter",
]

_LOG = logging.getLogger("fedlr")

EXPORT_DIR = "adapter"
"""The adapter directory inside a run directory."""
BASE_WEIGHTS = "base_weights.safetensors"
EXPORT_INFO = "fedlr_export.json"
BASE_WEIGHTS_MARKER = "fedlr_requires_base_weights_safetensors"
"""Key added to ``adapter_config.json`` of an ``adapter+folded-base`` export
(value: what to do). peft ignores unknown keys with a ``UserWarning`` that
names this one: the only sign a plain ``PeftModel.from_pretrained`` gives."""


class MissingBaseWeightsError(FedLRError, FileNotFoundError):
    """An exported adapter of a method that folds into the base (FedEx-LoRA,
    VeRA-FedEx, FLoRA) is loaded without its ``base_weights.safetensors``:
    the adapter alone is not the trained model (on the base as built it
    evaluates to another accuracy, without any error from peft)."""


def build_export_model(
    method: MethodConfig, state: Mapping[str, torch.Tensor]
) -> AdaptedModel | None:
    """The run's adapted model (as the server builds it) with ``state`` loaded.

    LoRA models are built at the rank of ``state``'s factors (FedSpec changes
    it; heterogeneous ranks export the server's largest rank). ``None`` for a
    payload kind without a peft adapter.
    """
    config, kind = method.run, method.spec.payload.name
    if kind == "vera":
        vm: VeraModel = build_vera_text_model(config, VeraOptions.of(method.options))
        vm.load(state)
        return vm
    if kind != "lora":
        return None
    config = server_config(config)
    lm: LoraModel = text_task(config).build_lora_model()
    rank = published_rank(lm.layout, state, config.lora_rank)
    if rank != config.lora_rank:
        lm = text_task(config.replace(lora_rank=rank)).build_lora_model()
    lm.load(state)
    return lm


def folded_base_weights(adapted: AdaptedModel) -> dict[str, torch.Tensor]:
    """Adapted layers' base weights that differ from the model as built.

    Keyed by their names in the base model (what ``base.load_state_dict``
    takes before ``PeftModel.from_pretrained``), found by walking peft's
    tuner layers (``BaseTunerLayer.get_base_layer``), not by key strings.
    """
    model = adapted.model
    if not isinstance(model, PeftModel):
        return {}
    plain: dict[int, str] = {}
    for name, module in model.get_base_model().named_modules():
        if isinstance(module, BaseTunerLayer):
            base_layer = module.get_base_layer()
            for pname, param in base_layer.named_parameters(recurse=False):
                plain[id(param)] = f"{name}.{pname}"
    params = dict(model.named_parameters())
    pristine: dict[str, torch.Tensor] = getattr(adapted, "pristine_base", {})
    out: dict[str, torch.Tensor] = {}
    for key, before in pristine.items():
        param = params[key]
        if not torch.equal(param.detach().cpu(), before.cpu()):
            out[plain[id(param)]] = param.detach().to("cpu").contiguous().clone()
    return out


def _readme(info: Mapping[str, Any]) -> str:
    lines = [
        f"fedlr {info['method']} on {info['model']} ({info['dataset']}), "
        f"after round {info['rounds']}: {info['content']}.",
        "",
        str(info["description"]),
        "",
        "Load it on the same base model (see docs/tracking.md):",
        "",
        "    from peft import PeftModel",
    ]
    if info["content"] == "adapter+folded-base":
        lines += [
            "    from safetensors.torch import load_file",
            f"    base.load_state_dict(load_file('{BASE_WEIGHTS}'), strict=False)",
        ]
    lines += [
        "    model = PeftModel.from_pretrained(base, '<this directory>')",
        "",
        "or, with fedlr installed (it refuses a folder that misses a file):",
        "",
        "    from fedlr.runs.export import load_adapter",
        "    model = load_adapter(base, '<this directory>')",
        "",
    ]
    return "\n".join(lines)


def export_adapter(
    method: MethodConfig,
    state: Mapping[str, torch.Tensor],
    run_dir: Path,
    *,
    rounds: int,
) -> dict[str, Any]:
    """Write ``run_dir/adapter/`` for a LoRA/VeRA run; return summary fields.

    Parameters
    ----------
    method : MethodConfig
        The run's resolved method and settings.
    state : mapping of str to torch.Tensor
        The final global arrays (``final_arrays.pt``).
    run_dir : pathlib.Path
    rounds : int
        Rounds the arrays are the result of.

    Returns
    -------
    dict
        ``adapter-export`` (the directory, or why there is none) and
        ``adapter-content``; empty for a method without adapters (vision).
        The run's results matter more than its export: arrays that do not fit
        the model (a plug-in layout fedlr cannot rebuild) or a failed write
        are logged as a warning and reported as ``adapter-export: "failed:
        <reason>"`` instead of failing the finished run.
    """
    try:
        return _export(method, state, run_dir, rounds=rounds)
    except (FedLRError, OSError) as exc:
        _LOG.warning("fedlr: the adapter was not exported: %s", exc)
        return {"adapter-export": f"failed: {exc}"}


def _export(
    method: MethodConfig,
    state: Mapping[str, torch.Tensor],
    run_dir: Path,
    *,
    rounds: int,
) -> dict[str, Any]:
    spec, config = method.spec, method.run
    kind = spec.payload.name
    if kind == "sorf-vera":
        return {
            "adapter-export": "none: SORF-VeRA's layers are fedlr's own module, "
            "not a peft adapter; final_arrays.pt holds its arrays"
        }
    adapted = build_export_model(method, state)
    if adapted is None or not isinstance(adapted.model, PeftModel):
        return {}
    out = run_dir / EXPORT_DIR
    adapted.model.save_pretrained(str(out))
    content, description = _content(spec, adapted, state, out)
    info = {
        "method": spec.name,
        "model": config.model,
        "dataset": config.dataset,
        "seed": config.seed,
        "rounds": rounds,
        "content": content,
        "base-weights": BASE_WEIGHTS if content == "adapter+folded-base" else None,
        "description": description,
    }
    (out / EXPORT_INFO).write_text(json.dumps(info, indent=2))
    (out / "README.txt").write_text(_readme(info))
    _LOG.info("fedlr: adapter (%s) exported to %s", content, out)
    return {"adapter-export": str(out), "adapter-content": content}


def _content(
    spec: MethodSpec,
    adapted: AdaptedModel,
    state: Mapping[str, torch.Tensor],
    out: Path,
) -> tuple[str, str]:
    """What the exported directory ``out`` holds, and its description; a
    method that folds into the base also gets its folded base weights
    written there."""
    folded = folded_base_weights(adapted) if spec.traits.folds_base else {}
    if spec.traits.personalised:
        content = "shared-part"
        sent = sorted({role.value for role in _sent_roles(adapted, state)})
        description = (
            f"{spec.name} is personalised: each client keeps its own part on its "
            f"node. This adapter holds the shared part the server aggregates "
            f"({', '.join(sent)}); the other tensors are as built, so it is not "
            "any client's model."
        )
    elif folded:
        content = "adapter+folded-base"
        save_file(folded, str(out / BASE_WEIGHTS))
        _mark_folded(out, spec.name, len(folded))
        description = (
            f"{spec.name} folds its residuals into the frozen base weights: "
            f"{BASE_WEIGHTS} holds the {len(folded)} folded base weights (names "
            "of the base model); load them into the base, then the adapter."
        )
    else:
        content = "adapter"
        description = "The global adapter; the base model is unchanged."
    return content, description


def _folded_note(method: str, count: int) -> str:
    return (
        f"{method} folded its residuals into {count} base weights: load "
        f"{BASE_WEIGHTS} into the base model before this adapter "
        f"(base.load_state_dict(load_file('{BASE_WEIGHTS}'), strict=False)) or "
        "use fedlr.runs.export.load_adapter(base, directory); the adapter alone "
        "on the base as built is not the trained model"
    )


def _mark_folded(out: Path, method: str, count: int) -> None:
    """Tell plain peft users that the adapter needs the folded base weights:
    a key of ``adapter_config.json`` (peft warns that it ignores it, naming
    it) and a first section of peft's ``README.md`` model card."""
    note = _folded_note(method, count)
    config_path = out / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config[BASE_WEIGHTS_MARKER] = note
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
    card = out / "README.md"
    body = card.read_text() if card.is_file() else ""
    warning = f"# Needs {BASE_WEIGHTS}\n\n{note}.\n\n"
    end = body.find("\n---", 3) if body.startswith("---") else -1
    if end >= 0:  # keep peft's YAML front matter first
        split = end + len("\n---\n")
        body = body[:split] + "\n" + warning + body[split:]
    else:
        body = warning + body
    card.write_text(body)


def load_adapter(base: torch.nn.Module, directory: str | Path) -> PeftModel:
    """The exported model: ``base`` with the folded base weights, if the export
    has any, then the adapter (``PeftModel.from_pretrained``).

    Parameters
    ----------
    base : torch.nn.Module
        The base model as the run built it (same ``model`` and, for fedlr's
        seeded tiny models, the same ``seed``); its folded weights are
        replaced in place.
    directory : str or pathlib.Path
        The run's ``adapter/`` directory.

    Raises
    ------
    MissingBaseWeightsError
        If the export folded residuals into the base (``content``
        ``adapter+folded-base``, or the marker in ``adapter_config.json``) and
        ``base_weights.safetensors`` is not in ``directory``.
    UnknownKeyError
        If the base weights do not belong to ``base`` (a name it lacks).
    """
    folder = Path(directory)
    info_path = folder / EXPORT_INFO
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    config_path = folder / "adapter_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    folded = (
        info.get("content") == "adapter+folded-base" or BASE_WEIGHTS_MARKER in config
    )
    weights = folder / BASE_WEIGHTS
    if folded and not weights.is_file():
        raise MissingBaseWeightsError(
            f"{weights} is missing: {info.get('method', 'the method')} folded its "
            f"residuals into the base weights, and the adapter without "
            f"{BASE_WEIGHTS} is not the trained model; copy the file back from "
            "the run's adapter directory"
        )
    if weights.is_file():
        loaded = base.load_state_dict(load_file(str(weights)), strict=False)
        if loaded.unexpected_keys:
            raise UnknownKeyError(
                f"{weights} names weights the base model does not have "
                f"({', '.join(sorted(loaded.unexpected_keys)[:3])}): another model?"
            )
    with warnings.catch_warnings():  # the marker did its job: checked above
        warnings.filterwarnings(
            "ignore", message=f".*{BASE_WEIGHTS_MARKER}", category=UserWarning
        )
        return PeftModel.from_pretrained(base, str(folder))


def _sent_roles(adapted: AdaptedModel, state: Mapping[str, torch.Tensor]) -> set[Role]:
    """Roles of the keys present in ``state`` (the server's shared arrays)."""
    return {
        role
        for role, key, _ in adapted.layout.entries()
        if key in state and role != Role.BASE
    }
