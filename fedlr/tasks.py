"""A task ties a run config to its data and model: what both apps build.

The server and every client build the same model from the same seed, the
same held-out split and the same partitions; this module is the one place
that knows how. Results are cached per process (a Ray actor serves many
clients), keyed by the settings that determine them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from fedlr.adapters import LoraSettings, apply_lora, lora_layout
from fedlr.adapters.lora import LoraModel
from fedlr.config import RunConfig
from fedlr.data import (
    DATASETS,
    PartitionConfig,
    dataset_info,
    load_dataset,
    split_dataset,
)
from fedlr.data.partition import FederatedSplit
from fedlr.errors import ConfigError
from fedlr.models import build_text_classifier, load_tokenizer
from fedlr.train import EncodedText, encode_text

__all__ = ["LoraModel", "TextTask"]


def _text_datasets() -> list[str]:
    return sorted(name for name, spec in DATASETS.items() if spec.kind == "text")


@functools.lru_cache(maxsize=8)
def _split(
    dataset: str,
    seed: int,
    partitioner: str,
    num_partitions: int,
    dirichlet_alpha: float,
    classes_per_partition: int,
    eval_fraction: float,
    min_partition_size: int = 10,
) -> FederatedSplit:
    data = load_dataset(dataset, seed=seed)
    return split_dataset(
        data,
        PartitionConfig(
            partitioner=partitioner,
            num_partitions=num_partitions,
            seed=seed,
            dirichlet_alpha=dirichlet_alpha,
            classes_per_partition=classes_per_partition,
            eval_fraction=eval_fraction,
            min_partition_size=min_partition_size,
        ),
    )


@dataclass(frozen=True)
class TextTask:
    """Text classification with a LoRA-adapted transformer.

    Parameters
    ----------
    config : RunConfig
    """

    config: RunConfig

    def __post_init__(self) -> None:
        spec = dataset_info(self.config.dataset)  # UnknownDatasetError lists names
        if spec.kind != "text":
            raise ConfigError(
                "dataset",
                f"'{spec.name}' is not a text data set (kind: {spec.kind}); the "
                f"LoRA text classifier needs one of ({', '.join(_text_datasets())})",
            )

    @property
    def num_labels(self) -> int:
        """Number of classes of the data set."""
        return int(dataset_info(self.config.dataset).num_classes)

    def split(self, num_partitions: int | None = None) -> FederatedSplit:
        """Held-out split and client partitions (cached)."""
        c = self.config
        return _split(
            c.dataset,
            c.seed,
            c.partitioner,
            num_partitions or c.num_partitions,
            c.dirichlet_alpha,
            c.classes_per_partition,
            c.eval_fraction,
            c.min_partition_size,
        )

    def encode(self, texts: list[str], labels: list[int]) -> EncodedText:
        """Tokenize with the model's tokenizer and ``max-length``."""
        tok = load_tokenizer(self.config.model)
        return encode_text(texts, labels, tok, self.config.max_length)

    def heldout(self) -> EncodedText:
        """The server's evaluation set (first ``max-eval-examples`` if set)."""
        data = self.split().heldout
        cap = self.config.max_eval_examples
        if cap and len(data) > cap:
            data = data.select(range(cap))
        return self.encode(list(data["text"]), list(data["label"]))

    def partition(self, partition_id: int, num_partitions: int) -> EncodedText:
        """A client's training partition."""
        data = self.split(num_partitions).partition(partition_id)
        return self.encode(list(data["text"]), list(data["label"]))

    def build_lora_model(self) -> LoraModel:
        """The seeded classifier with LoRA on ``target-modules``."""
        c = self.config
        base = build_text_classifier(
            c.model, self.num_labels, c.seed, pooling=c.pooling
        )
        settings = LoraSettings(
            rank=c.lora_rank,
            alpha=c.lora_alpha,
            dropout=c.lora_dropout,
            target_modules=c.targets,
        )
        torch.manual_seed(c.seed + 1)  # LoRA A init
        model = apply_lora(base, settings)
        layout = lora_layout(model)
        params = dict(model.named_parameters())
        pristine = {
            m.base_key: params[m.base_key].detach().clone() for m in layout.modules
        }
        return LoraModel(model=model, layout=layout, pristine_base=pristine)
