"""Gated DeltaNet: the chunked (prefill) and recurrent (decode) forms agree with each other and with transformers'
reference kernels; the conv state makes split and token-by-token runs equal to one-shot runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from ft.runtime.layers.batch import ForwardBatch, SegmentRows
from ft.runtime.layers.deltanet import (
    Conv1d,
    GatedDeltaNet,
    chunk_gated_delta_rule,
    l2_normalize,
    recurrent_gated_delta_rule,
)

H, DK, DV = 4, 16, 8
TOL = 2e-5


def _inputs(t: int, seed: int = 0, heads: int = H):
    g = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(t, heads, DK, generator=g)) * DK ** -0.5
    k = l2_normalize(torch.randn(t, heads, DK, generator=g))
    v = torch.randn(t, heads, DV, generator=g)
    # Decays spanning slow (g ≈ -0.01) to fast (g ≈ -8) forgetting; beta in (0, 1).
    decay = -torch.exp(torch.empty(t, heads).uniform_(-4.6, 2.1, generator=g))
    beta = torch.sigmoid(torch.randn(t, heads, generator=g))
    state = torch.randn(heads, DK, DV, generator=g) * 0.5
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("t", [1, 2, 63, 64, 65, 150])
@pytest.mark.parametrize("chunk", [64, 16, 7])
def test_chunked_equals_recurrent(t, chunk):
    q, k, v, g, beta, s0 = _inputs(t, seed=t)
    o_rec, s_rec = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    o_chk, s_chk = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk=chunk)
    assert (o_chk - o_rec).abs().max() < TOL
    assert (s_chk - s_rec).abs().max() < TOL


def test_state_carries_across_calls():
    q, k, v, g, beta, s0 = _inputs(100, seed=1)
    o_all, s_all = chunk_gated_delta_rule(q, k, v, g, beta, s0)
    o1, s1 = chunk_gated_delta_rule(q[:37], k[:37], v[:37], g[:37], beta[:37], s0)
    o2, s2 = chunk_gated_delta_rule(q[37:], k[37:], v[37:], g[37:], beta[37:], s1)
    assert (torch.cat([o1, o2]) - o_all).abs().max() < TOL
    assert (s2 - s_all).abs().max() < TOL


def test_matches_transformers_reference_kernels():
    ref = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    t, hk, r = 70, 2, 2                                     # 2 key heads, each serving 2 value heads
    g_ = torch.Generator().manual_seed(3)
    q_raw, k_raw = torch.randn(t, hk, DK, generator=g_), torch.randn(t, hk, DK, generator=g_)
    v = torch.randn(t, hk * r, DV, generator=g_)
    decay = -torch.exp(torch.empty(t, hk * r).uniform_(-4.6, 2.1, generator=g_))
    beta = torch.sigmoid(torch.randn(t, hk * r, generator=g_))
    s0 = torch.randn(hk * r, DK, DV, generator=g_)
    # Ours: normalised/scaled q, k with key head j repeated for value heads j·r .. j·r+r-1.
    q = (l2_normalize(q_raw) * DK ** -0.5).repeat_interleave(r, dim=1)
    k = l2_normalize(k_raw).repeat_interleave(r, dim=1)
    o_chk, s_chk = chunk_gated_delta_rule(q, k, v, decay, beta, s0)
    o_rec, s_rec = recurrent_gated_delta_rule(q, k, v, decay, beta, s0)
    # Repeat the key heads before the call: older transformers kernels expect as many q/k heads as v heads.
    args = (q_raw.repeat_interleave(r, dim=1)[None], k_raw.repeat_interleave(r, dim=1)[None], v[None])
    kw = dict(g=decay[None], beta=beta[None], initial_state=s0[None], output_final_state=True,
              use_qk_l2norm_in_kernel=True)
    o_hf_chk, s_hf_chk = ref.torch_chunk_gated_delta_rule(*args, **kw)
    o_hf_rec, s_hf_rec = ref.torch_recurrent_gated_delta_rule(*args, **kw)
    assert (o_chk - o_hf_chk[0]).abs().max() < TOL and (s_chk - s_hf_chk[0]).abs().max() < TOL
    assert (o_rec - o_hf_rec[0]).abs().max() < TOL and (s_rec - s_hf_rec[0]).abs().max() < TOL


def _conv(channels=6, k=4, seed=0):
    conv = Conv1d()
    conv.weight = torch.randn(channels, k, generator=torch.Generator().manual_seed(seed))
    return conv


def test_conv_state_split_and_stepwise_equal_one_shot():
    conv = _conv()
    x = torch.randn(20, 6, generator=torch.Generator().manual_seed(11))
    zero_pad = F.silu(F.conv1d(x.T[None], conv.weight[:, None, :], padding=3, groups=6)[0, :, :20].T)
    one_shot = conv(x, torch.zeros(6, 3))
    assert torch.allclose(one_shot, zero_pad, atol=1e-6)
    state = torch.zeros(6, 3)
    split = torch.cat([conv(x[:9], state), conv(x[9:10], state), conv(x[10:], state)])
    assert torch.allclose(split, one_shot, atol=1e-6)
    assert torch.equal(state, x[-3:].T)                     # the state holds the last K-1 inputs


def _layer_config():
    return SimpleNamespace(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=DK,
                           linear_value_head_dim=DV, linear_conv_kernel_dim=4, rms_norm_eps=1e-6)


def _random_layer(hidden=24):
    cfg = _layer_config()
    layer = GatedDeltaNet(cfg, layer=0)
    g = torch.Generator().manual_seed(5)
    kd, vd, hv = 2 * DK, 4 * DV, 4
    layer.in_proj_qkvz.weight = torch.randn(2 * kd + 2 * vd, hidden, generator=g) * 0.2
    layer.in_proj_ba.weight = torch.randn(2 * hv, hidden, generator=g) * 0.2
    layer.conv1d.weight = torch.randn(2 * kd + vd, 4, generator=g) * 0.5
    layer.dt_bias = torch.randn(hv, generator=g)
    layer.A_log = torch.empty(hv).uniform_(0.01, 16, generator=g).log()
    layer.norm.weight = 1 + 0.1 * torch.randn(DV, generator=g)
    layer.out_proj.weight = torch.randn(hidden, vd, generator=g) * 0.2
    return layer


def _fresh_state(layer):
    return SimpleNamespace(conv={0: torch.zeros(layer.conv_dim, 3)}, recurrent={0: torch.zeros(4, DK, DV)})


def test_layer_prefill_then_decode_equals_one_shot():
    """Prefill of 90 tokens (two chunks) vs 40-token prefill + 50 single-token (recurrent) decode steps."""
    layer = _random_layer()
    x = torch.randn(90, 24, generator=torch.Generator().manual_seed(12))  # inputs fixed: not the global RNG's
    st = _fresh_state(layer)
    one_shot = layer(x, ForwardBatch([SegmentRows(0, 90, 0, st)], torch.arange(90)))
    st2 = _fresh_state(layer)
    outs = [layer(x[:40], ForwardBatch([SegmentRows(0, 40, 0, st2)], torch.arange(40)))]
    for i in range(40, 90):
        outs.append(layer(x[i:i + 1], ForwardBatch([SegmentRows(0, 1, i, st2)], torch.tensor([i]))))
    assert (torch.cat(outs) - one_shot).abs().max() < TOL
    assert (st2.recurrent[0] - st.recurrent[0]).abs().max() < TOL
    assert torch.allclose(st2.conv[0], st.conv[0], atol=1e-6)   # projections of 1 vs 90 rows: last-bit noise


def test_long_segment_in_pieces_equals_one_piece(monkeypatch):
    """A segment longer than PIECE runs steps 1-3 piece by piece (bounded temporaries); states carry, so a second
    segment of the same batch and the output and states equal those of one piece over the whole segment."""
    import ft.runtime.layers.deltanet as dn

    layer = _random_layer()
    g = torch.Generator().manual_seed(15)
    xa, xb = torch.randn(150, 24, generator=g), torch.randn(70, 24, generator=g)
    rows = torch.cat([torch.arange(150), torch.arange(70)])

    def run():
        sa, sb = _fresh_state(layer), _fresh_state(layer)
        out = layer(torch.cat([xa, xb]), ForwardBatch([SegmentRows(0, 150, 0, sa), SegmentRows(150, 70, 0, sb)], rows))
        return out, sa, sb

    whole, wa, wb = run()
    monkeypatch.setattr(dn, "PIECE", dn.CHUNK)  # 150 -> 64 + 64 + 22, 70 -> 64 + 6
    pieces, pa, pb = run()
    assert (pieces - whole).abs().max() < 1e-5
    for p, w in ((pa, wa), (pb, wb)):
        assert (p.recurrent[0] - w.recurrent[0]).abs().max() < 1e-5 and torch.allclose(p.conv[0], w.conv[0])


def test_layer_batches_segments_independently():
    layer = _random_layer()
    g = torch.Generator().manual_seed(13)
    xa, xb = torch.randn(7, 24, generator=g), torch.randn(3, 24, generator=g)
    sa, sb = _fresh_state(layer), _fresh_state(layer)
    alone_a = layer(xa, ForwardBatch([SegmentRows(0, 7, 0, sa)], torch.arange(7)))
    alone_b = layer(xb, ForwardBatch([SegmentRows(0, 3, 0, sb)], torch.arange(3)))
    sa2, sb2 = _fresh_state(layer), _fresh_state(layer)
    both = layer(torch.cat([xa, xb]), ForwardBatch([SegmentRows(0, 7, 0, sa2), SegmentRows(7, 3, 0, sb2)],
                                                   torch.cat([torch.arange(7), torch.arange(3)])))
    assert (both - torch.cat([alone_a, alone_b])).abs().max() < 1e-5


def test_stacked_input_projections_give_the_same_output():
    """`stack_linears` (done at load on a GPU): one GEMM over both input projections' rows, whose weights become views
    of the stacked one; a quantized or biased projection is left alone."""
    layer = _random_layer()
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(14))
    want = layer(x, ForwardBatch([SegmentRows(0, 5, 0, _fresh_state(layer))], torch.arange(5)))
    qkvz, ba = layer.in_proj_qkvz.weight.clone(), layer.in_proj_ba.weight.clone()
    layer.stack_linears()
    stacked = layer._qkvzba
    assert stacked is not None and stacked.shape == (qkvz.shape[0] + ba.shape[0], 24)
    assert layer.in_proj_qkvz.weight.data_ptr() == stacked.data_ptr()
    assert torch.equal(layer.in_proj_qkvz.weight, qkvz) and torch.equal(layer.in_proj_ba.weight, ba)
    got = layer(x, ForwardBatch([SegmentRows(0, 5, 0, _fresh_state(layer))], torch.arange(5)))
    assert (got - want).abs().max() < 1e-5

    biased = _random_layer()
    biased.in_proj_ba.bias = torch.zeros(biased.in_proj_ba.weight.shape[0])
    before = biased.in_proj_ba.weight
    biased.stack_linears()
    assert biased._qkvzba is None and biased.in_proj_ba.weight is before
