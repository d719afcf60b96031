"""Sparse MoE block: softmax or sigmoid router, routed experts through the experts interface, optional shared expert.

Softmax router (`router_scoring = softmax`, every family but glm4_moe): `p = softmax(x · gateᵀ)` in fp32, top-k over p,
divided by the top-k sum iff `norm_topk_prob` (the compiler sets it true for mixtral and qwen3_5_moe).
Sigmoid router (glm4_moe; `route_sigmoid`, transformers' Glm4MoeTopkRouter): `s = σ(fp32(x) · fp32(gate)ᵀ)`; the
choice uses `c = s + e_score_correction_bias`, restricted to the `topk_group` best of `n_group` equal expert groups
(a group's score: the sum of its two largest c); the weights are `s` at the chosen ids (never the bias), divided by
their sum + 1e-20 iff `norm_topk_prob`, times `routed_scaling_factor`. Routed experts are computed by whatever
implements `experts(layer, x [T, H], topk_ids [T, k] int64, topk_weights [T, k] f32) -> [T, H]`
(CPU from the mmapped bank by default, a GPU cache/offload scheduler otherwise). Shared expert (qwen2_moe, qwen3_next,
qwen3_5_moe): `y += sigmoid(shared_expert_gate · x) · shared_expert(x)`; ungated (glm4_moe, `shared_expert_gate`
false): `y += shared_expert(x)`.

With `_fused` set (CUDA) the routing (softmax, top-k, renorm) and the shared expert's gated add are one Triton launch
each (`gpu.kernels.fused_ops.route_topk`, `sigmoid_gate_add`); at decode sizes (T <= `router.MAX_TOKENS`, plain
router, its bias included) the router GEMV, the routing and the shared expert gate's GEMV are one launch together
(`gpu.kernels.router.router_topk`); the sigmoid router likewise: its selection in one launch (`route_topk` with a
`SigmoidRoute`), and at decode sizes the fp32 router GEMV with it (`router_topk`). `route`, `route_sigmoid` and the
torch expressions are the reference. Ties among probabilities may select different ids of equal weight (see
`route_topk`).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from ft.formats.config import ModelConfig
from ft.runtime.layers.base import REQUIRED, Op
from ft.runtime.layers.linear import Linear
from ft.runtime.layers.mlp import GatedMLP


class ExpertsFn(Protocol):
    def __call__(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor: ...


class BoundExperts:
    """One layer's view of the experts interface (what `layers.{i}.mlp.experts` binds to)."""

    def __init__(self, fn: ExpertsFn, layer: int) -> None:
        self.fn, self.layer = fn, layer

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return self.fn(self.layer, x, topk_ids, topk_weights)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (topk_ids [T, k] int64, topk_weights [T, k] f32)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def route_sigmoid(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int, topk_group: int,
                  renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits [T, E], bias [E] fp32 or None -> (topk_ids [T, k] int64, topk_weights [T, k] f32)."""
    scores = logits.float().sigmoid()
    choice = scores if bias is None else scores + bias
    if n_group > 1:
        t, e = choice.shape
        group_scores = choice.view(t, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)       # [T, n_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1, sorted=False)[1], True)
        choice = choice.masked_fill(~keep.repeat_interleave(e // n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * scale


def route_sqrtsoftplus(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, scale: float,
                       hashed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """deepseek_v4's routers: logits [T, E] -> (topk_ids [T, k] int64, topk_weights [T, k] f32).
    `s = sqrt(softplus(logits))` in fp32; the ids are the top-k of `s + bias` (the correction bias [E] fp32, for
    selection only), or, on hash layers, `hashed` [T, k] (the frozen table `tid2eid` read at the token ids); the
    weights are `s` at the ids divided by their sum + 1e-20 (always), times `scale` (routed_scaling_factor)."""
    scores = F.softplus(logits.float()).sqrt()
    if hashed is not None:
        ids = hashed.long()
    else:
        ids = (scores if bias is None else scores + bias).topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    return ids, weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * scale


class SparseMoe(Op):
    banks = ("experts",)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Linear()                       # router [E, H], never quantized
        self.experts: BoundExperts = REQUIRED      # bound to the expert bank `layers.{i}.mlp.experts` at load
        if cfg.shared_expert_intermediate_size > 0:
            self.shared_expert = GatedMLP()
            if cfg.shared_expert_gate:
                self.shared_expert_gate = Linear()     # [1, H]
        if cfg.router_correction_bias:
            self.e_score_correction_bias: torch.Tensor = REQUIRED  # [E] fp32
        self._top_k, self._renorm = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self._sigmoid = cfg.router_scoring == "sigmoid"
        self._groups = (cfg.router_n_group, cfg.router_topk_group)
        self._scale = cfg.routed_scaling_factor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shared_gate = None                                 # [T, 1] when the fused router computed it
        if self._sigmoid:
            ids, weights = self._route_sigmoid(x)
        elif self._fused:
            from ft.runtime.gpu.kernels import fused_ops, router
            if x.shape[0] <= router.MAX_TOKENS and _plain(self.gate, x, biased=True):      # decode: one launch
                sg = getattr(self, "shared_expert_gate", None)
                extra = sg.weight if sg is not None and _plain(sg, x) else None
                ids, weights, shared_gate = router.router_topk(x, self.gate.weight, self._top_k, self._renorm, extra,
                                                               bias=self.gate.bias)
            else:
                ids, weights = fused_ops.route_topk(self.gate(x), self._top_k, self._renorm)   # x [T, H]
        else:
            ids, weights = route(self.gate(x), self._top_k, self._renorm)
        y = self.experts(x, ids, weights)
        if hasattr(self, "shared_expert") and not hasattr(self, "shared_expert_gate"):
            if self._fused:  # one PDL launch instead of torch's add
                from ft.runtime.gpu.kernels import fused_ops
                return fused_ops.sigmoid_gate_add(y, None, self.shared_expert(x))
            return y + self.shared_expert(x)
        if hasattr(self, "shared_expert"):
            gate = self.shared_expert_gate(x) if shared_gate is None else shared_gate     # [T, 1]
            shared = self.shared_expert(x)                                                 # [T, H]
            if self._fused:
                from ft.runtime.gpu.kernels import fused_ops
                return fused_ops.sigmoid_gate_add(y, gate, shared)
            y = y + torch.sigmoid(gate) * shared
        return y


    def _route_sigmoid(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bias = getattr(self, "e_score_correction_bias", None)
        if not self._fused:
            return route_sigmoid(F.linear(x.float(), self.gate.weight.float()), bias, self._top_k, *self._groups,
                                 self._renorm, self._scale)
        from ft.runtime.gpu.kernels import fused_ops, router
        from ft.runtime.gpu.kernels.sigmoid_topk import SigmoidRoute

        how = SigmoidRoute(bias, *self._groups, self._scale)
        if x.shape[0] <= router.MAX_TOKENS and _plain(self.gate, x, any_float=True):          # decode: one launch
            return router.router_topk(x, self.gate.weight, self._top_k, self._renorm, sigmoid=how)[:2]
        return fused_ops.route_topk(F.linear(x.float(), self.gate.weight.float()), self._top_k, self._renorm, how)


def _plain(linear: Linear, x: torch.Tensor, *, any_float: bool = False, biased: bool = False) -> bool:
    """The fused router reads `linear.weight` directly: a plain (not kept quantized), contiguous weight in x's dtype
    (`any_float`: in any float dtype, for the sigmoid router's fp32 GEMV), bias-free (`biased`: or a contiguous [E]
    bias in x's dtype, gpt-oss's router)."""
    w, b = linear.weight, linear.bias
    dtype_ok = w.is_floating_point() and w.element_size() >= 2 if any_float else w.dtype == x.dtype
    bias_ok = b is None or (biased and b.dtype == x.dtype and b.dim() == 1 and b.is_contiguous())
    return not linear.stays_quantized and bias_ok and dtype_ok and w.is_contiguous()
