"""Name/shape/dtype tables of real checkpoints, taken from transformers itself so that every name stays real.

* `saved_table`: what `save_pretrained` writes for the config (tiny/small/demo presets; a data-free model is saved
  into a scratch directory and only the safetensors headers are read back).
* `meta_table`: the same table from a model on the meta device passed through `revert_weight_conversion` (the
  function save_pretrained uses), with no data at all: full-size presets of any size.
* `mtp_table`: the multi-token-prediction head that real Qwen3-Next / Qwen3.5 / Qwen3.6 checkpoints carry (`mtp.fc`,
  `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, one full-attention decoder layer `mtp.layers.0.*`,
  `mtp.norm`); transformers ignores it on load.
"""

from __future__ import annotations

import contextlib
import copy
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ft.compiler.synth.hf_config import FAMILIES, text_config

_ST_TO_TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn,
                "U8": torch.uint8, "I64": torch.int64}
_FP32 = (".e_score_correction_bias",)
_TEXT_ONLY = {"qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
              "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM")}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def model_class(arch: str):
    import transformers

    return getattr(transformers, FAMILIES[arch][1])


@contextlib.contextmanager
def quiet_transformers():
    """Silence transformers' progress bars and warnings (scratch saves and reference loads are internal steps)."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()  # e.g. the note that GDN falls back to its reference PyTorch kernel
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if enabled:
            hf_logging.enable_progress_bar()


def _meta_model(cls, cfg, dtype: torch.dtype):
    with torch.device("meta"):
        model = cls(cfg)
    return model.to(dtype)


def saved_table(arch: str, cfg, dtype: torch.dtype, fused: bool) -> list[TensorSpec]:
    """Names, shapes and dtypes exactly as `save_pretrained` writes them (fused: save_original_format=False)."""
    from safetensors import safe_open

    model = _meta_model(model_class(arch), cfg, dtype).to_empty(device="cpu")  # data-free: values are replaced later
    out: list[TensorSpec] = []
    with tempfile.TemporaryDirectory(prefix="ft-synth-scratch-") as tmp, quiet_transformers():
        model.save_pretrained(tmp, save_original_format=not fused)
        for f in sorted(Path(tmp).glob("*.safetensors")):
            with safe_open(str(f), "pt") as sf:
                for name in sf.keys():
                    sl = sf.get_slice(name)
                    out.append(TensorSpec(name, tuple(sl.get_shape()), _ST_TO_TORCH[sl.get_dtype()]))
    return _natural_order(out)


def meta_table(arch: str, cfg, dtype: torch.dtype, fused: bool) -> list[TensorSpec]:
    """The save_pretrained table computed on the meta device (no memory, any size)."""
    from transformers.core_model_loading import revert_weight_conversion

    model = _meta_model(model_class(arch), cfg, dtype)
    state = model.state_dict()
    if not fused:
        state = revert_weight_conversion(model, state)
    return _natural_order([TensorSpec(k, tuple(v.shape), v.dtype) for k, v in state.items()])


def mtp_table(arch: str, cfg, dtype: torch.dtype, fused: bool) -> list[TensorSpec]:
    """Fake MTP head of Qwen3-Next / Qwen3.5-family / GLM checkpoints (empty for other families)."""
    if arch in ("glm4_moe", "glm_moe_dsa"):
        return _glm_mtp_table(arch, cfg, dtype, fused)
    if arch not in _TEXT_ONLY:
        return []
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    text = copy.deepcopy(text_config(cfg).to_dict())
    text.update(num_hidden_layers=1, layer_types=["full_attention"])
    for k in ("model_type", "transformers_version", "architectures", "dtype"):
        text.pop(k, None)
    config_cls, model_cls = (getattr(transformers, n) for n in _TEXT_ONLY[arch])
    model = _meta_model(model_cls, config_cls(**text), dtype)
    state = model.state_dict()
    if not fused:
        state = revert_weight_conversion(model, state)
    hidden = text["hidden_size"]
    out = [TensorSpec("mtp.fc.weight", (hidden, 2 * hidden), dtype),
           TensorSpec("mtp.pre_fc_norm_embedding.weight", (hidden,), dtype),
           TensorSpec("mtp.pre_fc_norm_hidden.weight", (hidden,), dtype),
           TensorSpec("mtp.norm.weight", (hidden,), dtype)]
    out += [TensorSpec("mtp." + k[len("model."):], tuple(v.shape), v.dtype)
            for k, v in state.items() if k.startswith("model.layers.0.")]
    return _natural_order(out)


def _glm_mtp_table(arch: str, cfg, dtype: torch.dtype, fused: bool) -> list[TensorSpec]:
    """GLM-4.5's / GLM-5's MTP layers `model.layers.{L + j}.*`: an MoE decoder layer (GLM-5: with its indexer) plus
    eh_proj, enorm, hnorm and shared_head.norm (transformers ignores them on load)."""
    from transformers.core_model_loading import revert_weight_conversion

    n = getattr(cfg, "num_nextn_predict_layers", 0) or 0
    if not n:
        return []
    one = copy.deepcopy(cfg)
    one.num_hidden_layers, one.first_k_dense_replace = 1, 0
    if arch == "glm_moe_dsa":  # per-layer lists derived at construction: one sparse, indexed layer
        one.mlp_layer_types, one.indexer_types, one.layer_types = ["sparse"], ["full"], ["indexed_attention"]
    model = _meta_model(model_class(arch), one, dtype)
    state = model.state_dict()
    if not fused:
        state = revert_weight_conversion(model, state)
    L, hidden = cfg.num_hidden_layers, cfg.hidden_size
    out: list[TensorSpec] = []
    for j in range(n):
        p = f"model.layers.{L + j}."
        out += [TensorSpec(p + "eh_proj.weight", (hidden, 2 * hidden), dtype),
                TensorSpec(p + "enorm.weight", (hidden,), dtype), TensorSpec(p + "hnorm.weight", (hidden,), dtype),
                TensorSpec(p + "shared_head.norm.weight", (hidden,), dtype)]
        out += [TensorSpec(p + k[len("model.layers.0."):], tuple(v.shape), v.dtype)
                for k, v in state.items() if k.startswith("model.layers.0.")]
    return _natural_order(out)


def _natural_key(name: str) -> list:
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split(".")]


def _natural_order(specs: list[TensorSpec]) -> list[TensorSpec]:
    """Sorted by layer; sigmoid routers' `e_score_correction_bias` in F32 whatever the model dtype (as released)."""
    specs = [TensorSpec(s.name, s.shape, torch.float32) if s.name.endswith(_FP32) else s for s in specs]
    return sorted(specs, key=lambda s: _natural_key(s.name))


def param_count(table: list[TensorSpec], *, prefix: str = "") -> int:
    return sum(s.numel for s in table if s.name.startswith(prefix))
