"""Gated DeltaNet (linear attention of qwen3_next / qwen3_5_moe).

Per token, after the projections (`in_proj_qkvz` rows `[q (Hk·dk) | k (Hk·dk) | v (Hv·dv) | z (Hv·dv)]`,
`in_proj_ba` rows `[b (Hv) | a (Hv)]`):
1. `[q | k | v]` goes through a causal depthwise conv1d (kernel K, no bias) + SiLU; the conv state keeps the last
   K-1 inputs of the sequence so a decode step sees the same window a one-shot prefill would.
2. q, k are L2-normalised per head (eps 1e-6, fp32) and q is scaled by dk^-0.5; key head j serves value heads
   j·r … j·r+r-1 (r = Hv/Hk).
3. `β = σ(b)`, `g = -exp(A_log) · softplus(a + dt_bias)` (fp32); per value head, state `S [dk, dv]`:
   `S ← exp(g)·S;  δ = β·(v − Sᵀk);  S ← S + k δᵀ;  o = Sᵀq`.
4. `o` goes through RMSNormGated with z (per value head), then `out_proj`.
Step 3 runs token by token for decode (`recurrent_gated_delta_rule`) and in chunks of 64 for prefill
(`chunk_gated_delta_rule`, the UT-transform form); both compute the same recurrence.
With `_fused` (CUDA; the torch code here stays the reference and the CPU path), a decode batch runs steps 1-4 in the
two Triton kernels of `gpu.kernels.deltanet_decode` (states found through `ForwardBatch.tables`), and a segment of
more than one token runs step 3 in the Triton chunked kernels of `ft.runtime.gpu.kernels.deltanet_prefill`.
Steps 1-3 of a long segment run in pieces of at most PIECE tokens (multiples of CHUNK, so the chunking and the result
are those of one call; the conv and recurrent states carry from piece to piece): their fp32 temporaries, ~230 KiB per
token for Qwen3.6, then take ~230 MiB instead of ~900 MiB for a 4,096-token prefill chunk (`sizing.activation_reserve`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ft.formats.config import ModelConfig
from ft.runtime.layers.base import REQUIRED, Op
from ft.runtime.layers.batch import ForwardBatch
from ft.runtime.layers.linear import Linear, gemv_eligible, linear, stack_rows
from ft.runtime.layers.norm import RMSNormGated

CHUNK = 64
PIECE = 16 * CHUNK  # tokens of one segment's steps 1-3 at a time (module docstring)


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """q, k [T, H, dk]; v [T, H, dv]; g, beta [T, H]; state [H, dk, dv] (all fp32, q already normalised and scaled).
    Returns (o [T, H, dv], new state)."""
    out = torch.empty_like(v)
    s = state
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        kv = torch.einsum("hkv,hk->hv", s, k[t])
        delta = (v[t] - kv) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", s, q[t])
    return out, s


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK):
    """Same contract as `recurrent_gated_delta_rule`, computed `chunk` tokens at a time.

    Within a chunk with cumulative log-decay G (G_i = g_1 + … + g_i) and D[i, j] = exp(G_i − G_j) for j ≤ i (else 0):
    the deltas solve `(I + tril₋₁((β k) kᵀ ∘ D)) δ = β v − (β k e^G) S₀`, the outputs are
    `o = (q e^G) S₀ + ((q kᵀ) ∘ D) δ`, and the state leaves the chunk as `e^{G_n} S₀ + (k e^{G_n − G})ᵀ δ`.
    All exponents are ≤ 0, so nothing overflows."""
    q, k, v = (a.transpose(0, 1) for a in (q, k, v))           # [H, T, d]
    g, beta = g.transpose(0, 1), beta.transpose(0, 1)           # [H, T]
    out = torch.empty_like(v)
    s = state
    for c0 in range(0, q.shape[1], chunk):
        c1 = min(c0 + chunk, q.shape[1])
        n = c1 - c0
        qc, kc, vc, bc = q[:, c0:c1], k[:, c0:c1], v[:, c0:c1], beta[:, c0:c1, None]
        cum = g[:, c0:c1].cumsum(-1)                            # [H, n]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()   # [H, n, n]
        kb = kc * bc
        system = ((kb @ kc.transpose(-1, -2)) * decay).tril(-1)
        rhs = torch.cat((vc * bc, kb * cum.exp()[..., None]), dim=-1)
        sol = torch.linalg.solve_triangular(system + torch.eye(n, device=q.device), rhs, upper=False,
                                            unitriangular=True)
        u, w = sol.split([v.shape[-1], k.shape[-1]], dim=-1)
        delta = u - w @ s                                       # [H, n, dv]
        intra = (qc @ kc.transpose(-1, -2)) * decay
        out[:, c0:c1] = (qc * cum.exp()[..., None]) @ s + intra @ delta
        last = cum[:, -1:]                                      # [H, 1]
        s = s * last.exp()[..., None] + (kc * (last - cum).exp()[..., None]).transpose(-1, -2) @ delta
    return out.transpose(0, 1), s


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class Conv1d(Op):
    """Depthwise causal conv, `weight [channels, K]`, channel order `[q | k | v]`."""

    def __init__(self) -> None:
        super().__init__()
        self.weight: torch.Tensor = REQUIRED

    def __call__(self, x: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
        """x [T, C]; conv_state [C, K-1] (the previous K-1 inputs, zeros at sequence start; updated in place)
        -> silu(conv(x)) [T, C]."""
        t, taps = x.shape[0], self.weight.shape[1]
        window = torch.cat((conv_state, x.transpose(0, 1).to(conv_state.dtype)), dim=-1)    # [C, K-1+T]
        if conv_state.shape[-1]:
            conv_state.copy_(window[:, -conv_state.shape[-1]:])
        # y[c, t] = sum_j w[c, j] · window[c, t + j], tap by tap in fp32 (no [C, T, K] temporary, no TF32 conv).
        w = self.weight.float()
        y = w[:, :1] * window[:, :t].float()
        for j in range(1, taps):
            y.addcmul_(window[:, j:j + t], w[:, j:j + 1])  # promoted to fp32 in place: no temporary per tap
        return F.silu(y, inplace=True).transpose(0, 1).to(x.dtype)


class GatedDeltaNet(Op):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.in_proj_qkvz = Linear()
        self.in_proj_ba = Linear()
        self.conv1d = Conv1d()
        self.dt_bias: torch.Tensor = REQUIRED     # [Hv] fp32
        self.A_log: torch.Tensor = REQUIRED       # [Hv] fp32
        self.norm = RMSNormGated(cfg.rms_norm_eps)
        self.out_proj = Linear()
        self._layer = layer
        self._hk, self._hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self._dk, self._dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self._key_dim, self._value_dim = self._hk * self._dk, self._hv * self._dv
        self._qkvzba: torch.Tensor | None = None  # both input projections' rows, stacked (`stack_linears`)
        self._qkvzba_gemv = False                 # ... and eligible for the dense GEMV at decode (`linear`)

    def stack_linears(self) -> None:
        """At load, on a GPU: in_proj_qkvz and in_proj_ba become views of one weight, one GEMM per call."""
        self._qkvzba = stack_rows([self.in_proj_qkvz, self.in_proj_ba])
        self._qkvzba_gemv = self._qkvzba is not None and gemv_eligible(self._qkvzba)

    @property
    def conv_dim(self) -> int:
        return 2 * self._key_dim + self._value_dim

    def __call__(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        n = x.shape[0]                                                          # x [N, H]
        if self._qkvzba is not None:
            mixed, z, b, a = linear(x, self._qkvzba, gemv=self._qkvzba_gemv and self._fused).split(
                [self.conv_dim, self._value_dim, self._hv, self._hv], -1)
        else:
            mixed, z = self.in_proj_qkvz(x).split([self.conv_dim, self._value_dim], dim=-1)
            b, a = self.in_proj_ba(x).split([self._hv, self._hv], dim=-1)
        if batch.decode and self._fused:      # one token per sequence, states found through the tables on the device
            from ft.runtime.gpu.kernels.deltanet_decode import gdn_decode
            core = gdn_decode(mixed, z, b, a, self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight,
                              self.norm._eps, batch.tables[self._layer], hk=self._hk, hv=self._hv, dk=self._dk,
                              dv=self._dv)
            return self.out_proj(core)
        beta = torch.sigmoid(b).float()                                         # [N, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)    # [N, Hv]

        core = torch.empty(n, self._hv, self._dv, dtype=x.dtype, device=x.device)
        for seg in batch.segments:
            for start in range(seg.start, seg.start + seg.num_tokens, PIECE):
                rows = slice(start, min(start + PIECE, seg.start + seg.num_tokens))
                core[rows] = self._rule(mixed[rows], g[rows], beta[rows], seg.state, x.dtype)
        core = self.norm(core, z.reshape(n, self._hv, self._dv))
        return self.out_proj(core.reshape(n, self._value_dim))

    def _rule(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state, dtype: torch.dtype):
        """Steps 1-3 for T consecutive tokens of one sequence: mixed [T, conv_dim]; g, beta [T, Hv] fp32; the
        sequence's conv and recurrent states updated in place -> o [T, Hv, dv] in `dtype`."""
        conv_state = state.conv[self._layer]                                 # [conv_dim, K-1]
        rec_state = state.recurrent[self._layer]                             # [Hv, dk, dv] fp32
        qkv = self.conv1d(mixed, conv_state)
        q, k, v = qkv.float().split([self._key_dim, self._key_dim, self._value_dim], dim=-1)
        t = mixed.shape[0]
        q = l2_normalize(q.reshape(t, self._hk, self._dk)) * self._dk ** -0.5
        k = l2_normalize(k.reshape(t, self._hk, self._dk))
        v = v.reshape(t, self._hv, self._dv)
        if self._fused and t > 1:   # Triton chunked rule (key heads not repeated), rec_state updated in place
            from ft.runtime.gpu.kernels.deltanet_prefill import gdn_chunk_prefill
            # an fp32 model gets fp32 products (TF32 would be below its precision; bf16 models keep TF32)
            o = gdn_chunk_prefill(q, k, v, g, beta, rec_state,
                                  config={"precision": "ieee"} if dtype == torch.float32 else None)
        else:
            r = self._hv // self._hk
            if r > 1:
                q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)
            rule = chunk_gated_delta_rule if t > 1 else recurrent_gated_delta_rule
            o, new_state = rule(q, k, v, g, beta, rec_state)
            rec_state.copy_(new_state)
        return o.to(dtype)
