"""transformers config objects for synthetic checkpoints, and the config.json rewrite that makes them look real.

transformers 5 saves `rope_parameters`, `layer_types`, `dtype` and (qwen3_moe) `num_local_experts`; the real releases
say `rope_theta` (+ `rope_scaling`, top-level `partial_rotary_factor` for Qwen3-Next), `full_attention_interval`,
`torch_dtype` and `num_experts` (GLM: top-level `rope_theta` and `partial_rotary_factor`). Qwen3.5/3.6 configs are
newer: `dtype`, `rope_parameters` with mrope inside
`text_config`, and both `layer_types` and `full_attention_interval`. `realistic_config` rewrites accordingly; every
form it writes is also read correctly by transformers (the tests load each one).
"""

from __future__ import annotations

import copy

import torch

# arch -> (config class, model class written to `architectures`)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),  # built by synth.gpt_oss
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
    "deepseek_v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM"),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
_LEGACY_ROPE = ("qwen3_moe", "qwen2_moe", "mixtral", "qwen3_next", "glm4_moe")


def layer_types_for(num_layers: int, interval: int) -> list[str]:
    """Qwen3-Next/3.5 hybrid pattern: layer i is full attention iff (i + 1) % interval == 0."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


def _interval_of(layer_types: list[str]) -> int | None:
    """The full_attention_interval that reproduces `layer_types`, if any (the releases' 4 first)."""
    for k in [4, *range(1, len(layer_types) + 2)]:
        if layer_types_for(len(layer_types), k) == list(layer_types):
            return k
    return None


def build_config(arch: str, keys: dict, tok: dict, dtype: torch.dtype):
    """A transformers config from preset keys (+ overrides); `tok` is write_tokenizer_files' result."""
    import transformers

    keys = copy.deepcopy(keys)
    vision = keys.pop("vision", None)
    rope = {"rope_type": "default", "rope_theta": float(keys.pop("rope_theta", 1e6))}
    if "partial_rotary_factor" in keys:
        rope["partial_rotary_factor"] = keys.pop("partial_rotary_factor")
    if "mrope_section" in keys:
        rope["mrope_section"] = list(keys.pop("mrope_section"))
        rope["mrope_interleaved"] = True
    interval = keys.pop("full_attention_interval", None)
    if interval is not None and "layer_types" not in keys:
        keys["layer_types"] = layer_types_for(keys["num_hidden_layers"], interval)
    specials = tok["special_tokens"]
    config_cls = getattr(transformers, FAMILIES[arch][0])
    if arch == "deepseek_v4":  # top-level rope_theta and partial factor; a flat rope dict is the compressed layers'
        keys.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope.get("partial_rotary_factor"))
        rope = dict(keys.pop("rope_scaling", None) or {"rope_type": "default"})
    if arch != "qwen3_5_moe":
        cfg = config_cls(**keys, rope_parameters=rope, bos_token_id=tok["bos_token_id"],
                         eos_token_id=tok["eos_token_id"], pad_token_id=None)
    else:
        text = dict(keys, rope_parameters=rope, bos_token_id=specials["<|endoftext|>"],
                    eos_token_id=specials["<|endoftext|>"], pad_token_id=None)
        vis = dict(vision or {}, out_hidden_size=keys["hidden_size"], deepstack_visual_indexes=[])
        cfg = config_cls(text_config=text, vision_config=vis, tie_word_embeddings=keys["tie_word_embeddings"],
                         image_token_id=specials["<|image_pad|>"], video_token_id=specials["<|video_pad|>"],
                         vision_start_token_id=specials["<|vision_start|>"],
                         vision_end_token_id=specials["<|vision_end|>"])
    cfg.architectures = [FAMILIES[arch][1]]
    cfg.dtype = dtype
    return cfg


def text_config(cfg):
    """The language-model part of a config (the config itself except for qwen3_5_moe)."""
    return cfg.text_config if hasattr(cfg, "text_config") else cfg


def realistic_config(arch: str, saved: dict, dtype: torch.dtype) -> dict:
    """Rewrite the config.json that transformers saved into the form of the real release
    (checkpoint-formats reference §6.2)."""
    d = copy.deepcopy(saved)
    name = _DTYPE_NAMES[dtype]
    t = d["text_config"] if arch == "qwen3_5_moe" else d
    rope = dict(t.pop("rope_parameters", None) or {})
    if arch in _LEGACY_ROPE:
        t["rope_theta"] = rope.get("rope_theta", 1e6)
        t["rope_scaling"] = None
        if arch in ("qwen3_next", "glm4_moe"):
            t["partial_rotary_factor"] = rope.get("partial_rotary_factor", 0.25 if arch == "qwen3_next" else 0.5)
    elif arch in ("glm_moe_dsa", "deepseek_v4"):  # GLM-5: theta and type only; V4: its main / compress sub-dicts
        t["rope_parameters"] = rope
    else:
        t["rope_parameters"] = rope
        t["partial_rotary_factor"] = rope.get("partial_rotary_factor", 0.25)
    if arch == "qwen3_moe" and "num_local_experts" in t:
        t["num_experts"] = t.pop("num_local_experts")
    if arch in ("qwen3_next", "qwen3_5_moe"):
        interval = _interval_of(t["layer_types"])
        if interval is not None:
            t["full_attention_interval"] = interval
            if arch == "qwen3_next":  # Qwen3-Next configs carry only the interval
                del t["layer_types"]
        t["mamba_ssm_dtype"] = "float32"
    if arch == "qwen3_5_moe":
        t.update(attn_output_gate=True, mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False, dtype=name)
        d["vision_config"]["dtype"] = name
        d["text_config"] = dict(sorted(t.items()))
        d["dtype"] = name
    else:  # releases predating transformers 4.56 say torch_dtype
        d.pop("dtype", None)
        d["torch_dtype"] = name
    if arch in ("qwen3_moe", "qwen2_moe"):
        d.setdefault("use_sliding_window", False)
        d.setdefault("sliding_window", None)
        d.setdefault("max_window_layers", t["num_hidden_layers"])
    return dict(sorted(d.items()))


def generation_config(arch: str, tok: dict) -> dict:
    """generation_config.json in the style of the Qwen releases (stop on <|im_end|> and <|endoftext|>); GLM's stops on
    <|endoftext|>, <|user|> and <|observation|> (GLM-4.5 and GLM-5 alike)."""
    import transformers

    if arch in ("glm4_moe", "glm_moe_dsa"):
        return {"eos_token_id": [tok["endoftext_token_id"], tok["user_token_id"], tok["observation_token_id"]],
                "pad_token_id": tok["pad_token_id"], "transformers_version": transformers.__version__}
    base = {"bos_token_id": tok["bos_token_id"], "pad_token_id": tok["pad_token_id"],
            "eos_token_id": [tok["im_end_token_id"], tok["endoftext_token_id"]]}
    sampling = {
        "qwen3_moe": {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95},
        "qwen3_5_moe": {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95},
        "qwen3_next": {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8},
        "qwen2_moe": {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05},
        "mixtral": {},
        "deepseek_v4": {"do_sample": True, "temperature": 1.0, "top_p": 1.0},
    }[arch]
    return dict(sorted({**base, **sampling, "transformers_version": transformers.__version__}.items()))
