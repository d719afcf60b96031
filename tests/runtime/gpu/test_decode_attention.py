"""The fused full-attention decode kernel (`runtime/gpu/kernels/decode_attention.py`) against its torch reference, and
`Attention.__call__` fused vs reference on one decode batch. Without CUDA the kernel runs under Triton's interpreter
(conftest.py) on CPU tensors at tiny sizes; the tables hold the CPU buffers' addresses."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from ft.formats import ModelConfig  # noqa: E402
from ft.runtime.gpu.kernels import decode_attention as da  # noqa: E402
from ft.runtime.gpu.kernels.decode_attention import decode_attention, num_splits  # noqa: E402
from ft.runtime.gpu.kernels.decode_attention_ref import decode_attention_ref  # noqa: E402
from ft.runtime.layers.attention import Attention  # noqa: E402
from ft.runtime.layers.batch import ForwardBatch, SegmentRows, state_addresses  # noqa: E402
from ft.runtime.layers.rope import Rotary  # noqa: E402
from ft.runtime.state import SequenceState  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
F32, BF16 = torch.float32, torch.bfloat16
# Output tolerances, relative to max(1, max |out|): rounding order only, except for CUDA's bf16 dots (probabilities
# rounded to bf16). k / v rows: rounding order (fp32), at most one bf16 ulp (a norm's sum order can flip one).
TOL = {F32: 1e-4 if CUDA else 1e-5, BF16: 3e-2 if CUDA else 2 ** -7}
KV_TOL = {F32: 1e-5, BF16: 2 ** -7}


class Case:
    """Random decode inputs: B sequences at `lengths` (position p_b = length - 1) with fresh buffers, rows before
    p_b random and rows from p_b on NaN (a read of row p_b before its write, or past it, shows as NaN), and a twin
    copy of the buffers for the reference."""

    def __init__(self, seed, lengths, nq, nkv, hd, *, rd=None, norm="both", gated=False, dtype=F32, scale=4.0,
                 sinks=False, window=0):
        g = torch.Generator().manual_seed(seed)
        rd = hd if rd is None else rd
        B, cap = len(lengths), max(lengths) + 8
        self.kw = dict(nq=nq, nkv=nkv, hd=hd, scale=hd ** -0.5 * scale, gated=gated, window=window,
                       sinks=(torch.randn(nq, generator=g) * 4).to(DEV, dtype) if sinks else None)  # scale > 1: peaked
        self.dtype, self.lengths = dtype, lengths
        width = (nq + 2 * nkv + (nq if gated else 0)) * hd
        # a column slice of a wider row (a row stride other than the width), a non-trivial RMS
        self.qkv = (torch.randn(B, width + 16, generator=g) * 3 + 1).to(DEV, dtype)[:, 16:]
        self.q_norm = (torch.rand(hd, generator=g) + 0.5).to(DEV) if norm in ("both", "q") else None
        self.k_norm = (torch.rand(hd, generator=g) + 0.5).to(DEV) if norm in ("both", "k") else None
        self.pos = torch.tensor(lengths, dtype=torch.int64, device=DEV) - 1
        self.cos, self.sin = Rotary(rd, 10000.0).cos_sin(self.pos + 100, dtype) if rd else (None, None)
        self.kv = []
        for n in lengths:
            pair = [torch.randn(cap, nkv, hd, generator=g) for _ in range(2)]
            for t in pair:
                t[n - 1:] = float("nan")
            self.kv.append(tuple(t.to(DEV, dtype) for t in pair))
        self.before = [tuple(t.clone() for t in pair) for pair in self.kv]
        self.kv_ref = [tuple(t.clone() for t in pair) for pair in self.kv]
        self.tables = torch.tensor([[k.data_ptr() for k, _ in self.kv], [v.data_ptr() for _, v in self.kv]],
                                   dtype=torch.int64, device=DEV)

    def run(self, splits=None, block_n=16, min_chunk=0):
        tile = {"BLOCK_N": block_n, "num_warps": 4, "num_stages": 1, "min_chunk": min_chunk}
        return decode_attention(self.qkv, self.q_norm, self.k_norm, 1e-6, self.cos, self.sin, self.tables, self.pos,
                                splits=splits, tile=tile, **self.kw)

    def check(self, got):
        """`got` against the reference; row p_b of each buffer as the reference wrote it, every other row as before."""
        want = decode_attention_ref(self.qkv, self.q_norm, self.k_norm, 1e-6, self.cos, self.sin, self.kv_ref,
                                    self.pos, **self.kw)
        _close(got, want, TOL[self.dtype])
        for n, pair, ref, before in zip(self.lengths, self.kv, self.kv_ref, self.before):
            for t, t_ref, t0 in zip(pair, ref, before):
                _close(t[n - 1], t_ref[n - 1], KV_TOL[self.dtype])
                keep = torch.ones(t.shape[0], dtype=torch.bool, device=DEV)
                keep[n - 1] = False
                torch.testing.assert_close(t[keep], t0[keep], rtol=0, atol=0, equal_nan=True)  # nothing else touched
        v = self.qkv[:, (self.kw["nq"] + self.kw["nkv"]) * self.kw["hd"]:][:, : self.kw["nkv"] * self.kw["hd"]]
        for b, n in enumerate(self.lengths):
            assert torch.equal(self.kv[b][1][n - 1].reshape(-1), v[b])  # v passes through unchanged


def _close(got, want, tol=TOL[F32]):
    assert got.shape == want.shape and torch.isfinite(got).all()
    assert (got.float() - want.float()).abs().max() <= tol * max(1.0, want.float().abs().max())


def _counters_zero():
    for buf in da._COUNTERS.values():
        assert not buf.any()  # the last program of each (b, g) reset its counter


# nq, nkv, hd, rd (partial rotary when < hd, 0 = none), norm ("both", "q", "k", "none"), gated, lengths, splits,
# BLOCK_N, dtype
CASES = [
    (4, 4, 32, 32, "both", False, [1], 4, 16, F32),            # one key: split 0 writes it and reads it back
    (4, 2, 32, 16, "both", True, [37, 1, 70], 4, 16, F32),     # 37: 3 live splits of 4; 70: partial block, an empty
    (8, 2, 64, 64, "none", False, [16, 33], 2, 16, F32),       # split; 16: one live split (finishes alone)
    (4, 1, 64, 16, "q", True, [100], 8, 32, F32),              # r = 4
    (2, 1, 32, 0, "both", False, [5, 300], None, 32, F32),     # no rotary; num_splits() on the CPU
    (2, 2, 32, 32, "k", True, [2051], 4, 64, F32),             # many blocks per split
    (4, 2, 32, 16, "both", True, [3, 90, 40], 4, 16, BF16),
    (8, 2, 64, 64, "both", False, [20, 17], 2, 16, BF16),
]


@pytest.mark.parametrize("nq,nkv,hd,rd,norm,gated,lengths,splits,block_n,dtype", CASES)
def test_decode_attention_matches_reference(nq, nkv, hd, rd, norm, gated, lengths, splits, block_n, dtype):
    c = Case(sum(lengths) + nq + rd, lengths, nq, nkv, hd, rd=rd, norm=norm, gated=gated, dtype=dtype)
    c.check(c.run(splits, block_n))
    _counters_zero()


@pytest.mark.parametrize("gated", [False, True])
def test_one_live_split_equals_the_merge(monkeypatch, gated):
    """The same contexts through the path where program 0 finishes alone (S = 1; or S = 8 with min_chunk >= every
    length, seven empty programs) and through the partials' merge (S = 8): equal up to fp32 rounding order. The
    alone path must not touch the counters: a sentinel value in them stays."""
    c = Case(5 + gated, [1, 30, 77], 4, 2, 32, rd=16, gated=gated)
    merged = c.run(8)
    c.check(merged)
    _counters_zero()
    sentinel = torch.full((1024,), 7, dtype=torch.int32, device=DEV)
    monkeypatch.setattr(da, "_counters", lambda n, device: sentinel)
    for splits, min_chunk in [(1, 0), (8, 80)]:
        alone = c.run(splits, min_chunk=min_chunk)
        c.check(alone)
        _close(alone, merged, 1e-6)
        assert (sentinel == 7).all()


def test_decode_attention_repeated_calls_reset_the_counters():
    """Back-to-back calls share the module's counter buffer: each must leave it zeroed for the next, across length
    changes (splits live in one call, empty in the next; one live split or several) and batch changes (B * nkv
    programs per split)."""
    for i, (lengths, gated) in enumerate([([100, 3], True), ([5, 200], False), ([1], True), ([64, 17, 129, 2], False),
                                          ([300, 1, 40], True), ([7], False)]):
        c = Case(11 + i, lengths, 4, 2, 32, rd=32, gated=gated, scale=1.0)
        got = c.run(8)
        c.check(got)
        _counters_zero()
    again = c.run(8)  # the same inputs twice (row p_b rewritten with the same values): the same output bit for bit
    assert torch.equal(again, got)


@pytest.mark.parametrize("min_chunk,combine_elems", [(0, 64), (48, 0), (64, 128)])
def test_decode_attention_min_chunk_and_chunked_merge(monkeypatch, min_chunk, combine_elems):
    """min_chunk (rounded up to BLOCK_N) leaves more splits empty; a small combine_elems makes the last program
    merge the partials over several [CB, r, hd] steps, with a partial last step."""
    monkeypatch.setitem(da.CONFIG, "combine_elems", combine_elems)
    c = Case(min_chunk + combine_elems, [1, 50, 333, 1000], 4, 2, 32, rd=16, gated=True)
    c.check(c.run(16, min_chunk=min_chunk))
    _counters_zero()


def test_num_splits_fills_the_device_with_a_power_of_two():
    for b, nkv in [(1, 4), (8, 2), (64, 4)]:
        s = num_splits(b, nkv, torch.device(DEV))
        assert s & (s - 1) == 0 and s >= 1


def test_split_counts_are_every_s_num_splits_picks(monkeypatch):
    """The kernels build compiles decode attention for `split_counts()`, not knowing the serving GPU's SM count."""
    monkeypatch.setattr(da, "_SMS", {})
    picked = set()
    for sms in (1, 7, 78, 114, 132, 170, 1000):
        da._SMS[0] = sms
        picked |= {num_splits(b, nkv, torch.device("cuda", 0)) for b in range(1, 65) for nkv in (1, 2, 4, 8)}
    assert picked == set(da.split_counts())
    monkeypatch.setitem(da.CONFIG, "min_splits", 2)
    monkeypatch.setitem(da.CONFIG, "max_splits", 16)
    assert da.split_counts() == [2, 4, 8, 16]


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
    attn.qkv_proj.weight = (torch.randn(attn.expected_rows, H, generator=g) * 0.3).to(DEV, F32)
    attn.o_proj.weight = (torch.randn(H, cfg.num_heads * cfg.head_dim, generator=g) * 0.3).to(DEV, F32)
    attn.q_norm.weight = (torch.rand(cfg.head_dim, generator=g) + 0.5).to(DEV)
    attn.k_norm.weight = (torch.rand(cfg.head_dim, generator=g) + 0.5).to(DEV)
    rotary = Rotary(cfg.rotary_dim, cfg.rope_theta)

    def batch_of(x_rows, segments, positions, tables=None):
        pos = torch.tensor(positions, dtype=torch.int64, device=DEV)
        b = ForwardBatch(segments, pos, tables=tables)
        b.rope["cos"], b.rope["sin"] = rotary.cos_sin(pos, F32)
        return b

    # three sequences prefilled eagerly to lengths 1, 19 and 40
    _fused_step_matches_eager(attn, cfg, layer, [1, 19, 40], g, batch_of)


def _fused_step_matches_eager(attn, cfg, layer, lengths, g, batch_of):
    """Sequences prefilled eagerly to `lengths`, copied into twin states; one decode step of all of them on the PyTorch
    path and on the fused kernel (device tables [L, 2, B]): outputs and the cache rows written agree.
    batch_of(x, segments, positions, tables=None) -> ForwardBatch."""
    H = cfg.hidden_size
    states = [SequenceState(cfg, 64, dtype=F32, device=torch.device(DEV)) for _ in lengths]
    for st, n in zip(states, lengths):
        x = torch.randn(n, H, generator=g).to(DEV, F32)
        attn(x, batch_of(x, [SegmentRows(0, n, 0, st)], list(range(n))))
        st.length = n
    twins = [SequenceState(cfg, 64, dtype=F32, device=torch.device(DEV)) for _ in lengths]
    for st, tw in zip(states, twins):
        for i, (k, v) in st.kv.items():
            tw.kv[i][0].copy_(k)
            tw.kv[i][1].copy_(v)
    x = torch.randn(len(lengths), H, generator=g).to(DEV, F32)
    outs = []
    for fused, sts in [(False, states), (True, twins)]:
        tables = torch.stack([state_addresses(s, cfg.num_layers) for s in sts], -1).to(DEV)   # [L, 2, B]
        segs = [SegmentRows(b, 1, -1, s) for b, s in enumerate(sts)]
        attn._fused = fused
        outs.append(attn(x, batch_of(x, segs, lengths, tables)))
    _close(outs[1], outs[0])
    for st, tw, n in zip(states, twins, lengths):
        _close(tw.kv[layer][0][: n + 1], st.kv[layer][0][: n + 1])
        _close(tw.kv[layer][1][: n + 1], st.kv[layer][1][: n + 1])


# gpt_oss: per-head sinks and sliding windows. nq, nkv, hd, lengths, splits, window, sinks, dtype: windows shorter
# and longer than the contexts, a window start inside a block, one live split and a merge
SINK_CASES = [
    (4, 2, 32, [37, 1, 70], 4, 0, True, F32),
    (4, 2, 32, [37, 1, 70], 4, 16, True, F32),
    (8, 2, 64, [300, 20], 8, 48, False, F32),
    (4, 1, 32, [129, 5], 1, 33, True, F32),
    (4, 2, 32, [90, 40], 4, 24, True, BF16),
]


@pytest.mark.parametrize("nq,nkv,hd,lengths,splits,window,sinks,dtype", SINK_CASES)
def test_decode_attention_sinks_and_window_match_reference(nq, nkv, hd, lengths, splits, window, sinks, dtype):
    c = Case(sum(lengths) + window, lengths, nq, nkv, hd, rd=16, sinks=sinks, window=window, dtype=dtype)
    got = c.run(splits)
    c.check(got)
    _counters_zero()
    if sinks and dtype == F32:  # the sinks change the result (a kernel ignoring them fails here)
        plain = decode_attention_ref(c.qkv, c.q_norm, c.k_norm, 1e-6, c.cos, c.sin, c.kv_ref, c.pos,
                                     **{**c.kw, "sinks": None})
        assert (got.float() - plain.float()).abs().max() > 10 * TOL[dtype]


def _oss_config(window):
    return ModelConfig(
        family="gpt_oss", vocab_size=16, hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
        rms_norm_eps=1e-6, rope_theta=10000.0, rotary_dim=32, max_position_embeddings=128,
        layer_types=("full_attention", "sliding_attention"), mlp_types=("dense",) * 2, attn_qkv_bias=True,
        attn_o_bias=True, attn_sinks=True, sliding_window=window, attn_qk_norm=False, attn_output_gate=False,
        num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, norm_topk_prob=False,
        shared_expert_intermediate_size=0, intermediate_size=8, linear_num_key_heads=0, linear_num_value_heads=0,
        linear_key_head_dim=0, linear_value_head_dim=0, linear_conv_kernel_dim=0, tie_word_embeddings=True,
        bos_token_id=None, eos_token_ids=(1,))


@pytest.mark.parametrize("layer", [0, 1])
def test_gpt_oss_attention_fused_decode_matches_eager(layer):
    """gpt_oss attention (q/k/v/o biases, sinks; layer 1 a sliding window of 8) on one decode batch: the fused kernel
    against the eager `sink_attention` path, outputs and written cache rows."""
    cfg = _oss_config(8)
    g = torch.Generator().manual_seed(30 + layer)
    attn = Attention(cfg, layer)
    H, rows = cfg.hidden_size, Attention(cfg, layer).expected_rows
    attn.qkv_proj.weight = (torch.randn(rows, H, generator=g) * 0.3).to(DEV, F32)
    attn.qkv_proj.bias = (torch.randn(rows, generator=g) * 0.5).to(DEV, F32)
    attn.o_proj.weight = (torch.randn(H, cfg.num_heads * cfg.head_dim, generator=g) * 0.3).to(DEV, F32)
    attn.o_proj.bias = (torch.randn(H, generator=g) * 0.5).to(DEV, F32)
    attn.sinks = (torch.randn(cfg.num_heads, generator=g) * 2).to(DEV, F32)
    rotary = Rotary(cfg.rotary_dim, cfg.rope_theta)

    def batch_of(segments, positions, tables=None):
        pos = torch.tensor(positions, dtype=torch.int64, device=DEV)
        b = ForwardBatch(segments, pos, tables=tables)
        b.rope["cos"], b.rope["sin"] = rotary.cos_sin(pos, F32)
        return b

    _fused_step_matches_eager(attn, cfg, layer, [1, 6, 19, 40], g,  # inside and beyond the window
                              lambda x, *args: batch_of(*args))
