"""Registry: HF `architectures` / `model_type` -> the family module that compiles it."""

from __future__ import annotations

from ft.compiler.errors import CheckpointError, supported
from ft.compiler.families.base import Family
from ft.compiler.families.deepseek_v4 import DeepseekV4
from ft.compiler.families.glm4_moe import Glm4Moe
from ft.compiler.families.glm_moe_dsa import GlmMoeDsa
from ft.compiler.families.gpt_oss import GptOss
from ft.compiler.families.mixtral import Mixtral
from ft.compiler.families.qwen2_moe import Qwen2Moe
from ft.compiler.families.qwen3_5_moe import Qwen35Moe
from ft.compiler.families.qwen3_moe import Qwen3Moe
from ft.compiler.families.qwen3_next import Qwen3Next

FAMILY_CLASSES: tuple[type[Family], ...] = (Qwen3Moe, Qwen2Moe, Mixtral, Qwen3Next, Qwen35Moe, GptOss, Glm4Moe,
                                               GlmMoeDsa, DeepseekV4)
# known MoE architectures whose FTW layout (families.md) is not defined yet
PLANNED = ("deepseek_v3",)


def family_for(hf: dict, where: str = "config.json") -> Family:
    """A fresh family instance for this config (by `architectures`, then `model_type`), or a clear refusal."""
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    for cls in FAMILY_CLASSES:
        if any(a in cls.architectures for a in archs):
            return cls()
    for cls in FAMILY_CLASSES:
        if model_type in cls.model_types:
            return cls()
    known = [a for cls in FAMILY_CLASSES for a in cls.architectures]
    what = f"architectures {archs} / model_type {model_type!r}"
    if model_type in PLANNED:
        raise CheckpointError(f"{where}: {what}: {model_type} is not supported yet; supported: {supported(known)}")
    raise CheckpointError(f"{where}: {what} is not supported; supported: {supported(known)}")
