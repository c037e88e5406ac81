"""Model-side adapters with declared parameter roles."""

from fedlr.adapters.lora import (
    LoraModel,
    LoraSettings,
    adapter_state,
    apply_lora,
    load_adapter_state,
    lora_layout,
    parameters_by_key,
)
from fedlr.adapters.roles import (
    AdaptedModel,
    AdapterLayout,
    LoraModule,
    Role,
    RoleLayout,
)
from fedlr.adapters.sorf_vera import (
    SorfVeraLayout,
    SorfVeraLinear,
    SorfVeraModule,
    SorfVeraSettings,
    apply_sorf_vera,
    build_sorf_vera_model,
)
from fedlr.adapters.vera import (
    VeraLayout,
    VeraModel,
    VeraModule,
    VeraSettings,
    apply_vera,
    build_vera_model,
    check_projection,
)

__all__ = [
    "AdaptedModel",
    "AdapterLayout",
    "LoraModel",
    "LoraModule",
    "LoraSettings",
    "Role",
    "RoleLayout",
    "SorfVeraLayout",
    "SorfVeraLinear",
    "SorfVeraModule",
    "SorfVeraSettings",
    "VeraLayout",
    "VeraModel",
    "VeraModule",
    "VeraSettings",
    "adapter_state",
    "apply_lora",
    "apply_sorf_vera",
    "apply_vera",
    "build_sorf_vera_model",
    "build_vera_model",
    "check_projection",
    "load_adapter_state",
    "lora_layout",
    "parameters_by_key",
]
