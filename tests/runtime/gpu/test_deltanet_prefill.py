"""The Triton chunked Gated DeltaNet prefill (`ft.runtime.gpu.kernels.deltanet_prefill`) against the torch reference.

Without CUDA the kernels run under Triton's interpreter (conftest.py). Chunks of 16 (tl.dot's smallest tile) at tiny
head sizes; lengths cover one partial chunk, exact chunks and a partial last chunk; hv/hk = 1 and 2; dv split over two
state-kernel programs; states carried across calls and through the layer."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from ft.runtime.gpu.kernels.deltanet_prefill import gdn_chunk_prefill  # noqa: E402
from ft.runtime.layers.batch import ForwardBatch, SegmentRows  # noqa: E402
from ft.runtime.layers.deltanet import chunk_gated_delta_rule, l2_normalize, recurrent_gated_delta_rule  # noqa: E402

from .test_deltanet_decode import LAYER, _clone, _layer, _states  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
TOL = 3e-3 if CUDA else 2e-5           # TF32 dots on the GPU
SMALL = {"BT": 16, "BV": 16}


def _inputs(t, hk, hv, dk, dv, seed):
    g = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(t, hk, dk, generator=g)) * dk ** -0.5
    k = l2_normalize(torch.randn(t, hk, dk, generator=g))
    v = torch.randn(t, hv, dv, generator=g)
    decay = -torch.exp(torch.empty(t, hv).uniform_(-4.6, 2.1, generator=g))   # g from -0.01 to -8
    beta = torch.sigmoid(torch.randn(t, hv, generator=g))
    state = torch.randn(hv, dk, dv, generator=g) * 0.5
    return [x.to(DEV) for x in (q, k, v, decay, beta, state)]


def _reference(q, k, v, decay, beta, state):
    r = v.shape[1] // q.shape[1]
    return recurrent_gated_delta_rule(q.repeat_interleave(r, 1), k.repeat_interleave(r, 1), v, decay, beta, state)


@pytest.mark.parametrize("t", [1, 16, 40])
@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 2, 16, 16), (1, 2, 16, 32), (2, 4, 32, 24)])
def test_prefill_matches_the_recurrence(t, hk, hv, dk, dv):
    q, k, v, decay, beta, s0 = _inputs(t, hk, hv, dk, dv, seed=t + dv)
    want_o, want_s = _reference(q, k, v, decay, beta, s0)
    state = s0.clone()
    o = gdn_chunk_prefill(q, k, v, decay, beta, state, config=SMALL)
    assert o.shape == (t, hv, dv)
    assert (o - want_o).abs().max() < TOL * (1 + want_o.abs().max())
    assert (state - want_s).abs().max() < TOL * (1 + want_s.abs().max())


def test_prefill_on_strided_views_and_split_calls_equal_one_call():
    """v as a column slice of a wider row (as split from the conv output); 23 + 30 tokens equal 53 at once."""
    hk, hv, dk, dv, t = 2, 4, 16, 16, 53
    q, k, v, decay, beta, s0 = _inputs(t, hk, hv, dk, dv, seed=9)
    wide = torch.randn(t, hv * dv + 8, device=DEV)
    wide[:, 8:] = v.reshape(t, -1)
    v_view = wide[:, 8:].view(t, hv, dv)
    ref_o, ref_s = chunk_gated_delta_rule(q.repeat_interleave(2, 1), k.repeat_interleave(2, 1), v, decay, beta, s0)
    s = s0.clone()
    o = torch.cat([gdn_chunk_prefill(q[:23], k[:23], v_view[:23], decay[:23], beta[:23], s, config=SMALL),
                   gdn_chunk_prefill(q[23:], k[23:], v_view[23:], decay[23:], beta[23:], s, config=SMALL)])
    assert (o - ref_o).abs().max() < TOL * (1 + ref_o.abs().max())
    assert (s - ref_s).abs().max() < TOL * (1 + ref_s.abs().max())


def test_layer_prefill_fused_equals_reference():
    """`GatedDeltaNet.__call__` with `_fused` on a two-segment prefill batch (the Triton rule) vs the torch rule."""
    layer = _layer(2, 4, 16, 16, torch.float32, seed=4)
    ref_states = _states(layer, 2, torch.float32, seed=2)
    fused_states = _clone(ref_states)
    x = torch.randn(45, 24, generator=torch.Generator().manual_seed(1)).to(DEV)
    segs = lambda st: [SegmentRows(0, 30, 3, st[0]), SegmentRows(30, 15, 8, st[1])]  # noqa: E731
    pos = torch.cat([torch.arange(3, 33), torch.arange(8, 23)]).to(DEV)
    layer._fused = False
    want = layer(x, ForwardBatch(segs(ref_states), pos))
    layer._fused = True
    got = layer(x, ForwardBatch(segs(fused_states), pos))
    assert (got - want).abs().max() < TOL * (1 + want.abs().max())
    for r, f in zip(ref_states, fused_states):
        assert (f.recurrent[LAYER] - r.recurrent[LAYER]).abs().max() < TOL * (1 + r.recurrent[LAYER].abs().max())
        assert torch.equal(f.conv[LAYER], r.conv[LAYER])


def test_rejects_bad_shapes():
    q, k, v, decay, beta, s0 = _inputs(4, 2, 4, 16, 16, seed=0)
    with pytest.raises(ValueError):
        gdn_chunk_prefill(q, k, v, decay, beta, s0[:3])
    with pytest.raises(ValueError):
        gdn_chunk_prefill(q, k, v.double(), decay, beta, s0)
