"""Model builders: text classifiers (transformers) and image classifiers (torch)."""

from fedlr.models.text import TEXT_MODELS, build_text_classifier, load_tokenizer
from fedlr.models.vision import (
    VISION_MODELS,
    AlexNetLike,
    SmallCNN,
    VisionMLP,
    VisionModel,
    build_vision_model,
    register_model,
    vision_models,
)

__all__ = [
    "TEXT_MODELS",
    "VISION_MODELS",
    "AlexNetLike",
    "SmallCNN",
    "VisionMLP",
    "VisionModel",
    "build_text_classifier",
    "build_vision_model",
    "load_tokenizer",
    "register_model",
    "vision_models",
]
