"""Family registry: `config.family` -> model class (one module per family, imported on first use)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ft.runtime.model import CausalLM

# family -> (module, class)
_REGISTRY: dict[str, tuple[str, str]] = {
    "qwen3_moe": ("ft.runtime.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("ft.runtime.models.qwen2_moe", "Qwen2MoeForCausalLM"),
    "mixtral": ("ft.runtime.models.mixtral", "MixtralForCausalLM"),
    "qwen3_next": ("ft.runtime.models.qwen3_next", "Qwen3NextForCausalLM"),
    "qwen3_5_moe": ("ft.runtime.models.qwen3_5_moe", "Qwen3_5MoeForCausalLM"),
    "gpt_oss": ("ft.runtime.models.gpt_oss", "GptOssForCausalLM"),
    "glm4_moe": ("ft.runtime.models.glm4_moe", "Glm4MoeForCausalLM"),
    "glm_moe_dsa": ("ft.runtime.models.glm_moe_dsa", "GlmMoeDsaForCausalLM"),
    "deepseek_v4": ("ft.runtime.models.deepseek_v4", "DeepseekV4ForCausalLM"),
}

SUPPORTED_FAMILIES = tuple(_REGISTRY)


def model_class(family: str) -> type["CausalLM"]:
    """The runtime class of `family`; an unknown family is refused with the supported list."""
    try:
        module, cls = _REGISTRY[family]
    except KeyError:
        raise ValueError(f"unsupported model family {family!r}; the runtime supports: "
                         f"{', '.join(SUPPORTED_FAMILIES)}") from None
    return getattr(importlib.import_module(module), cls)
