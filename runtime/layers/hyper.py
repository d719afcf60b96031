"""Manifold-constrained hyper-connections (mHC, deepseek_v4): the residual is `n = hc_mult` parallel streams.

Every block (attention, MLP) reads one collapsed stream and writes back into all of them (transformers'
DeepseekV4HyperConnection). With streams s [T, n, H] and f = rms_normalize(flatten(s)) [T, n·H] (unweighted, fp32):
    [p | q | c] = fᵀ·fn + ... : p, q [T, n], c [T, n, n]  (fn [(2 + n)·n, n·H], base [(2 + n)·n], scale [3])
    pre  = σ(p·scale0 + base_p) + hc_eps             the block's input: x = Σ_j pre_j · s_j
    post = 2·σ(q·scale1 + base_q)                    how the block's output y spreads over the streams
    comb = Sinkhorn(softmax(c·scale2 + base_c) + hc_eps), `hc_sinkhorn_iters` alternations (columns first), each
           division by (sum + hc_eps): close to doubly stochastic
    new streams s'_k = post_k · y + Σ_j comb_jk · s_j
The head (`HyperHead`, before the final norm) collapses the streams once more with its own `pre` (no post, no comb).
All the mixing weights are fp32; the streams keep the compute dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ft.runtime.layers.base import REQUIRED, Op
from ft.runtime.layers.norm import rms_normalize


class HyperConnection(Op):
    """`fn` [(2 + n)·n, n·H], `base` [(2 + n)·n], `scale` [3], all fp32."""

    def __init__(self, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        if hc_mult < 1 or sinkhorn_iters < 1:
            raise ValueError(f"hc_mult and hc_sinkhorn_iters must be >= 1, got {hc_mult}, {sinkhorn_iters}")
        self.fn: torch.Tensor = REQUIRED
        self.base: torch.Tensor = REQUIRED
        self.scale: torch.Tensor = REQUIRED
        self._n, self._iters, self._eps, self._norm_eps = hc_mult, sinkhorn_iters, hc_eps, norm_eps

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, H] -> (post [T, n] fp32, comb [T, n, n] fp32, the block's input [T, H] in streams' dtype)."""
        n, eps = self._n, self._eps
        mixes = F.linear(rms_normalize(streams.flatten(1), self._norm_eps), self.fn.float())
        p, q, c = mixes.split([n, n, n * n], dim=-1)
        bp, bq, bc = self.base.float().split([n, n, n * n])
        s = self.scale.float()
        pre = torch.sigmoid(p * s[0] + bp) + eps
        post = 2 * torch.sigmoid(q * s[1] + bq)
        comb = torch.softmax(c.view(-1, n, n) * s[2] + bc.view(n, n), dim=-1) + eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        for _ in range(self._iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def expand(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """streams [T, n, H], the block's output out [T, H] -> new streams [T, n, H] (post and comb cast to the
        streams' dtype first, as transformers does)."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                                streams)


class HyperHead(Op):
    """`hc_fn` [n, n·H], `hc_base` [n], `hc_scale` [1], fp32: streams [T, n, H] -> [T, H]."""

    def __init__(self, hc_mult: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_fn: torch.Tensor = REQUIRED
        self.hc_base: torch.Tensor = REQUIRED
        self.hc_scale: torch.Tensor = REQUIRED
        self._n, self._eps, self._norm_eps = hc_mult, hc_eps, norm_eps

    def __call__(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(rms_normalize(streams.flatten(1), self._norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self._eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
