"""Model builders."""

from fedlr.models.text import TEXT_MODELS, build_text_classifier, load_tokenizer

__all__ = ["TEXT_MODELS", "build_text_classifier", "load_tokenizer"]
