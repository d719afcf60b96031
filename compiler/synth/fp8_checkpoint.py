"""Block-FP8 layout (Qwen3-*-FP8, GLM-*-FP8, DeepSeek-V3 style) for synthetic checkpoints: which linears are
quantized, their tensors and the config.

Quantized: attention q/k/v/o (GLM-5's MLA: q_a / q_b / kv_a_proj_with_mqa / kv_b / o and the DSA indexer's wq_b /
wk; its weights_proj stays, as transformers keeps it in float32), routed experts (per expert, 2-D), shared experts,
dense MLPs, and the linear-attention projections in_proj_qkvz / in_proj_qkv / in_proj_z / out_proj, in the decoder
and in the MTP head alike (releases quantize every decoder Linear). Left in the checkpoint dtype: embeddings, lm_head,
norms, routers (`mlp.gate`), shared_expert_gate, in_proj_ba / in_proj_a / in_proj_b, conv1d and the vision tower.

Tensors per quantized linear X: `X.weight` float8_e4m3fn [N, K] and `X.weight_scale_inv` float32 [ceil(N/128),
ceil(K/128)] (`ft.compiler.quant.fp8_block`). `quantization_config`: {"activation_scheme": "dynamic", "fmt": "e4m3",
"quant_method": "fp8", "weight_block_size": [128, 128]}; the Qwen families add `modules_to_not_convert` (lm_head,
norms, routers, ... per layer, like Qwen3-30B-A3B-FP8), glm4_moe and glm_moe_dsa carry the bare DeepSeek-style
config.

Exact BF16 twin: each tile's scale is the quantizer's amax/448 rounded UP to two significant bits (`two_bit_scales`);
an e4m3 value (4 significant bits) times such a scale has at most 6, so every dequantized weight is exactly
representable in BF16 and the twin (`<out>-twin`, original names, no quantization_config) equals the float32
dequantization bit for bit.
"""

from __future__ import annotations

import re

import torch

from ft.compiler.quant import fp8_block
from ft.compiler.synth.tables import TensorSpec

_QUANTIZED = re.compile(r"\.(self_attn\.(q_proj|k_proj|v_proj|o_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)"
                        r"|self_attn\.indexer\.(wq_b|wk)"
                        r"|experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)"
                        r"|shared_experts?\.(gate_proj|up_proj|down_proj)|mlp\.(gate_proj|up_proj|down_proj)"
                        r"|linear_attn\.(in_proj_qkvz|in_proj_qkv|in_proj_z|out_proj))\.weight$")
CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def quantized(name: str, shape: tuple[int, ...]) -> bool:
    """Whether the tensor `name` is a linear's weight that the FP8 release stores block-quantized."""
    return len(shape) == 2 and not name.startswith("model.visual.") and bool(_QUANTIZED.search(name))


def quant_config(arch: str, table: list[TensorSpec]) -> dict:
    """config.json quantization_config for a checkpoint with this (unquantized) tensor table."""
    if arch in ("glm4_moe", "glm_moe_dsa"):
        return dict(CONFIG)
    keep = [t.name[: -len(".weight")] for t in table if t.name.endswith(".weight") and not quantized(t.name, t.shape)
            and not t.name.startswith(("model.visual.", "mtp.")) and not t.name.endswith("embed_tokens.weight")]
    prefixes = [p for p in ("model.visual", "mtp") if any(t.name.startswith(p + ".") for t in table)]
    return dict(CONFIG, modules_to_not_convert=sorted(keep) + prefixes)


def quantized_table(table: list[TensorSpec]) -> list[TensorSpec]:
    """The written table: each quantized weight becomes its F8_E4M3 weight and F32 weight_scale_inv."""
    out = []
    for t in table:
        if quantized(t.name, t.shape):
            out += [TensorSpec(t.name, t.shape, torch.float8_e4m3fn),
                    TensorSpec(t.name[: -len("weight")] + "weight_scale_inv", fp8_block.grid(*t.shape), torch.float32)]
        else:
            out.append(t)
    return out


def two_bit_scales(s: torch.Tensor) -> torch.Tensor:
    """Each positive scale rounded up to m * 2^e with m in {1, 1.5} (nvfp4_checkpoint.two_bit_scale, elementwise)."""
    m, e = torch.frexp(s.float())  # s = m * 2^e, m in [0.5, 1)
    step = torch.where(m <= 0.5, 0.5, torch.where(m <= 0.75, 0.75, 1.0))
    return torch.ldexp(step, e.float())


def quantize_state(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(block-FP8 tensors, exact twin with the original names) from an unquantized per-expert state dict."""
    quant: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    for n, t in state.items():
        if not quantized(n, tuple(t.shape)):
            quant[n] = twin[n] = t
            continue
        w, s = fp8_block.quantize(t, two_bit_scales)
        deq = fp8_block.dequantize(w, s)
        quant.update({n: w, n[: -len("weight")] + "weight_scale_inv": s})
        twin[n] = deq.to(t.dtype)
        if not torch.equal(twin[n].float(), deq):
            raise AssertionError(f"{n}: dequantized weights are not exact in {t.dtype}")
    return quant, twin
