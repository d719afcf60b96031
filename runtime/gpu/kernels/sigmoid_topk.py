"""The selection step of sigmoid MoE routing (glm4_moe, glm_moe_dsa) as a Triton device function, shared by the
prefill routing kernel (`fused_ops.route_topk`) and the one-launch decode router (`router.router_topk`).

  _sigmoid_topk(z fp32 [R, BE] logits, valid [1, BE], bias row pointer, scale, E; K, RENORM, N_GROUP, TOPK_GROUP)
      -> (top_w fp32 [R, BK], top_i int32 [R, BK])
  equals `layers/moe.py route_sigmoid`: s = sigmoid(z); c = s + bias (selection only); when N_GROUP > 1, c is kept
  only in the TOPK_GROUP groups (E / N_GROUP consecutive experts each) with the largest sum of their two largest c;
  the K largest c give the ids, s at the ids the weights, divided by their sum + 1e-20 iff RENORM, times scale.

Order and ties: ids come out in descending c, ties by ascending expert id, and group ties go to the lower group
(torch.topk's order among ties is unspecified: the reference may pick a different id of equal c). Each of the
N_GROUP + TOPK_GROUP + K rounds is one block-wide max (or two), which at decode sizes is latency, not work.

`SigmoidRoute` carries the constants the layer reads from the config; `supported` says whether a routing is within
what the kernels take (else the callers use the reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class SigmoidRoute:
    """The sigmoid router's constants (`ModelConfig.router_*`, `routed_scaling_factor`); bias: the correction bias
    e_score_correction_bias fp32 [E] or None."""
    bias: torch.Tensor | None
    n_group: int
    topk_group: int
    scale: float

    def supported(self, E: int, k: int) -> bool:
        """Groups of at least two experts that split E evenly, and at least k experts in the kept groups."""
        g, kept = self.n_group, self.topk_group
        if g <= 1:
            return 0 < k <= E
        return E % g == 0 and E // g >= 2 and 0 < kept <= g and 0 < k <= kept * (E // g)

    def launch_args(self, fallback: torch.Tensor) -> dict:
        """The kernels' arguments: (bias pointer, HAS_BIAS, scale, N_GROUP, TOPK_GROUP, BLOCK_G)."""
        return dict(bias=fallback if self.bias is None else self.bias, scale=float(self.scale),
                    HAS_BIAS=self.bias is not None, N_GROUP=max(1, self.n_group), TOPK_GROUP=max(1, self.topk_group),
                    BLOCK_G=triton.next_power_of_2(max(1, self.n_group)))


NO_SIGMOID = SigmoidRoute(None, 1, 1, 1.0)  # the launch arguments of a softmax-routed call (SIGMOID off)


@triton.jit
def _sigmoid_topk(z, valid, bias, scale, E, K: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                  N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr):
    e = tl.arange(0, z.shape[1])[None, :]                                          # [1, BE] expert ids
    s = 1.0 / (1.0 + tl.exp(-z))  # [R, BE] the weights' scores (tl.exp: within an ulp or two of torch's sigmoid)
    c = s
    if HAS_BIAS:
        c = s + tl.load(bias + e, mask=e < E, other=0.0).to(tl.float32)
    c = tl.where(valid, c, float("-inf"))                                          # invalid lanes never win
    if N_GROUP > 1:
        grp = e // (E // N_GROUP)                                                  # [1, BE] each expert's group
        g = tl.arange(0, BLOCK_G)[None, :]
        score = tl.full((z.shape[0], BLOCK_G), float("-inf"), tl.float32)         # [R, BG] sum of the two largest
        for gi in tl.static_range(N_GROUP):
            cg = tl.where(grp == gi, c, float("-inf"))
            m1, i1 = tl.max(cg, axis=1, return_indices=True, return_indices_tie_break_left=True)
            m2 = tl.max(tl.where(e == i1[:, None], float("-inf"), cg), axis=1)
            score = tl.where(g == gi, (m1 + m2)[:, None], score)
        taken = score < float("-inf")                                              # [R, BG] all false
        keep = c < float("-inf")                                                   # [R, BE] all false
        for _ in tl.static_range(TOPK_GROUP):
            _, gi = tl.max(tl.where(taken, float("-inf"), score), axis=1, return_indices=True,
                           return_indices_tie_break_left=True)
            taken = taken | (g == gi[:, None])
            keep = keep | (grp == gi[:, None])
        c = tl.where(keep, c, float("-inf"))
    j = tl.arange(0, BLOCK_K)[None, :]
    top_w = tl.zeros((z.shape[0], BLOCK_K), dtype=tl.float32)
    top_i = tl.zeros((z.shape[0], BLOCK_K), dtype=tl.int32)
    chosen = c < float("-inf")                                                     # [R, BE] all false
    for i in tl.static_range(K):
        _, idx = tl.max(tl.where(chosen, float("-inf"), c), axis=1, return_indices=True,
                        return_indices_tie_break_left=True)
        hit = e == idx[:, None]
        top_w = tl.where(j == i, tl.sum(tl.where(hit, s, 0.0), axis=1)[:, None], top_w)
        top_i = tl.where(j == i, idx[:, None], top_i)
        chosen = chosen | hit
    if RENORM:
        top_w = top_w / (tl.sum(top_w, axis=1)[:, None] + 1e-20)                    # lanes >= K hold 0
    return top_w * scale, top_i
