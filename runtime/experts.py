"""Routed experts on the CPU, straight from the mmapped expert banks.

Implements the experts interface `experts(layer, x [T, H], topk_ids [T, k] int64, topk_weights [T, k] f32) -> [T, H]`.
Tokens are grouped by expert; for each routed expert e, its components are read from the bank record (zero-copy
views), a quantized expert is dequantized on its own into the compute dtype (never the whole bank), and
`y = down · (silu(g) ⊙ u)` with `[g; u] = gate_up · x` is accumulated with the router weights, experts in increasing
index order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ft.formats import ExpertBankView, FtwReader, ModelConfig
from ft.formats.dtypes import torch_dtype
from ft.formats.quant import nvfp4

PLAIN = ("bf16", "fp16", "fp32")


def bank_name(layer: int) -> str:
    return f"layers.{layer}.mlp.experts"


def expected_components(scheme: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    """Component shapes of one expert record (specs/families.md, "Expert banks")."""
    if scheme in PLAIN:
        return {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}
    if scheme == "nvfp4":
        return {"gate_up": (2 * inter, hidden // 2), "gate_up_scale": (2 * inter, hidden // 16),
                "gate_up_scale_2": (2 * inter,), "down": (hidden, inter // 2),
                "down_scale": (hidden, inter // 16), "down_scale_2": (hidden,)}
    raise ValueError(f"unsupported expert scheme {scheme!r}; supported: {', '.join(PLAIN)}, nvfp4")


class CpuExperts:
    """The default experts implementation (see the module docstring)."""

    def __init__(self, reader: FtwReader, config: ModelConfig, *, dtype: torch.dtype) -> None:
        self.dtype = dtype
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
        if self.banks[layer].scheme == "nvfp4":
            return nvfp4.dequantize(self.view(layer, e, comp), self.view(layer, e, f"{comp}_scale"),
                                    self.view(layer, e, f"{comp}_scale_2")).to(self.dtype)
        return self.view(layer, e, comp).to(self.dtype)

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
            g, u = F.linear(x[tokens], self.weight(layer, e, "gate_up")).chunk(2, dim=-1)
            y = F.linear(F.silu(g) * u, self.weight(layer, e, "down"))
            out[tokens] += y * flat_w[slots, None]     # a token routes to an expert at most once: no duplicates
        return out.to(device)


def check_bank(bank: ExpertBankView, config: ModelConfig) -> None:
    """Refuse a bank whose scheme, expert count or component shapes disagree with the config."""
    want = expected_components(bank.scheme, config.hidden_size, config.moe_intermediate_size)
    got = {name: tuple(c.shape) for name, c in bank.components.items()}
    if bank.num_experts != config.num_experts:
        raise ValueError(f"bank {bank.name}: {bank.num_experts} experts, config says {config.num_experts}")
    if got != want:
        raise ValueError(f"bank {bank.name} ({bank.scheme}): components {got}, expected {want}")
    if bank.scheme in PLAIN:
        dt = torch_dtype(bank.components["gate_up"].dtype)
        if dt != {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[bank.scheme]:
            raise ValueError(f"bank {bank.name}: scheme {bank.scheme} but components are {dt}")
