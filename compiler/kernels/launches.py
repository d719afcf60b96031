"""The kernel launches serving makes for one model, replayed through the runtime's own launchers with CPU tensors of
the real shapes (inside `stand_in.cuda_target`, where each launch compiles for the target and runs nothing).

What varies at run time is enumerated so that every specialization a launch can get is covered: decode batches of
1..MAX_DECODE tokens (graph buckets, eager steps, and prompts of up to 16 tokens; the per-sequence attention and
DeltaNet decode kernels up to MAX_BATCH sequences), prefill chunks of every length
class up to `max_prefill` (1..64, then around each power of two: integers specialize on == 1 and divisibility by 16,
and the launchers derive tile sizes from powers of two), every MoE layer index, attention split counts (a function of
the GPU's SM count), resident and mapped expert paths, and the buffers the runtime really passes where their layout
changes a specialization (decode positions and tables inside one buffer, `decode_inputs`; int32 pair ids of the
mapped path; the CPU lane's calibration gathers), in the dtypes it passes (cos / sin in the compute dtype, norms in
fp32; both output dtypes of the decode MoE kernels). A launch repeated with the same specialization costs a lookup.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

MAX_DECODE = 16  # dense_gemv.MAX_TOKENS, router.MAX_TOKENS: decode-sized calls
MAX_BATCH = 64  # decode batches (--max-running-requests) the per-sequence decode kernels are built for
ADDR = 1 << 40  # a device / mapped host address: 64-bit, 16-byte aligned (never dereferenced here)
F32 = torch.float32


@dataclass(frozen=True)
class Geometry:
    H: int
    I: int
    layers: int
    E: int
    k: int
    nq: int
    nkv: int
    hd: int
    rd: int
    gated: bool
    qk_norm: bool
    shared_I: int
    moe_layers: tuple[int, ...]
    dtype: torch.dtype
    gdn: tuple[int, int, int, int, int] | None  # (hk, hv, dk, dv, conv kernel)
    linears: tuple[tuple[str | None, int, int], ...]  # (scheme or None, N, K) of the dense linears
    experts: tuple[str | None, str, float, float] = ("nvfp4", "silu", 0.0, 0.0)  # bank scheme, act, alpha, limit
    record: tuple | None = None  # the expert banks' RecordLayout fields (offsets are kernel constexprs), None: packed
    sinks: bool = False  # gpt_oss attention
    windows: tuple[int, ...] = (0,)  # attention windows of the layers (0: full attention)
    sigmoid: tuple[int, int, bool] | None = None  # the sigmoid router's (n_group, topk_group, bias?); None: softmax
    renorm: bool = True  # norm_topk_prob (a constexpr of the routing kernels)
    router_bias: bool = False  # the router has a bias (gpt_oss): the decode router adds it
    shared_gate: bool = True  # the shared expert is gated (else added as is: glm4_moe)


def geometry(reader) -> Geometry:
    """The launch-relevant sizes of an FTW (its config, quantization and dense tensors)."""
    c, quant = reader.config, reader.quant.get("linears") or {}
    dtype = reader.tensor("embed_tokens.weight").dtype if reader.has_tensor("embed_tokens.weight") else torch.bfloat16
    linears = set()
    for name in reader.tensor_names():
        t = reader.records.tensors[name]
        owner = name.removesuffix(".weight")
        if not name.endswith(".weight") or len(t.shape) != 2 or "embed_tokens" in name or "conv1d" in name:
            continue
        n, kk = t.shape
        scheme = quant.get(owner)
        linears.add((None, n, kk * 2 if scheme == "nvfp4" else kk))  # dequantized at load (the default)
        if scheme is not None:
            linears.add((scheme, n, kk * 2 if scheme == "nvfp4" else kk))  # --dense-weights quantized
    gdn = None
    if "linear_attention" in c.layer_types:
        gdn = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
               c.linear_conv_kernel_dim)
        hk, hv, dk, dv, _ = gdn  # in_proj_qkvz and in_proj_ba run as one stacked GEMV when both are plain
        linears.add((None, 2 * hk * dk + 2 * hv * dv + 2 * hv, c.hidden_size))
    moe_layers = tuple(i for i, m in enumerate(c.mlp_types) if m == "moe")
    return Geometry(H=c.hidden_size, I=c.moe_intermediate_size, layers=c.num_layers, E=c.num_experts,
                    k=c.num_experts_per_tok, nq=c.num_heads, nkv=c.num_kv_heads, hd=c.head_dim, rd=c.rotary_dim,
                    gated=c.attn_output_gate, qk_norm=c.attn_qk_norm,
                    shared_I=c.shared_expert_intermediate_size or c.intermediate_size, moe_layers=moe_layers,
                    dtype=dtype, gdn=gdn, linears=tuple(sorted(linears, key=str)),
                    experts=((reader.quant or {}).get("experts"), c.expert_act, c.swiglu_alpha, c.swiglu_limit),
                    record=_record(reader, moe_layers),
                    sinks=c.attn_sinks, windows=tuple(sorted({c.sliding_window if t == "sliding_attention" else 0
                                                               for t in c.layer_types
                                                               if t in ("full_attention", "sliding_attention")})),
                    sigmoid=(c.router_n_group, c.router_topk_group, c.router_correction_bias)
                    if c.router_scoring == "sigmoid" else None, renorm=c.norm_topk_prob, router_bias=c.router_bias,
                    shared_gate=c.shared_expert_gate)


def _record(reader, moe_layers) -> tuple | None:
    """The record layout the runtime reads the expert banks with (`RecordLayout.for_model`: its offsets are kernel
    constexprs), as a tuple of its fields, or None where the banks have no GPU kernel (the packed layout stands in)."""
    from dataclasses import astuple

    from ft.runtime.gpu.record_layout import RecordLayout

    if not moe_layers:
        return None
    try:
        layout = RecordLayout.for_model(reader.bank(f"layers.{moe_layers[0]}.mlp.experts"), reader.config)
    except (KeyError, ValueError):
        return None
    return astuple(layout)


def prefill_lengths(max_prefill: int) -> list[int]:
    """Every length class of a prefill chunk up to max_prefill (module docstring)."""
    out = set(range(1, min(64, max_prefill) + 1)) | {max_prefill, max_prefill - 1}
    p = 64
    while p <= max_prefill:
        out |= {p - 1, p, p + 1, p + 16}
        p *= 2
    return sorted(n for n in out if 1 <= n <= max_prefill)


def _addr(n: int) -> torch.Tensor:  # int64 "device addresses" (16-byte aligned); never dereferenced here
    return (torch.arange(n, dtype=torch.int64) + 1) << 20


def _decode_tables(B: int, layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(positions int64 [B], one layer's tables int64 [2, B]) as a decode step passes them, in both layouts of
    `decode_inputs`: eager ([positions | tables], `CausalLM._plan`) and a CUDA graph's ([ids | positions | tables],
    `graphs`). Layer 0's tables stand for every layer's: a layer's rows are 16 * B bytes after the previous one's, so
    all layers share their layout's alignment and strides (B, 1) (both equal to 1 for B = 1)."""
    from ft.runtime.layers.batch import decode_inputs, decode_inputs_size

    out = []
    for ids in (False, True):
        _, pos, tables = decode_inputs(_addr(decode_inputs_size(B, layers, ids=ids)), B, layers, ids=ids)
        out.append((pos, tables[0]))
    return out


def fused(g: Geometry, lengths: list[int]) -> None:
    from ft.runtime.gpu.kernels import fused_ops as f

    H, dt = g.H, g.dtype
    for T in lengths:
        x = torch.zeros(T, H, dtype=dt)
        f.rms_norm(x, torch.ones(H), 1e-6)
        f.add_rms_norm(x, x.clone(), torch.ones(H), 1e-6)
        if T > MAX_DECODE and g.moe_layers:
            if g.sigmoid is None:
                f.route_topk(torch.zeros(T, g.E, dtype=dt), g.k, g.renorm)
            else:  # fp32 logits (`SparseMoe._route_sigmoid`)
                f.route_topk(torch.zeros(T, g.E, dtype=F32), g.k, g.renorm, _sigmoid_route(g))
        if g.shared_I:
            f.silu_mul(torch.zeros(T, 2 * g.shared_I, dtype=dt))
            f.sigmoid_gate_add(x, torch.zeros(T, 1, dtype=dt) if g.shared_gate else None, x.clone())
        if g.qk_norm:  # the q and k heads of the qkv rows, normed in place of a strided split
            rows = (g.nq * (2 if g.gated else 1) + 2 * g.nkv) * g.hd
            qkv = torch.zeros(T, rows, dtype=dt)
            q0 = g.nq * g.hd * (2 if g.gated else 1)
            f.rms_norm(qkv[:, :g.nq * g.hd].view(T, g.nq, g.hd), torch.ones(g.hd), 1e-6)
            f.rms_norm(qkv[:, q0:q0 + g.nkv * g.hd].view(T, g.nkv, g.hd), torch.ones(g.hd), 1e-6)


def router(g: Geometry, lengths: list[int]) -> None:
    if not g.moe_layers:
        return
    from ft.runtime.gpu.kernels.router import MAX_TOKENS, router_topk

    for T in (t for t in lengths if t <= MAX_TOKENS):
        x = torch.zeros(T, g.H, dtype=g.dtype)
        if g.sigmoid is not None:
            router_topk(x, torch.zeros(g.E, g.H, dtype=g.dtype), g.k, g.renorm, sigmoid=_sigmoid_route(g))
            continue
        bias = torch.zeros(g.E, dtype=g.dtype) if g.router_bias else None
        for extra in (None, torch.zeros(1, g.H, dtype=g.dtype)):
            router_topk(x, torch.zeros(g.E, g.H, dtype=g.dtype), g.k, g.renorm, extra, bias=bias)


def _sigmoid_route(g: Geometry):
    from ft.runtime.gpu.kernels.sigmoid_topk import SigmoidRoute

    n_group, topk_group, has_bias = g.sigmoid
    return SigmoidRoute(torch.zeros(g.E) if has_bias else None, n_group, topk_group, 1.0)


def attention(g: Geometry, lengths: list[int]) -> None:
    from ft.runtime.gpu.kernels import decode_attention as da

    splits = da.split_counts()  # which one num_splits picks depends on the GPU's SM count
    for B in (t for t in lengths if t <= MAX_BATCH):
        rows = (g.nq + 2 * g.nkv) * g.hd + (g.nq * g.hd if g.gated else 0)
        qkv = torch.zeros(B, rows, dtype=g.dtype)
        norm = torch.ones(g.hd) if g.qk_norm else None
        cos = torch.zeros(B, g.rd, dtype=g.dtype) if g.rd else None  # `Rotary.cos_sin`: in the compute dtype
        sinks = torch.zeros(g.nq, dtype=g.dtype) if g.sinks else None
        for pos, tables in _decode_tables(B, g.layers):
            for S, window in ((S, w) for S in splits for w in g.windows):  # num_splits depends on the SM count
                da.decode_attention(qkv, norm, norm, 1e-6, cos, cos, tables, pos, nq=g.nq, nkv=g.nkv, hd=g.hd,
                                    scale=g.hd ** -0.5, gated=g.gated, splits=S, sinks=sinks, window=window)


def deltanet(g: Geometry, lengths: list[int]) -> None:
    if g.gdn is None:
        return
    from ft.runtime.gpu.kernels.deltanet_decode import gdn_decode
    from ft.runtime.gpu.kernels.deltanet_prefill import gdn_chunk_prefill

    hk, hv, dk, dv, K = g.gdn
    C, V = 2 * hk * dk + hv * dv, hv * dv
    for B in (t for t in lengths if t <= MAX_BATCH):
        # the projections' outputs as the layer splits them (pointer alignment and row strides are part of a
        # kernel's specialization): one stacked [qkv | z | b | a] GEMM (`stack_linears`), else [qkv | z] and [b | a]
        stacked = torch.zeros(B, C + V + 2 * hv, dtype=g.dtype).split([C, V, hv, hv], -1)
        apart = (*torch.zeros(B, C + V, dtype=g.dtype).split([C, V], -1),
                 *torch.zeros(B, 2 * hv, dtype=g.dtype).split([hv, hv], -1))
        for (mixed, z, b, a), (_, tables) in itertools.product((stacked, apart), _decode_tables(B, g.layers)):
            gdn_decode(mixed, z, b, a, torch.zeros(C, K, dtype=g.dtype), torch.zeros(hv), torch.zeros(hv),
                       torch.ones(dv), 1e-6, tables, hk=hk, hv=hv, dk=dk, dv=dv)
    for T in (t for t in lengths if t > 1):
        # q, k l2-normalised (contiguous); v a view of the conv output's fp32 copy [T, C] (`GatedDeltaNet._rule`);
        # g, beta rows of the whole batch's [N, Hv]: a later segment's start at any row
        v = torch.zeros(T, C)[:, 2 * hk * dk:].view(T, hv, dv)
        for first in (0, 1):
            gb = torch.zeros(first + T, hv)[first:]
            gdn_chunk_prefill(torch.zeros(T, hk, dk), torch.zeros(T, hk, dk), v, gb, gb, torch.zeros(hv, dk, dv))


def dense(g: Geometry, lengths: list[int]) -> None:
    from ft.runtime.gpu.kernels import dense_gemv as dg, dense_quant_mma
    from ft.runtime.gpu.kernels.dense_dequant import dequantize_rows
    from ft.runtime.layers.linear import dequant_chunks, mma_rows, quantized_kernel

    for scheme, N, K in g.linears:
        if scheme is not None:  # calls past the GEMV (prefill): each chunk of rows dequantized (pointer alignments)
            for s2, (r0, r1) in itertools.product((torch.ones(1), torch.ones(N)) if scheme == "nvfp4" else (None,),
                                                  dequant_chunks(N, K, g.dtype, kernel=True)):
                dequantize_rows(scheme, *_stored(scheme, N, K, s2), r0, r1, g.dtype)
        mma_from = mma_rows(scheme, N, K, g.dtype) if scheme is not None else None
        for T in (t for t in lengths if t <= (dg.MAX_TOKENS if scheme is None else dense_quant_mma.MAX_TOKENS)):
            x = torch.zeros(T, K, dtype=g.dtype)
            if scheme is None:
                dg.dense_gemv(x, torch.zeros(N, K, dtype=g.dtype))
                continue
            picked = quantized_kernel(scheme, K, T, g.dtype, mma_from)  # Linear's choice for a call of T rows
            if picked is None:
                continue
            for s2 in (torch.ones(1), torch.ones(N)) if scheme == "nvfp4" else (None,):
                picked[0](scheme, x, *_stored(scheme, N, K, s2))


def _stored(scheme: str, N: int, K: int, s2: torch.Tensor | None) -> tuple:
    """A kept-quantized [N, K] linear's tensors as `Linear` holds them (nvfp4: codes then scales in one buffer)."""
    if scheme == "nvfp4":
        buf = torch.zeros(N * K // 2 + N * K // 16, dtype=torch.uint8)
        return buf[:N * K // 2].view(N, K // 2), buf[N * K // 2:].view(torch.float8_e4m3fn).view(N, K // 16), s2
    return torch.zeros(N, K, dtype=torch.float8_e4m3fn), torch.ones(N), None


def embedding(g: Geometry, lengths: list[int]) -> None:
    from ft.runtime.gpu.kernels.embedding import gather_rows

    for T in lengths:
        gather_rows(ADDR, torch.zeros(T, dtype=torch.int64), torch.zeros(T, g.H, dtype=g.dtype))


def moe(g: Geometry, lengths: list[int]) -> None:
    from .moe_launches import moe_launches  # the expert kernels' launches (resident, mapped, lane, prefill tiles)

    moe_launches(g, lengths)


GROUPS = {"fused": fused, "router": router, "attention": attention, "deltanet": deltanet, "dense": dense,
          "embedding": embedding, "moe": moe}
