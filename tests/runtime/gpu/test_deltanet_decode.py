"""The fused Gated DeltaNet decode kernels (`ft.runtime.gpu.kernels.deltanet_decode`) against the torch reference.

Without CUDA the kernels run under Triton's interpreter (conftest.py) on CPU tensors, and `tables` holds CPU
addresses. Geometries cover hv/hk = 1 and 2, dk != dv and a dv that is not a power of two (masked tiles); several
steps run in a row so the in-place conv and recurrent state updates chain, from random non-zero states (as after a
prefill)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")

from ft.runtime.gpu.kernels.deltanet_decode import gdn_decode  # noqa: E402
from ft.runtime.layers.batch import ForwardBatch, SegmentRows, state_addresses  # noqa: E402
from ft.runtime.layers.deltanet import Conv1d, GatedDeltaNet, l2_normalize, recurrent_gated_delta_rule  # noqa: E402
from ft.runtime.layers.norm import RMSNormGated  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
K, HIDDEN, LAYER, LAYERS = 4, 24, 1, 3       # the layer under test is layer 1 of a 3-layer table

# hk, hv, dk, dv
GEOMS = [(2, 2, 16, 16), (2, 4, 16, 8), (1, 2, 8, 12)]


def _layer(hk, hv, dk, dv, dtype, seed=0):
    cfg = SimpleNamespace(linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=dk,
                          linear_value_head_dim=dv, linear_conv_kernel_dim=K, rms_norm_eps=1e-6)
    layer = GatedDeltaNet(cfg, layer=LAYER)
    g = torch.Generator().manual_seed(seed)
    c, vd = layer.conv_dim, hv * dv
    w = {"in_proj_qkvz": torch.randn(c + vd, HIDDEN, generator=g) * 0.3,
         "in_proj_ba": torch.randn(2 * hv, HIDDEN, generator=g) * 0.5,
         "conv1d": torch.randn(c, K, generator=g) * 0.5,
         "out_proj": torch.randn(HIDDEN, vd, generator=g) * 0.2}
    for name, t in w.items():
        getattr(layer, name).weight = t.to(DEV, dtype)
    layer.dt_bias = torch.randn(hv, generator=g).to(DEV)
    layer.A_log = torch.empty(hv).uniform_(0.01, 16, generator=g).log().to(DEV)
    layer.norm.weight = (1 + 0.1 * torch.randn(dv, generator=g)).to(DEV)
    return layer


def _states(layer, n, dtype, seed):
    """n SequenceState-like objects holding layer LAYER's conv / recurrent buffers, random as after a prefill."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        conv = (torch.randn(layer.conv_dim, K - 1, generator=g)).to(DEV, dtype)
        rec = (torch.randn(layer._hv, layer._dk, layer._dv, generator=g) * 0.5).to(DEV)
        out.append(SimpleNamespace(kv={}, conv={LAYER: conv}, recurrent={LAYER: rec}))
    return out


def _clone(states):
    return [SimpleNamespace(kv={}, conv={LAYER: s.conv[LAYER].clone()}, recurrent={LAYER: s.recurrent[LAYER].clone()})
            for s in states]


def _tables(states):
    return torch.stack([state_addresses(s, LAYERS) for s in states], -1).to(DEV)    # [L, 2, B]


def _tol(dtype):
    # Interpreted, the kernels round to bf16 exactly where the torch code does, so bf16 agrees to fp32 noise too; on
    # a GPU, fast exp/rsqrt and FMAs flip the odd bf16 rounding.
    return 1e-5 if dtype == torch.float32 or not CUDA else 2e-2


@pytest.mark.parametrize("hk,hv,dk,dv", GEOMS)
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_decode_steps_match_the_reference(hk, hv, dk, dv, n, dtype):
    """`GatedDeltaNet.__call__` on a decode batch, fused vs the torch per-segment path, 4 steps chained."""
    layer = _layer(hk, hv, dk, dv, dtype, seed=hk * 10 + hv + dv)
    ref_states = _states(layer, n, dtype, seed=n)
    fused_states = _clone(ref_states)
    tables = _tables(fused_states)
    g = torch.Generator().manual_seed(7)
    tol = _tol(dtype)
    for step in range(4):
        x = torch.randn(n, HIDDEN, generator=g).to(DEV, dtype)
        pos = torch.full((n,), 5 + step, device=DEV)
        layer._fused = False
        want = layer(x, ForwardBatch([SegmentRows(i, 1, 5 + step, s) for i, s in enumerate(ref_states)], pos))
        layer._fused = True
        got = layer(x, ForwardBatch([SegmentRows(i, 1, -1, s) for i, s in enumerate(fused_states)], pos,
                                    tables=tables))
        assert got.dtype == dtype and got.shape == want.shape
        assert (got.float() - want.float()).abs().max() <= tol * (1 + want.float().abs().max()), step
        for r, f in zip(ref_states, fused_states):
            assert (f.recurrent[LAYER] - r.recurrent[LAYER]).abs().max() <= tol * r.recurrent[LAYER].abs().max(), step
            assert torch.equal(f.conv[LAYER], r.conv[LAYER]), step          # the conv state is a pure shift


def _reference_core(mixed, z, b, a, w, A_log, dt_bias, norm_w, eps, conv, rec, hk, hv, dk, dv):
    """Per sequence, the layer's torch code from the projections to the normed core (rows of one sequence)."""
    conv1d, norm = Conv1d(), RMSNormGated(eps)
    conv1d.weight, norm.weight = w, norm_w
    qkv = conv1d(mixed, conv).float()
    q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q = (l2_normalize(q.reshape(1, hk, dk)) * dk ** -0.5).repeat_interleave(hv // hk, dim=1)
    k = l2_normalize(k.reshape(1, hk, dk)).repeat_interleave(hv // hk, dim=1)
    beta = torch.sigmoid(b).float()
    g = -A_log.exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    o, s = recurrent_gated_delta_rule(q, k, v.reshape(1, hv, dv), g, beta, rec)
    rec.copy_(s)
    return norm(o.to(mixed.dtype), z.reshape(1, hv, dv)).reshape(1, hv * dv)


@pytest.mark.parametrize("hk,hv,dk,dv", GEOMS[1:])
def test_kernel_updates_only_its_states(hk, hv, dk, dv):
    """gdn_decode on strided views (as split from the projections), with the states of 3 sequences laid out of order
    inside one arena with guard gaps: results equal the reference, the states change in place, nothing else does
    (inputs, the gaps, a fourth state that no row points at)."""
    n = 3
    c, vd = 2 * hk * dk + hv * dv, hv * dv
    g = torch.Generator().manual_seed(11)
    proj = torch.randn(n, c + vd, generator=g).to(DEV)
    ba = torch.randn(n, 2 * hv, generator=g).to(DEV)
    mixed, z = proj.split([c, vd], dim=-1)
    b, a = ba.split([hv, hv], dim=-1)
    w = (torch.randn(c, K, generator=g) * 0.5).to(DEV)
    A_log = torch.empty(hv).uniform_(0.01, 16, generator=g).log().to(DEV)
    dt_bias, norm_w = torch.randn(hv, generator=g).to(DEV), (1 + 0.1 * torch.randn(dv, generator=g)).to(DEV)
    conv_n, rec_n, gap = c * (K - 1), hv * dk * dv, 4         # recurrent states stay 16-byte aligned
    conv_arena = torch.randn(4 * (conv_n + gap), generator=g).to(DEV)
    rec_arena = torch.randn(4 * (rec_n + gap), generator=g).to(DEV)
    slots = [2, 0, 3]                                         # sequence i lives in slot slots[i]; slot 1 is idle
    convs = [conv_arena[s * (conv_n + gap):][:conv_n].view(c, K - 1) for s in slots]
    recs = [rec_arena[s * (rec_n + gap):][:rec_n].view(hv, dk, dv) for s in slots]
    tables = torch.tensor([[cv.data_ptr() for cv in convs], [r.data_ptr() for r in recs]], dtype=torch.int64)
    tables = tables.to(DEV)
    before = [t.clone() for t in (proj, ba, conv_arena, rec_arena)]
    want_conv, want_rec = [cv.clone() for cv in convs], [r.clone() for r in recs]
    want = torch.cat([_reference_core(mixed[i:i + 1], z[i:i + 1], b[i:i + 1], a[i:i + 1], w, A_log, dt_bias, norm_w,
                                      1e-6, want_conv[i], want_rec[i], hk, hv, dk, dv) for i in range(n)])
    got = gdn_decode(mixed, z, b, a, w, A_log, dt_bias, norm_w, 1e-6, tables, hk=hk, hv=hv, dk=dk, dv=dv)
    assert (got - want).abs().max() < 1e-5
    for i in range(n):
        assert torch.equal(convs[i], want_conv[i])
        assert (recs[i] - want_rec[i]).abs().max() < 1e-5
        assert not torch.equal(recs[i], before[3][slots[i] * (rec_n + gap):][:rec_n].view(hv, dk, dv))
    assert torch.equal(proj, before[0]) and torch.equal(ba, before[1])
    touched_conv = torch.zeros_like(conv_arena, dtype=torch.bool)
    touched_rec = torch.zeros_like(rec_arena, dtype=torch.bool)
    for s in slots:
        touched_conv[s * (conv_n + gap):][:conv_n] = True
        touched_rec[s * (rec_n + gap):][:rec_n] = True
    assert torch.equal(conv_arena[~touched_conv], before[2][~touched_conv])
    assert torch.equal(rec_arena[~touched_rec], before[3][~touched_rec])


def test_rejects_mismatched_geometry():
    mixed = torch.zeros(1, 10)
    with pytest.raises(ValueError):
        gdn_decode(mixed, torch.zeros(1, 4), torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(10, K),
                   torch.zeros(2), torch.zeros(2), torch.zeros(2), 1e-6, torch.zeros(2, 1, dtype=torch.int64),
                   hk=1, hv=2, dk=2, dv=2)
