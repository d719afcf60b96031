"""Expert popularity of synthetic checkpoints: routers, the embedding direction they read, and coverage statistics.

Uniform (`--routing uniform`): router rows are iid N(0, ROUTER_LOGIT_STD^2 / H). Router inputs are dominated by the
token's own (random) embedding (see `weights`), so each token id picks its own pseudo-random experts and a batch of
distinct tokens spreads over all experts, like the balanced routing of a trained MoE.

Zipf-skewed (`--routing skewed`): every token embedding gets a fixed component along one unit direction `u`
(`e_t = g_t - (g_t.u) u + KAPPA * EMBED_STD * u`), which survives the RMSNorm as `x.u ~= kappa_eff` on every token
(kappa_eff = KAPPA / sqrt(1 + (KAPPA^2 - 1) / H): the layers add little to the residual stream). Router row e of a
layer gets `b_e * u` with `b_e = beta_e / kappa_eff`, `beta_e = SKEW_GAIN * sigma_gumbel * (log z_e - mean log z)`,
so expert e's logit carries a bias beta_e on every token. `z` is a Zipf law (z_r = 1 / (r + 1)^ZIPF_S) over a per-layer
random permutation of the experts. sigma_gumbel = ROUTER_LOGIT_STD / sqrt(2 ln E) is the asymptotic scale of the
Gumbel law that the maximum of E normal logits follows (top-1 popularity ~ exp(beta_e / sigma_gumbel) = z_e);
SKEW_GAIN = 1.5 corrects for E being far from asymptotic: measured top-1 choice frequencies then match z within ~10%
for E = 64..512 (E = 8 comes out slightly steeper). The random part of the router is made orthogonal to `u` so the
bias is exactly beta_e. `ft synth` reports the resulting coverage.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

KAPPA = 4.0  # skewed: embedding offset along u, in embedding stds
ROUTER_LOGIT_STD = 2.0  # std of the random part of router logits on a unit-RMS input
ZIPF_S = 1.0
SKEW_GAIN = 1.5
ROUTINGS = ("uniform", "skewed")


def name_seed(seed: int, name: str) -> int:
    """A 63-bit seed that depends only on (seed, name): values never depend on writing order."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little") >> 1


def _gen(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(name_seed(seed, name))


def direction(seed: int, hidden: int) -> torch.Tensor:
    """The unit vector u [H] (float32) that skewed embeddings carry and skewed routers read."""
    u = torch.randn(hidden, generator=_gen(seed, "routing.direction"))
    return u / u.norm()


def popularity(seed: int, layer: int, num_experts: int) -> torch.Tensor:
    """Designed Zipf popularity [E] of one layer (sums to 1); expert order is a per-layer random permutation."""
    ranks = torch.randperm(num_experts, generator=_gen(seed, f"routing.popularity.{layer}"))
    z = 1.0 / (torch.arange(num_experts, dtype=torch.float64) + 1.0) ** ZIPF_S
    pop = torch.empty(num_experts, dtype=torch.float64)
    pop[ranks] = z
    return (pop / pop.sum()).float()


def kappa_eff(hidden: int) -> float:
    return KAPPA / math.sqrt(1.0 + (KAPPA * KAPPA - 1.0) / hidden)


def embedding_rows(seed: int, rows: torch.Tensor, routing: str, std: float) -> torch.Tensor:
    """Embedding rows [T, H] float32 (iid N(0, std^2) on input); skewed: replace the u component by KAPPA * std."""
    check_routing(routing)
    if routing == "uniform":
        return rows
    u = direction(seed, rows.shape[-1])
    return rows - (rows @ u).unsqueeze(-1) * u + (KAPPA * std) * u


def router_weight(seed: int, layer: int, num_experts: int, hidden: int, routing: str,
                  gen: torch.Generator) -> torch.Tensor:
    """Router weight [E, H] float32 of one layer (`layer` = num_layers for an MTP layer)."""
    check_routing(routing)
    xi = torch.randn(num_experts, hidden, generator=gen)
    if routing == "uniform":
        return xi * (ROUTER_LOGIT_STD / math.sqrt(hidden))
    u = direction(seed, hidden)
    xi = xi - (xi @ u).unsqueeze(-1) * u
    logz = popularity(seed, layer, num_experts).log()
    sigma_gumbel = ROUTER_LOGIT_STD / math.sqrt(2.0 * math.log(max(num_experts, 2)))
    beta = SKEW_GAIN * sigma_gumbel * (logz - logz.mean())
    return xi * (ROUTER_LOGIT_STD / math.sqrt(hidden)) + (beta / kappa_eff(hidden)).unsqueeze(-1) * u


def check_routing(routing: str) -> None:
    if routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r}; supported: {', '.join(ROUTINGS)}")


@dataclass(frozen=True)
class Coverage:
    """Expert load of one MoE layer: counts[e] = routed (token, slot) pairs that chose expert e."""

    layer: int
    counts: tuple[int, ...]

    @property
    def used_fraction(self) -> float:
        return sum(c > 0 for c in self.counts) / len(self.counts)

    @property
    def max_over_mean(self) -> float:
        return max(self.counts) * len(self.counts) / max(sum(self.counts), 1)

    @property
    def top_decile_share(self) -> float:
        """Share of all assignments taken by the busiest 10% of experts (0.1 when perfectly balanced)."""
        k = max(1, round(len(self.counts) / 10))
        return sum(sorted(self.counts, reverse=True)[:k]) / max(sum(self.counts), 1)

    @property
    def entropy_ratio(self) -> float:
        """Entropy of the load distribution / ln E (1.0 when perfectly balanced)."""
        p = torch.tensor(self.counts, dtype=torch.float64)
        p = p[p > 0] / p.sum()
        return float(-(p * p.log()).sum() / math.log(len(self.counts))) if len(self.counts) > 1 else 1.0


def coverage_from_ids(topk_ids: list[torch.Tensor], num_experts: int) -> list[Coverage]:
    """One Coverage per layer from the router's chosen ids ([T, k] int tensors, one per MoE layer)."""
    return [Coverage(i, tuple(torch.bincount(ids.reshape(-1), minlength=num_experts).tolist()))
            for i, ids in enumerate(topk_ids)]


def estimate_coverage(embed_rows: torch.Tensor, routers: list[torch.Tensor], top_k: int) -> list[Coverage]:
    """Coverage predicted from weights alone: router inputs taken as the RMS-normalized embeddings of the sampled
    tokens (what the synthetic init makes them approximately). Used for full-size checkpoints, which are not run."""
    x = embed_rows.float()
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    ids = [torch.topk(x @ r.float().T, top_k, dim=-1).indices for r in routers]
    return coverage_from_ids(ids, routers[0].shape[0]) if routers else []


def summary(cov: list[Coverage]) -> str:
    """One line over all layers: worst used fraction, mean max/mean load, mean top-10% share, mean entropy ratio."""
    if not cov:
        return "no MoE layers"
    n = len(cov)
    return (f"{n} MoE layers: experts used >= {min(c.used_fraction for c in cov):.0%}, "
            f"max/mean load {sum(c.max_over_mean for c in cov) / n:.2f}, "
            f"top-10% experts take {sum(c.top_decile_share for c in cov) / n:.0%}, "
            f"load entropy {sum(c.entropy_ratio for c in cov) / n:.2f} of max")
