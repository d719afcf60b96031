"""ModelOpt NVFP4 layout for synthetic checkpoints: which linears are quantized, the tensors, and both config styles.

Precision choices:
* qwen3_5_moe mirrors nvidia/Qwen3.6-35B-A3B-NVFP4 (MIXED_PRECISION): FP8 per-tensor for linear_attn in_proj_qkv /
  in_proj_z / out_proj and self_attn q/k/v/o; W4A16 NVFP4 for the routed experts (per expert, 2-D), the shared expert
  and lm_head; everything else (routers, shared_expert_gate, in_proj_a/b, conv1d, norms, embeddings, vision, MTP) BF16.
* other families follow nvidia/Qwen3-30B-A3B-FP4 (NVFP4): attention, experts, shared expert and dense MLP linears
  NVFP4 (Qwen3-Next also linear_attn in_proj_qkvz / out_proj; in_proj_ba stays BF16 like Qwen3.6's in_proj_a/b);
  routers, shared_expert_gate, lm_head and MTP excluded.

Tensors per quantized linear X: NVFP4 `X.weight` u8 [out, in/2], `X.weight_scale` e4m3 [out, in/16],
`X.weight_scale_2` f32 0-dim, `X.input_scale` f32 0-dim; FP8 `X.weight` e4m3 [out, in], `X.weight_scale` f32 0-dim,
`X.input_scale` f32 0-dim. Gate/up pairs (and q/k/v for NVFP4) share weight_scale_2 from their joint amax, like
ModelOpt's amax sync.

Exact BF16 twin: synthetic global scales are ModelOpt's amax/2688 (FP8: amax/448) times a per-group factor 1, sqrt(2)
or 2 (so globals differ between experts, as in real files), rounded UP to a value with two significant bits
(m * 2^e, m in {1, 1.5}). An E2M1 value (2 significant bits) times an e4m3 block scale (4) times such
a global (2) has at most 8 significant bits, so every dequantized weight is exactly representable in BF16 and the
twin (`<out>-twin`, original names, no quantization_config) equals the float32 dequantization bit for bit.
"""

from __future__ import annotations

import math
import re

import torch

from ft.compiler.quant import fp8 as fp8_quant
from ft.compiler.quant import nvfp4 as nvfp4_quant
from ft.compiler.synth.routing import name_seed
from ft.formats.quant import fp8 as fp8_fmt
from ft.formats.quant import nvfp4 as nvfp4_fmt

PRODUCER = {"name": "modelopt", "version": "0.37.0"}
INPUT_AMAX = 8.0  # synthetic activation amax behind input_scale (no calibration data exists)
_EXPERT = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_ATTN = re.compile(r"\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight$")
_SHARED = re.compile(r"\.shared_experts?\.(gate_proj|up_proj|down_proj)\.weight$")
_DENSE = re.compile(r"\.mlp\.(gate_proj|up_proj|down_proj)\.weight$")
_PARTNER = {"gate_proj": "up_proj", "up_proj": "gate_proj", "w1": "w3", "w3": "w1"}


def two_bit_scale(x: float) -> float:
    """Smallest m * 2^e >= x with m in {1, 1.5}: a global scale that keeps dequantized values BF16-exact."""
    if not x > 0 or not math.isfinite(x):
        return 1.0
    m, e = math.frexp(x)  # x = m * 2^e, m in [0.5, 1)
    for step in (0.5, 0.75, 1.0):
        if m <= step:
            return math.ldexp(step, e)
    raise AssertionError(x)


def scheme_of(arch: str, name: str) -> str | None:
    """'nvfp4' | 'fp8' for a quantized linear's `.weight`, None when the tensor stays in the checkpoint dtype."""
    if name.startswith(("mtp.", "model.visual.")) or not name.endswith(".weight"):
        return None
    if name == "lm_head.weight":
        return "nvfp4" if arch == "qwen3_5_moe" else None
    if _EXPERT.search(name) or _SHARED.search(name) or _DENSE.search(name):
        return "nvfp4"
    if arch == "qwen3_5_moe":
        return "fp8" if _ATTN.search(name) or re.search(r"\.linear_attn\.(in_proj_qkv|in_proj_z|out_proj)\.weight$",
                                                         name) else None
    if _ATTN.search(name) or re.search(r"\.linear_attn\.(in_proj_qkvz|out_proj)\.weight$", name):
        return "nvfp4"
    return None


def excluded_linears(arch: str, names: list[str]) -> list[str]:
    """Linear modules ModelOpt leaves unquantized (listed in exclude_modules / ignore), plus the MTP wildcard."""
    out = [n[: -len(".weight")] for n in names
           if n.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight", ".shared_expert_gate.weight",
                          ".linear_attn.in_proj_ba.weight")) and not n.startswith("mtp.")]
    if "lm_head.weight" in names and scheme_of(arch, "lm_head.weight") is None:
        out.insert(0, "lm_head")
    return out + (["mtp*"] if any(n.startswith("mtp.") for n in names) else [])


def _module_key(name: str) -> str:
    """quantized_layers key: the module path, with all routed experts of a layer collapsed to `...mlp.experts`."""
    mod = name[: -len(".weight")]
    m = re.match(r"^(.*\.mlp\.experts)\.\d+\.", mod)
    return m.group(1) if m else mod


def quant_configs(arch: str, names: list[str]) -> tuple[dict, dict]:
    """(config.json quantization_config, hf_quant_config.json) for a checkpoint with these original tensor names."""
    schemes = {n: s for n in names if (s := scheme_of(arch, n)) is not None}
    if arch == "qwen3_5_moe":
        layers: dict[str, dict] = {}
        for n, s in schemes.items():
            key = _module_key(n)
            layers.setdefault(key, {"quant_algo": "FP8"} if s == "fp8" else {"quant_algo": "W4A16_NVFP4",
                                                                              "group_size": 16})
        lm = layers.pop("lm_head", None)
        if lm is not None:
            layers["lm_head"] = lm  # the release lists lm_head last
        ignore = ["mtp.layers.0*", "mtp*"]
        fp8_targets = sorted(k for k, v in layers.items() if v["quant_algo"] == "FP8")
        fp4_targets = sorted(k for k, v in layers.items() if v["quant_algo"] != "FP8")
        w8 = {"dynamic": False, "num_bits": 8, "type": "float"}
        w4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
        qc = {"config_groups": {"group_0": {"input_activations": w8, "weights": w8, "targets": fp8_targets},
                                "group_1": {"input_activations": w4, "weights": w4, "targets": fp4_targets}},
              "quantized_layers": layers, "ignore": ignore, "quant_algo": "MIXED_PRECISION", "producer": PRODUCER,
              "quant_method": "modelopt"}
        legacy = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": "FP8", "quantized_layers": layers,
                  "exclude_modules": ignore}
    else:
        excluded = excluded_linears(arch, names)
        w4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
        qc = {"config_groups": {"group_0": {"input_activations": w4, "weights": w4, "targets": ["Linear"]}},
              "ignore": excluded, "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
              "quant_algo": "NVFP4", "producer": PRODUCER, "quant_method": "modelopt"}
        legacy = {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16, "exclude_modules": excluded}
    return qc, {"producer": PRODUCER, "quantization": legacy}


def scale_group(arch: str, name: str) -> str:
    """Key shared by linears whose globals ModelOpt syncs: gate/up of one expert (or MLP); q/k/v of one NVFP4 layer."""
    parts = name.split(".")
    if parts[-2] in _PARTNER:
        return ".".join(parts[:-2]) + ".gate_up"
    if scheme_of(arch, name) == "nvfp4" and parts[-2] in ("q_proj", "k_proj", "v_proj"):
        return ".".join(parts[:-2]) + ".qkv"
    return name


def scale_jitter(seed: int, group: str) -> float:
    """1, sqrt(2) or 2 per scale group: real globals differ from tensor to tensor, so a consumer that applies the
    wrong expert's or row's global must be caught. Any factor >= 1 keeps the quantization valid (block scales just
    get smaller), and `two_bit_scale` of the product keeps dequantization BF16-exact."""
    return 2.0 ** ((name_seed(seed, "scale:" + group) % 3) / 2)


def quantize_state(arch: str, state: dict[str, torch.Tensor],
                   seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(ModelOpt-layout tensors, exact twin with the original names) from an unquantized per-expert state dict."""
    groups = {n: scale_group(arch, n) for n in state if scheme_of(arch, n) is not None}
    amax: dict[str, float] = {}
    for n, g in groups.items():
        amax[g] = max(amax.get(g, 0.0), float(state[n].float().abs().amax()))
    quant: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    for n, t in state.items():
        scheme = scheme_of(arch, n)
        mod = n[: -len(".weight")]
        if scheme is None:
            quant[n] = twin[n] = t
            continue
        g = groups[n]
        if scheme == "nvfp4":
            s2 = two_bit_scale(amax[g] / (nvfp4_fmt.E2M1_MAX * nvfp4_fmt.E4M3_MAX) * scale_jitter(seed, g))
            w, bs, s2t = nvfp4_quant.quantize(t, s2)
            deq = nvfp4_fmt.dequantize(w, bs, s2t)
            quant.update({n: w, f"{mod}.weight_scale": bs, f"{mod}.weight_scale_2": s2t,
                          f"{mod}.input_scale": input_scale("nvfp4")})
        else:
            w, s = fp8_quant.quantize(t, two_bit_scale(amax[g] / fp8_fmt.E4M3_MAX * scale_jitter(seed, g)))
            deq = fp8_fmt.dequantize(w, s)
            quant.update({n: w, f"{mod}.weight_scale": s, f"{mod}.input_scale": input_scale("fp8")})
        twin[n] = deq.to(t.dtype)
        if not torch.equal(twin[n].float(), deq):
            raise AssertionError(f"{n}: dequantized weights are not exact in {t.dtype}")
    return quant, twin


def input_scale(scheme: str) -> torch.Tensor:
    qmax = nvfp4_fmt.E2M1_MAX * nvfp4_fmt.E4M3_MAX if scheme == "nvfp4" else fp8_fmt.E4M3_MAX
    return torch.tensor(two_bit_scale(INPUT_AMAX / qmax), dtype=torch.float32)
