"""Model-side adapters with declared parameter roles."""

from fedlr.adapters.lora import (
    LoraSettings,
    adapter_state,
    apply_lora,
    load_adapter_state,
    lora_layout,
    parameters_by_key,
)
from fedlr.adapters.roles import AdapterLayout, LoraModule, Role

__all__ = [
    "AdapterLayout",
    "LoraModule",
    "LoraSettings",
    "Role",
    "adapter_state",
    "apply_lora",
    "load_adapter_state",
    "lora_layout",
    "parameters_by_key",
]
