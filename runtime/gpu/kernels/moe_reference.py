"""PyTorch reference for the expert math on records (the kernels' test oracle and the no-Triton fallback).

Weights dequantize exactly by the record's format (`ft.formats.quant`): NVFP4 `E2M1 * f32(e4m3 scale per 16) *
scale_2[o]`, MXFP4 `E2M1 * 2^(e8m0 scale per 32 - 127)`. Expert `y = down @ act(g, u) (+ down_bias)` with
`[g; u] = gate_up @ x (+ gate_up_bias)`, `act` the layout's (`silu(g) * u`, gpt_oss's clamped SwiGLU or
deepseek_v4's clamped silu, `ft.runtime.experts`). Activations are bf16 (W4A16): x enters as bf16, the activation is
rounded to bf16 before `down`, accumulation is fp32.
"""

from __future__ import annotations

import torch

from ft.formats.quant import mxfp4, nvfp4

from ..record_layout import RecordLayout


def dequant_nvfp4(codes: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """codes u8 [R, C/2], scale e4m3 [R, C/16], scale_2 f32 [R] -> f32 [R, C] (exact; the format's own formula)."""
    return nvfp4.dequantize(codes, scale, scale_2).float()


def expert_weights(record: torch.Tensor, layout: RecordLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized (gate_up f32 [2I, H], down f32 [H, I]) of one uint8 record."""
    v = lambda n: layout.view(record, n)  # noqa: E731
    if layout.scheme == "mxfp4":
        return mxfp4.dequantize(v("gate_up"), v("gate_up_scale")), mxfp4.dequantize(v("down"), v("down_scale"))
    gate_up = dequant_nvfp4(v("gate_up"), v("gate_up_scale"), v("gate_up_scale_2"))
    down = dequant_nvfp4(v("down"), v("down_scale"), v("down_scale_2"))
    return gate_up, down


def activation(g: torch.Tensor, u: torch.Tensor, layout: RecordLayout) -> torch.Tensor:
    """The layout's gated activation of fp32 g, u [n, I] (fp32)."""
    if layout.act == "silu":
        return torch.nn.functional.silu(g) * u
    g = g.clamp(max=layout.limit)
    u = u.clamp(min=-layout.limit, max=layout.limit)
    if layout.act == "clamped_silu":
        return torch.nn.functional.silu(g) * u
    return (u + 1) * (g * torch.sigmoid(g * layout.alpha))


def expert_forward_ref(record: torch.Tensor, layout: RecordLayout, x: torch.Tensor) -> torch.Tensor:
    """x [n, H] -> f32 [n, H] for one expert record (W4A16 semantics)."""
    gate_up, down = expert_weights(record, layout)
    gu = x.to(torch.bfloat16).float() @ gate_up.T
    bias = layout.off_down_bias >= 0
    if bias:
        gu = gu + layout.view(record, "gate_up_bias").float()
    g, u = gu[:, : layout.inter], gu[:, layout.inter :]
    act = activation(g, u, layout).to(torch.bfloat16).float()
    y = act @ down.T
    return y + layout.view(record, "down_bias").float() if bias else y


def moe_ref(
    records: torch.Tensor, layout: RecordLayout, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """records u8 [S, stride]; x [T, H]; slots int [T, k] (-1 = skip this pair); weights [T, k] -> f32 [T, H]."""
    out = torch.zeros(x.shape[0], layout.hidden, dtype=torch.float32, device=x.device)
    for s in torch.unique(slots[slots >= 0]).tolist():
        t_idx, k_idx = torch.nonzero(slots == s, as_tuple=True)
        y = expert_forward_ref(records[s], layout, x[t_idx])
        out.index_add_(0, t_idx, y * weights[t_idx, k_idx].float()[:, None])
    return out
