"""Full-attention decode kernels (`runtime/gpu/decode_attention.py`) against their torch references, and
`Attention.__call__` fused vs reference on one decode batch. Without CUDA the kernels run under Triton's interpreter
(conftest.py) on CPU tensors, fp32, at tiny sizes; the tables hold the CPU buffers' addresses."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from ft.formats import ModelConfig  # noqa: E402
from ft.runtime.gpu import decode_attention as da  # noqa: E402
from ft.runtime.gpu.decode_attention import (  # noqa: E402
    decode_attention, decode_attention_ref, num_splits, prep_decode, prep_decode_ref)
from ft.runtime.layers.attention import Attention  # noqa: E402
from ft.runtime.layers.batch import ForwardBatch, SegmentRows, state_addresses  # noqa: E402
from ft.runtime.layers.rope import Rotary  # noqa: E402
from ft.runtime.state import SequenceState  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DT = torch.float32
TOL = 1e-4 if CUDA else 1e-5


def _buffers(lengths, cap, nkv, hd, g, *, fill_past=float("nan")):
    """Per sequence (k, v) [cap, nkv, hd]: random rows below its length, `fill_past` at and after it."""
    kv = []
    for n in lengths:
        pair = []
        for _ in range(2):
            t = torch.randn(cap, nkv, hd, generator=g)
            t[n:] = fill_past
            pair.append(t.to(DEV, DT))
        kv.append(tuple(pair))
    return kv


def _tables(kv):
    return torch.tensor([[k.data_ptr() for k, _ in kv], [v.data_ptr() for _, v in kv]], dtype=torch.int64,
                        device=DEV)


def _close(got, want, tol=TOL):
    assert got.shape == want.shape and torch.isfinite(got).all()
    assert (got.float() - want.float()).abs().max() <= tol * max(1.0, want.float().abs().max())


# nq, nkv, hd, rd (partial rotary when < hd, 0 = none), norm ("both", "q", "none"), gate rows, positions
PREP = [
    (4, 4, 32, 32, "both", False, [0]),
    (4, 2, 32, 16, "both", True, [5, 0, 12]),
    (8, 2, 64, 64, "none", False, [3, 9]),
    (4, 1, 64, 16, "q", True, [7]),
    (2, 2, 32, 0, "both", False, [1, 2]),
]


@pytest.mark.parametrize("nq,nkv,hd,rd,norm,gated,positions", PREP)
def test_prep_decode_matches_reference(nq, nkv, hd, rd, norm, gated, positions):
    g = torch.Generator().manual_seed(nq * 100 + hd + len(positions))
    B, cap = len(positions), 16
    rows = (nq + 2 * nkv + (nq if gated else 0)) * hd
    qkv = (torch.randn(B, rows, generator=g) * 3 + 1).to(DEV, DT)  # a non-trivial RMS
    qn = (torch.rand(hd, generator=g) + 0.5).to(DEV) if norm in ("both", "q") else None
    kn = (torch.rand(hd, generator=g) + 0.5).to(DEV) if norm == "both" else None
    pos = torch.tensor(positions, dtype=torch.int64, device=DEV)
    if rd:
        cos, sin = Rotary(rd, 10000.0).cos_sin(pos + 100, DT)
    else:
        cos = sin = None
    kv = _buffers([cap] * B, cap, nkv, hd, g)  # fully random: every row not written must stay as it was
    kv_ref = [tuple(t.clone() for t in pair) for pair in kv]
    before = [tuple(t.clone() for t in pair) for pair in kv]
    q = prep_decode(qkv, qn, kn, 1e-6, cos, sin, _tables(kv), pos, nq=nq, nkv=nkv, hd=hd)
    q_ref = prep_decode_ref(qkv, qn, kn, 1e-6, cos, sin, kv_ref, pos, nq=nq, nkv=nkv, hd=hd)
    _close(q, q_ref)
    for b, p in enumerate(positions):
        for t, t_ref, t0 in zip(kv[b], kv_ref[b], before[b]):
            _close(t[p], t_ref[p])
            assert not torch.equal(t[p], t0[p])
            keep = torch.ones(cap, dtype=torch.bool)
            keep[p] = False
            assert torch.equal(t[keep], t0[keep])  # nothing else touched
    # v passes through unchanged
    v = qkv[:, (nq + nkv) * hd:(nq + 2 * nkv) * hd].reshape(B, nkv, hd)
    for b, p in enumerate(positions):
        assert torch.equal(kv[b][1][p], v[b])


# nq, nkv, hd, lengths (keys 0..length-1 live), splits, BLOCK_N, gated
ATTN = [
    (4, 4, 32, [1], 4, 16, False),
    (4, 2, 32, [37, 1, 70], 4, 16, True),   # 70: partial block, an empty split; 37: 3 live splits of 4
    (8, 2, 64, [16, 33], 2, 16, False),
    (4, 1, 64, [100], 8, 32, True),
    (2, 1, 32, [5, 300], None, 32, False),  # num_splits() on the CPU
    (2, 2, 32, [2051], 4, 64, True),        # many blocks per split
]


@pytest.mark.parametrize("nq,nkv,hd,lengths,splits,block_n,gated", ATTN)
def test_decode_attention_matches_reference(nq, nkv, hd, lengths, splits, block_n, gated):
    g = torch.Generator().manual_seed(sum(lengths) + nq)
    B, cap = len(lengths), max(lengths) + 40
    kv = _buffers(lengths, cap, nkv, hd, g)  # NaN past each length: a read beyond it would show
    q = torch.randn(B, nq, hd, generator=g).to(DEV, DT)
    pos = torch.tensor(lengths, dtype=torch.int64, device=DEV) - 1
    gate = None
    if gated:  # a column slice of a wider row, as in qkv
        gate = (torch.randn(B, 3 * nq * hd, generator=g) * 2).to(DEV, DT)[:, nq * hd:2 * nq * hd]
    scale = hd ** -0.5 * 4  # peaked softmax: the running max matters
    tile = {"BLOCK_N": block_n, "num_warps": 4, "num_stages": 1}
    got = decode_attention(q, _tables(kv), pos, nkv=nkv, scale=scale, gate=gate, splits=splits, tile=tile)
    want = decode_attention_ref(q, kv, pos, nkv=nkv, scale=scale, gate=gate)
    _close(got, want)


def _attn_case(g, lengths, nq, nkv, hd, gated):
    B, cap = len(lengths), max(lengths) + 8
    kv = _buffers(lengths, cap, nkv, hd, g)
    q = torch.randn(B, nq, hd, generator=g).to(DEV, DT)
    pos = torch.tensor(lengths, dtype=torch.int64, device=DEV) - 1
    gate = (torch.randn(B, nq * hd, generator=g) * 2).to(DEV, DT) if gated else None
    return kv, q, pos, gate


def _counters_zero():
    for buf in da._COUNTERS.values():
        assert not buf.any()  # the last program of each (b, g) reset its counter


def test_decode_attention_repeated_calls_reset_the_counters():
    """Back-to-back calls share the module's counter buffer: each must leave it zeroed for the next, across length
    changes (splits live in one call, empty in the next) and batch changes (B * nkv programs per split)."""
    g = torch.Generator().manual_seed(11)
    nq, nkv, hd, S = 4, 2, 32, 8
    tile = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    for lengths, gated in [([100, 3], True), ([5, 200], False), ([1], True), ([64, 17, 129, 2], False),
                           ([300, 1, 40], True), ([7], False)]:
        kv, q, pos, gate = _attn_case(g, lengths, nq, nkv, hd, gated)
        got = decode_attention(q, _tables(kv), pos, nkv=nkv, scale=hd ** -0.5, gate=gate, splits=S, tile=tile)
        _close(got, decode_attention_ref(q, kv, pos, nkv=nkv, scale=hd ** -0.5, gate=gate))
        _counters_zero()
    # the same inputs twice give the same output bit for bit
    again = decode_attention(q, _tables(kv), pos, nkv=nkv, scale=hd ** -0.5, gate=gate, splits=S, tile=tile)
    assert torch.equal(again, got)


@pytest.mark.parametrize("min_chunk,combine_elems", [(0, 64), (48, 0), (64, 128)])
def test_decode_attention_min_chunk_and_chunked_merge(monkeypatch, min_chunk, combine_elems):
    """min_chunk (rounded up to BLOCK_N) leaves more splits empty; a small combine_elems makes the last program
    merge the partials over several [CB, r, hd] steps, with a partial last step."""
    monkeypatch.setitem(da.CONFIG, "combine_elems", combine_elems)
    g = torch.Generator().manual_seed(min_chunk + combine_elems)
    nq, nkv, hd = 4, 2, 32
    kv, q, pos, gate = _attn_case(g, [1, 50, 333, 1000], nq, nkv, hd, True)
    tile = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "min_chunk": min_chunk}
    got = decode_attention(q, _tables(kv), pos, nkv=nkv, scale=hd ** -0.5 * 4, gate=gate, splits=16, tile=tile)
    _close(got, decode_attention_ref(q, kv, pos, nkv=nkv, scale=hd ** -0.5 * 4, gate=gate))
    _counters_zero()


def test_num_splits_fills_the_device_with_a_power_of_two():
    for b, nkv in [(1, 4), (8, 2), (64, 4)]:
        s = num_splits(b, nkv, torch.device(DEV))
        assert s & (s - 1) == 0 and s >= 1


def _config(gated):
    return ModelConfig(
        family="qwen3_5_moe" if gated else "qwen3_moe", vocab_size=16, hidden_size=48, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0, rotary_dim=16 if gated else 32,
        max_position_embeddings=128, layer_types=("full_attention",) * 2, mlp_types=("dense",) * 2,
        attn_qkv_bias=False, attn_qk_norm=True, attn_output_gate=gated, num_experts=0, num_experts_per_tok=0,
        moe_intermediate_size=0, norm_topk_prob=False, shared_expert_intermediate_size=0, intermediate_size=8,
        linear_num_key_heads=0, linear_num_value_heads=0, linear_key_head_dim=0, linear_value_head_dim=0,
        linear_conv_kernel_dim=0, tie_word_embeddings=True, bos_token_id=None, eos_token_ids=(1,))


@pytest.mark.parametrize("gated", [False, True])
def test_attention_fused_decode_matches_reference(gated):
    cfg = _config(gated)
    g = torch.Generator().manual_seed(7 + gated)
    layer = 1
    attn = Attention(cfg, layer)
    H = cfg.hidden_size
    attn.qkv_proj.weight = (torch.randn(attn.expected_rows, H, generator=g) * 0.3).to(DEV, DT)
    attn.o_proj.weight = (torch.randn(H, cfg.num_heads * cfg.head_dim, generator=g) * 0.3).to(DEV, DT)
    attn.q_norm.weight = (torch.rand(cfg.head_dim, generator=g) + 0.5).to(DEV)
    attn.k_norm.weight = (torch.rand(cfg.head_dim, generator=g) + 0.5).to(DEV)
    rotary = Rotary(cfg.rotary_dim, cfg.rope_theta)

    def batch_of(x_rows, segments, positions, tables=None):
        pos = torch.tensor(positions, dtype=torch.int64, device=DEV)
        b = ForwardBatch(segments, pos, tables=tables)
        b.rope["cos"], b.rope["sin"] = rotary.cos_sin(pos, DT)
        return b

    # three sequences prefilled eagerly to lengths 1, 19 and 40
    lengths = [1, 19, 40]
    states = [SequenceState(cfg, 64, dtype=DT, device=torch.device(DEV)) for _ in lengths]
    for st, n in zip(states, lengths):
        x = torch.randn(n, H, generator=g).to(DEV, DT)
        attn(x, batch_of(x, [SegmentRows(0, n, 0, st)], list(range(n))))
        st.length = n
    twins = [SequenceState(cfg, 64, dtype=DT, device=torch.device(DEV)) for _ in lengths]
    for st, tw in zip(states, twins):
        for i, (k, v) in st.kv.items():
            tw.kv[i][0].copy_(k)
            tw.kv[i][1].copy_(v)

    x = torch.randn(len(lengths), H, generator=g).to(DEV, DT)
    outs = []
    for fused, sts in [(False, states), (True, twins)]:
        tables = torch.stack([state_addresses(s, cfg.num_layers) for s in sts], -1).to(DEV)   # [L, 2, B]
        segs = [SegmentRows(b, 1, -1, s) for b, s in enumerate(sts)]
        attn._fused = fused
        outs.append(attn(x, batch_of(x, segs, lengths, tables)))
    _close(outs[1], outs[0])
    for st, tw, n in zip(states, twins, lengths):
        k, v = st.kv[layer]
        k2, v2 = tw.kv[layer]
        _close(k2[: n + 1], k[: n + 1])
        _close(v2[: n + 1], v[: n + 1])
