"""A task ties a run config to its data and model: what both apps build.

The server and every client build the same model from the same seed, the
same held-out split and the same partitions; this module is the one place
that knows how. Results are cached per process (a Ray actor serves many
clients), keyed by the settings that determine them.

Two tasks share one interface (:func:`text_task` picks by the data set's
kind): :class:`TextTask` fine-tunes an encoder classifier on a ``text`` data
set (accuracy, cross-entropy), :class:`CausalLMTask` instruction-tunes a
decoder on an ``instruct`` data set (loss on the response tokens only;
perplexity and exact match of greedy answers, with ``accuracy`` = exact
match). The LoRA, VeRA and SORF-VeRA payload kinds run either.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import datasets
import torch

from fedlr.adapters import LoraSettings, apply_lora, lora_layout
from fedlr.adapters.lora import LoraModel
from fedlr.adapters.orientation import resolve_targets
from fedlr.adapters.roles import AdapterLayout
from fedlr.client.train import EncodedText, encode_text, evaluate
from fedlr.config.run import RunConfig
from fedlr.data import DATASETS, dataset_info
from fedlr.data.partition import FederatedSplit
from fedlr.data.splits import dataset_split
from fedlr.errors import ConfigError
from fedlr.models import TEXT_MODELS, build_text_classifier, load_tokenizer
from fedlr.models.causal import CAUSAL_MODELS, build_causal_lm, load_causal_tokenizer
from fedlr.tasks.lm import EncodedInstructions, encode_instructions, evaluate_lm
from fedlr.wire import protocol

__all__ = [
    "CausalLMTask",
    "LoraModel",
    "TextTask",
    "published_rank",
    "server_config",
    "text_task",
]


def _datasets(kind: str) -> list[str]:
    return sorted(name for name, spec in DATASETS.items() if spec.kind == kind)


def text_task(config: RunConfig) -> TextTask | CausalLMTask:
    """The task of ``config``'s data set: classification or causal LM.

    Raises
    ------
    ConfigError
        (key ``dataset``) for an image data set, (key ``model``) for a model of
        the other task (an encoder on instructions, a decoder on labels).
    """
    spec = dataset_info(config.dataset)  # UnknownDatasetError lists names
    if spec.kind == "instruct":
        return CausalLMTask(config)
    return TextTask(config)


def server_config(config: RunConfig) -> RunConfig:
    """The run config of the server's LoRA model: under ``client-ranks`` its
    adapters have the largest client rank (:attr:`RunConfig.global_rank`).

    The one decision of the server's rank: the ServerApp's plan
    (:mod:`fedlr.server_apps.lora`) and the export (:mod:`fedlr.runs.export`)
    both build from it.
    """
    return config.replace(lora_rank=config.global_rank) if config.rank_list else config


def published_rank(
    layout: AdapterLayout, state: Mapping[str, torch.Tensor], default: int
) -> int:
    """The rank of the LoRA factors the server published in ``state`` (its
    first ``A``: FedSpec changes the rank), else ``default``."""
    a_key = layout.modules[0].a_key
    return int(state[a_key].shape[0]) if a_key in state else default


class _Common:
    """Data and LoRA plumbing both tasks share (``self.config`` is a RunConfig)."""

    config: RunConfig

    def split(self, num_partitions: int | None = None) -> FederatedSplit:
        """Held-out split and client partitions (cached, :func:`dataset_split`)."""
        return dataset_split(self.config, num_partitions)

    def encode(self, rows: datasets.Dataset) -> Any:
        raise NotImplementedError

    def heldout(self) -> Any:
        """The server's evaluation set (first ``max-eval-examples`` if set),
        without the held-out check's examples (:meth:`check_examples`)."""
        data = self.split().heldout
        reserved = self._reserved(len(data))
        data = data.select(range(len(data) - reserved))
        cap = self.config.max_eval_examples
        if cap and len(data) > cap:
            data = data.select(range(cap))
        return self.encode(data)

    def check_examples(self) -> Any:
        """The server's validation set (the held-out check's, and what the
        server's own update trains on): the last ``heldout-check-examples``
        of the held-out split (never evaluated in the reported metrics);
        ``None`` when neither is on."""
        data = self.split().heldout
        reserved = self._reserved(len(data))
        if not reserved:
            return None
        return self.encode(data.select(range(len(data) - reserved, len(data))))

    def _reserved(self, size: int) -> int:
        if not (self.config.heldout_check or self.config.server_update_share > 0):
            return 0
        k = self.config.heldout_check_examples
        if k >= size:
            raise ConfigError(
                "heldout-check-examples",
                f"{k} of the {size} held-out examples of '{self.config.dataset}' "
                "would leave none to evaluate on; use fewer",
            )
        return k

    def partition(self, partition_id: int, num_partitions: int) -> Any:
        """A client's training partition."""
        return self.encode(self.split(num_partitions).partition(partition_id))

    @property
    def head_modules(self) -> tuple[str, ...]:
        return ()

    def build_base(self) -> torch.nn.Module:
        raise NotImplementedError

    def targets(self, base: torch.nn.Module) -> tuple[str, ...]:
        """``target-modules`` resolved for ``base`` (``auto``: attention q/v)."""
        return resolve_targets(base, self.config.targets)

    def build_lora_model(self) -> LoraModel:
        """The seeded model with LoRA on ``target-modules``."""
        c = self.config
        base = self.build_base()
        settings = LoraSettings(
            rank=c.lora_rank,
            alpha=c.lora_alpha,
            dropout=c.lora_dropout,
            target_modules=self.targets(base),
            head_modules=self.head_modules,
        )
        torch.manual_seed(c.seed + 1)  # LoRA A init
        model = apply_lora(base, settings)
        layout = lora_layout(model)
        params = dict(model.named_parameters())
        pristine = {
            m.base_key: params[m.base_key].detach().clone() for m in layout.modules
        }
        return LoraModel(model=model, layout=layout, pristine_base=pristine)


@dataclass(frozen=True)
class TextTask(_Common):
    """Text classification with an adapted encoder.

    Parameters
    ----------
    config : RunConfig
    """

    config: RunConfig
    metric_columns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        spec = dataset_info(self.config.dataset)  # UnknownDatasetError lists names
        if spec.kind != "text":
            raise ConfigError(
                "dataset",
                f"'{spec.name}' is not a text data set (kind: {spec.kind}); the "
                f"text classifier needs one of ({', '.join(_datasets('text'))}), "
                f"the causal-LM task one of ({', '.join(_datasets('instruct'))})",
            )
        if self.config.model in CAUSAL_MODELS:
            raise ConfigError(
                "model",
                f"'{self.config.model}' is a decoder; classifying "
                f"'{spec.name}' needs an encoder ({', '.join(TEXT_MODELS)} or a "
                "hub id)",
            )
        for key, value, default in (
            ("precision", self.config.precision, "float32"),
            ("gradient-checkpointing", self.config.gradient_checkpointing, False),
            ("quantization", self.config.quantization, "none"),
        ):
            if value != default:
                raise ConfigError(
                    key,
                    f"applies to the causal-LM task (an instruction data set); "
                    f"the classifier on '{spec.name}' trains a float32 encoder",
                )

    @property
    def num_labels(self) -> int:
        """Number of classes of the data set."""
        return int(dataset_info(self.config.dataset).num_classes)

    @property
    def head_modules(self) -> tuple[str, ...]:
        return ("classifier",)

    def encode(self, rows: datasets.Dataset | Mapping[str, Any]) -> EncodedText:
        """Tokenize rows' ``text`` with the model's tokenizer and ``max-length``."""
        tok = load_tokenizer(self.config.model)
        return encode_text(
            list(rows["text"]), list(rows["label"]), tok, self.config.max_length
        )

    def build_base(self) -> torch.nn.Module:
        """The seeded classifier (fresh head)."""
        c = self.config
        return build_text_classifier(
            c.model, self.num_labels, c.seed, pooling=c.pooling
        )

    def evaluate(
        self,
        model: torch.nn.Module,
        data: EncodedText | EncodedInstructions,
        device: torch.device,
    ) -> dict[str, float]:
        """``accuracy`` and ``loss`` (mean cross-entropy) of ``model`` on ``data``."""
        if not isinstance(data, EncodedText):
            raise TypeError(f"expected EncodedText, got {type(data).__name__}")
        accuracy, loss = evaluate(
            model, data, batch_size=self.config.eval_batch_size, device=device
        )
        return {"accuracy": accuracy, "loss": loss}


@dataclass(frozen=True)
class CausalLMTask(_Common):
    """Instruction tuning of a decoder: loss on the response tokens only.

    The prompt is ``prompt-template`` (or the tokenizer's chat template);
    evaluation reports ``loss`` (response tokens), ``perplexity``,
    ``exact-match`` of a greedy answer of at most ``max-new-tokens`` tokens
    and ``accuracy`` (= exact match).

    Parameters
    ----------
    config : RunConfig
    """

    config: RunConfig
    metric_columns: tuple[str, ...] = protocol.TASK_EVAL_METRICS

    def __post_init__(self) -> None:
        spec = dataset_info(self.config.dataset)
        if spec.kind != "instruct":
            raise ConfigError(
                "dataset",
                f"'{spec.name}' is not an instruction data set (kind: "
                f"{spec.kind}); the causal-LM task needs one of "
                f"({', '.join(_datasets('instruct'))})",
            )
        if self.config.model in TEXT_MODELS:
            raise ConfigError(
                "model",
                f"'{self.config.model}' is an encoder classifier; instruction "
                f"tuning on '{spec.name}' needs a decoder "
                f"({', '.join(CAUSAL_MODELS)} or a hub id)",
            )

    @property
    def tokenizer(self) -> Any:
        return load_causal_tokenizer(self.config.model)

    def encode(self, rows: datasets.Dataset) -> EncodedInstructions:
        """Prompt + response token ids, prompt labels masked, cut to ``max-length``."""
        return encode_instructions(
            rows.to_list(),
            self.tokenizer,
            template=self.config.prompt_template,
            max_length=self.config.max_length,
        )

    def build_base(self) -> torch.nn.Module:
        """The decoder (``precision``, ``gradient-checkpointing``, ``quantization``)."""
        c = self.config
        return build_causal_lm(
            c.model,
            c.seed,
            precision=c.precision,
            gradient_checkpointing=c.gradient_checkpointing,
            quantization=c.quantization,
        )

    def evaluate(
        self,
        model: torch.nn.Module,
        data: EncodedText | EncodedInstructions,
        device: torch.device,
    ) -> dict[str, float]:
        """Loss, perplexity and exact match (also as ``accuracy``) on ``data``."""
        if not isinstance(data, EncodedInstructions):
            raise TypeError(f"expected EncodedInstructions, got {type(data).__name__}")
        return evaluate_lm(
            model,
            data,
            self.tokenizer,
            batch_size=self.config.eval_batch_size,
            device=device,
            max_new_tokens=self.config.max_new_tokens,
        )
