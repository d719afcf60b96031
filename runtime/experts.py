"""Routed experts on the CPU, straight from the mmapped expert banks.

Implements the experts interface `experts(layer, x [T, H], topk_ids [T, k] int64, topk_weights [T, k] f32) -> [T, H]`.
Tokens are grouped by expert; for each routed expert e, its components are read from the bank record (zero-copy
views), a quantized expert (nvfp4, mxfp4) is dequantized on its own into the compute dtype (never the whole bank), and
`y = down · act(g, u)` with `[g; u] = gate_up · x` is accumulated with the router weights, experts in increasing
index order. `act` is `silu(g) ⊙ u`, or for gpt_oss (`expert_act = clamped_swiglu`, with the expert biases added to
both projections) `(clamp(u, -l, l) + 1) ⊙ g' ⊙ sigmoid(alpha · g')` with `g' = min(g, l)`, as transformers computes it,
or for deepseek_v4 (`clamped_silu`) `silu(min(g, l)) ⊙ clamp(u, -l, l)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ft.formats import ExpertBankView, FtwReader, ModelConfig
from ft.formats.dtypes import torch_dtype
from ft.formats.quant import mxfp4, nvfp4

PLAIN = ("bf16", "fp16", "fp32")


def bank_name(layer: int) -> str:
    return f"layers.{layer}.mlp.experts"


def expected_components(scheme: str, hidden: int, inter: int, bias: bool = False) -> dict[str, tuple[int, ...]]:
    """Component shapes of one expert record (specs/families.md, "Expert banks"); `bias`: the config's expert_bias."""
    if scheme in PLAIN:
        if bias:
            return {"gate_up": (2 * inter, hidden), "gate_up_bias": (2 * inter,), "down": (hidden, inter),
                    "down_bias": (hidden,)}
        return {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}
    if scheme == "nvfp4" and not bias:
        return {"gate_up": (2 * inter, hidden // 2), "gate_up_scale": (2 * inter, hidden // 16),
                "gate_up_scale_2": (2 * inter,), "down": (hidden, inter // 2),
                "down_scale": (hidden, inter // 16), "down_scale_2": (hidden,)}
    if scheme == "mxfp4":  # gpt-oss: with biases; DeepSeek-V4's FP4 experts: without
        gate_up = {"gate_up": (2 * inter, hidden // 2), "gate_up_scale": (2 * inter, hidden // 32)}
        down = {"down": (hidden, inter // 2), "down_scale": (hidden, inter // 32)}
        if bias:
            return {**gate_up, "gate_up_bias": (2 * inter,), **down, "down_bias": (hidden,)}
        return {**gate_up, **down}
    if scheme == "nvfp4":
        raise ValueError("expert scheme nvfp4 has no expert biases; the config says expert_bias=True")
    raise ValueError(f"unsupported expert scheme {scheme!r}; supported: {', '.join(PLAIN)}, nvfp4, mxfp4")


def clamped_swiglu(g: torch.Tensor, u: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt_oss's expert activation, in transformers' order of operations (GptOssExperts._apply_gate)."""
    g = g.clamp(max=limit)
    u = u.clamp(min=-limit, max=limit)
    return (u + 1) * (g * torch.sigmoid(g * alpha))


def clamped_silu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """deepseek_v4's expert (and shared expert) activation (transformers' DeepseekV4Experts._apply_gate)."""
    return F.silu(g.clamp(max=limit)) * u.clamp(min=-limit, max=limit)


class CpuExperts:
    """The default experts implementation (see the module docstring)."""

    def __init__(self, reader: FtwReader, config: ModelConfig, *, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._bias = config.expert_bias
        self._act = config.expert_act
        self._alpha, self._limit = config.swiglu_alpha, config.swiglu_limit
        self.banks: dict[int, ExpertBankView] = {}
        self._views: dict[tuple[int, int, str], torch.Tensor] = {}
        for layer, kind in enumerate(config.mlp_types):
            if kind != "moe":
                continue
            if not reader.has_bank(bank_name(layer)):
                raise ValueError(f"{reader.path}: MoE layer {layer} has no expert bank {bank_name(layer)!r}")
            bank = reader.bank(bank_name(layer))
            check_bank(bank, config)
            self.banks[layer] = bank

    def view(self, layer: int, e: int, comp: str) -> torch.Tensor:
        """Zero-copy view of one component of expert e (cached: building it walks the reader and its checksum)."""
        key = (layer, e, comp)
        t = self._views.get(key)
        if t is None:
            t = self._views[key] = self.banks[layer].expert(e, comp)
        return t

    def weight(self, layer: int, e: int, comp: str) -> torch.Tensor:
        """Expert e's `gate_up` or `down` as a [out, in] tensor in the compute dtype (dequantized if needed)."""
        scheme = self.banks[layer].scheme
        if scheme == "nvfp4":
            return nvfp4.dequantize(self.view(layer, e, comp), self.view(layer, e, f"{comp}_scale"),
                                    self.view(layer, e, f"{comp}_scale_2")).to(self.dtype)
        if scheme == "mxfp4":
            return mxfp4.dequantize(self.view(layer, e, comp), self.view(layer, e, f"{comp}_scale")).to(self.dtype)
        return self.view(layer, e, comp).to(self.dtype)

    def expert(self, layer: int, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e of `layer` on x [n, H] (compute dtype) -> [n, H]."""
        b = self._bias
        gate_up = F.linear(x, self.weight(layer, e, "gate_up"),
                           self.view(layer, e, "gate_up_bias").to(self.dtype) if b else None)     # [n, 2I]
        g, u = gate_up.chunk(2, dim=-1)
        if self._act == "silu":
            h = F.silu(g) * u
        elif self._act == "clamped_silu":
            h = clamped_silu(g, u, self._limit)
        else:
            h = clamped_swiglu(g, u, self._alpha, self._limit)
        down_bias = self.view(layer, e, "down_bias").to(self.dtype) if b else None
        return F.linear(h, self.weight(layer, e, "down"), down_bias)

    def __call__(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        device = x.device
        x = x.to("cpu", self.dtype)                                  # [T, H]
        t, k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1).to("cpu")                   # [T·k]
        flat_w = topk_weights.reshape(-1).to("cpu", self.dtype)
        order = torch.argsort(flat_ids, stable=True)                 # slots grouped by expert, ascending
        counts = torch.bincount(flat_ids, minlength=self.banks[layer].num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            slots = order[start:start + n]
            start += n
            tokens = slots // k
            # a token routes to an expert at most once: no duplicate rows in `tokens`
            out[tokens] += self.expert(layer, e, x[tokens]) * flat_w[slots, None]
        return out.to(device)


def check_bank(bank: ExpertBankView, config: ModelConfig) -> None:
    """Refuse a bank whose scheme, expert count or component shapes disagree with the config."""
    want = expected_components(bank.scheme, config.hidden_size, config.moe_intermediate_size, config.expert_bias)
    got = {name: tuple(c.shape) for name, c in bank.components.items()}
    if bank.num_experts != config.num_experts:
        raise ValueError(f"bank {bank.name}: {bank.num_experts} experts, config says {config.num_experts}")
    if got != want:
        raise ValueError(f"bank {bank.name} ({bank.scheme}): components {got}, expected {want}")
    if bank.scheme in PLAIN:
        want_dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[bank.scheme]
        for name, c in bank.components.items():
            if torch_dtype(c.dtype) != want_dt:
                raise ValueError(f"bank {bank.name}: scheme {bank.scheme} but component {name} is {c.dtype}")
    elif bank.scheme == "mxfp4":
        dts = {name: c.dtype for name, c in bank.components.items()}
        want = {"gate_up": "U8", "gate_up_scale": "U8", "gate_up_bias": "F32", "down": "U8", "down_scale": "U8",
                "down_bias": "F32"}
        want = {k: v for k, v in want.items() if k in dts}  # the biases: present iff expert_bias (shapes above)
        if dts != want:
            raise ValueError(f"bank {bank.name} (mxfp4): component dtypes {dts}, expected {want}")
