"""DeepSeek-V4's release layout (DeepSeek-V4-Flash / -Pro, `ft synth --arch deepseek_v4 --quant fp4`): block-FP8
dense linears with E8M0 scales and FP4 routed experts, as transformers' `FineGrainedFP8Config(scale_fmt="ue8m0",
expert_dtype="fp4")` reads them.

FP8 (e4m3, 128x128 tiles): attention wq_a / wq_b / wkv / wo_a / wo_b, the indexer's wq_b, the shared experts' w1 /
w2 / w3. Left in the checkpoint dtype, as the release leaves them: embeddings, head, norms, routers (`ffn.gate`), the
compressors' wkv / wgate (also the indexer's), the indexer's weights_proj, hyper-connections, sinks, position biases.
Tensors per FP8 linear X: `X.weight` float8_e4m3fn [N, K] and `X.scale` float8_e8m0fnu [ceil(N/128), ceil(K/128)]
(the release's name for `weight_scale_inv`; transformers renames it on load), each scale the power of two
2^ceil(log2(amax / 448)) (transformers' ue8m0 rounding in `Fp8Quantize`).
Routed experts `ffn.experts.{e}.w{1,2,3}`: `weight` int8 [N, K/2], two E2M1 codes per byte, element 2j in the low
nibble (transformers' `Fp8Dequantize._unpack_fp4`), and `scale` float8_e8m0fnu [N, K/32], one power of two per 32
inputs (`ft.formats.quant.mxfp4`'s encoder; the same bytes as an MXFP4 bank record).
config.json: `quantization_config` {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
"scale_fmt": "ue8m0", "weight_block_size": [128, 128]} and, as V4 writes it, a top-level `"expert_dtype": "fp4"`.

Exact twin (`<out>-twin`, transformers' save_pretrained names, no quantization_config): e4m3 times a power of two,
and E2M1 times a power of two, are exact in float32 and in bfloat16 at these magnitudes; checked tensor by tensor.
"""

from __future__ import annotations

import re

import torch

from ft.compiler.quant import fp8_block
from ft.compiler.synth.tables import TensorSpec
from ft.formats.quant import mxfp4

_FP8 = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.(w1|w2|w3))\.weight$")
_FP4 = re.compile(r"\.ffn\.experts\.\d+\.(w1|w2|w3)\.weight$")
CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
          "weight_block_size": [128, 128]}
EXPERT_DTYPE = "fp4"


def kind(name: str, shape: tuple[int, ...]) -> str | None:
    """"fp8", "fp4" or None (kept) for the tensor `name` of the unquantized table."""
    if len(shape) != 2 or name.startswith("mtp."):
        return None
    return "fp8" if _FP8.search(name) else "fp4" if _FP4.search(name) else None


def _scale_name(name: str) -> str:
    return name[: -len("weight")] + "scale"


def quantized_table(table: list[TensorSpec]) -> list[TensorSpec]:
    out = []
    for t in table:
        k = kind(t.name, t.shape)
        if k == "fp8":
            out += [TensorSpec(t.name, t.shape, torch.float8_e4m3fn),
                    TensorSpec(_scale_name(t.name), fp8_block.grid(*t.shape), torch.float8_e8m0fnu)]
        elif k == "fp4":
            n, K = t.shape
            out += [TensorSpec(t.name, (n, K // 2), torch.int8),
                    TensorSpec(_scale_name(t.name), (n, K // mxfp4.BLOCK), torch.float8_e8m0fnu)]
        else:
            out.append(t)
    return out


def pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """Each positive scale rounded up to a power of two (transformers' ue8m0 rule: 2^ceil(log2(s)))."""
    return torch.exp2(torch.ceil(torch.log2(s.float())))


def quantize_state(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(release tensors, exact twin with the original names) from an unquantized per-expert state dict."""
    quant: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    for n, t in state.items():
        k = kind(n, tuple(t.shape))
        if k is None:
            quant[n] = twin[n] = t
            continue
        if k == "fp8":
            w, s = fp8_block.quantize(t, pow2_ceil)
            deq = fp8_block.dequantize(w, s)
            quant.update({n: w, _scale_name(n): fp8_block.e8m0(s)})
        else:
            if t.shape[-1] % mxfp4.BLOCK:
                raise ValueError(f"{n}: FP4 experts need in_features % {mxfp4.BLOCK} == 0, got {list(t.shape)}")
            blocks, scales = mxfp4.quantize(t)
            deq = mxfp4.dequantize(blocks, scales)
            quant.update({n: blocks.view(torch.int8), _scale_name(n): scales.view(torch.float8_e8m0fnu)})
        twin[n] = deq.to(t.dtype)
        if not torch.equal(twin[n].float(), deq):
            raise AssertionError(f"{n}: dequantized weights are not exact in {t.dtype}")
    return quant, twin
