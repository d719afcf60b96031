"""Attention with sinks and a sliding window (gpt_oss prefill, `ft.runtime.layers.sink_attention`).

`sink_attention` is the reference: it is checked by hand against its own blocking and window here, and against
transformers through the gpt_oss model tests. `sink_flash` (one flash call, the sink applied through the LSE) is
checked on CPU with a stand-in that honours `_cuda_flash_local`'s contract, its probe against stand-ins that get the
window's alignment wrong or refuse; the last test runs the real CUDA flash path and is skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from ft.runtime.layers import sink_attention as sa

CUDA = torch.cuda.is_available()


def ref_flash_local(q, k, v, window, scale, *, top_left=False):
    """Stand-in for `_cuda_flash_local`: [1, L, heads, hd] in (GQA by head), (output, fp32 LSE [1, nq, Lq]);
    causal bottom-right aligned (`top_left`: the wrong alignment, for the probe to catch)."""
    t, nq, s = q.shape[1], q.shape[2], k.shape[1]
    r = nq // k.shape[2]
    kh, vh = (a[0].repeat_interleave(r, dim=1).transpose(0, 1).float() for a in (k, v))     # [nq, S, hd]
    scores = (q[0].transpose(0, 1).float() @ kh.transpose(1, 2)) * scale                     # [nq, T, S]
    pos = torch.arange(t)[:, None] + (0 if top_left else s - t)
    j = torch.arange(s)[None, :]
    visible = (j <= pos) & ((j > pos - window) if window else True)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    o = torch.exp(scores - lse[..., None]) @ vh
    return o.transpose(0, 1).unsqueeze(0).to(q.dtype), lse.unsqueeze(0)


def _problem(t, past, nq, nkv, hd, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, nq, hd, generator=g)
    k, v = (torch.randn(past + t, nkv, hd, generator=g) for _ in range(2))
    return q, k, v, torch.randn(nq, generator=g) * 2


def test_sink_attention_blocks_match_one_block(monkeypatch):
    """Query blocking (bounded score matrices) does not change the result; the window masks what it should."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 8, generator=gen) for n, h in ((13, 4), (20, 2), (20, 2)))
    sinks = torch.randn(4, generator=gen)
    whole = sa.sink_attention(q, k, v, 7, sinks, 5)
    monkeypatch.setattr(sa, "SINK_QUERY_BLOCK", 3)
    assert torch.allclose(sa.sink_attention(q, k, v, 7, sinks, 5), whole, atol=1e-6)
    # long contexts: the score cap takes blocks down to 16 rows (33 queries over 40 keys, 4 heads: 16 + 16 + 1)
    q3, k3, v3 = (torch.randn(n, h, 8, generator=gen) for n, h in ((33, 4), (40, 2), (40, 2)))
    monkeypatch.setattr(sa, "SINK_QUERY_BLOCK", 256)
    full = sa.sink_attention(q3, k3, v3, 7, sinks, 0)
    calls = []
    monkeypatch.setattr(sa.torch, "softmax", lambda x, dim: calls.append(x.shape[-2]) or x.softmax(dim))
    monkeypatch.setattr(sa, "SINK_SCORE_ELEMENTS", 1)
    assert torch.allclose(sa.sink_attention(q3, k3, v3, 7, sinks, 0), full, atol=1e-6) and calls == [16, 16, 1]
    # the last query (position 19) with window 5 sees keys 15..19 only: changing key 14 changes nothing
    k2 = k.clone()
    k2[14] += 10
    assert torch.allclose(sa.sink_attention(q[-1:], k2, v, 19, sinks, 5), whole[-1:], atol=1e-6)
    assert not torch.allclose(sa.sink_attention(q[-1:], k2, v, 19, sinks, 0),
                              sa.sink_attention(q[-1:], k, v, 19, sinks, 0), atol=1e-3)




@pytest.mark.parametrize("nq,nkv,hd", [(4, 2, 8), (8, 8, 16), (6, 1, 8)])
@pytest.mark.parametrize("t,past,window", [(1, 0, 0), (5, 0, 3), (7, 13, 5), (4, 30, 0), (9, 2, 128), (16, 40, 1)])
@pytest.mark.parametrize("with_sinks", [True, False])
def test_sink_flash_matches_the_reference(nq, nkv, hd, t, past, window, with_sinks):
    """One flash call + the LSE rescale == the blocked softmax with the sink column dropped, for windows inside the
    past, wider than the context, and of one key."""
    q, k, v, sinks = _problem(t, past, nq, nkv, hd, seed=t * 31 + past)
    sinks = sinks if with_sinks else None
    out = sa.sink_flash(q, k, v, sinks, window, flash=ref_flash_local)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, sa.sink_attention(q, k, v, past, sinks, window), atol=2e-6, rtol=1e-5)


def test_sinks_take_probability_mass():
    """A sink far above every score takes nearly all of each row's mass (output ~ 0); far below, none of it."""
    q, k, v, _ = _problem(5, 3, 4, 2, 8)
    plain = sa.sink_flash(q, k, v, None, 0, flash=ref_flash_local)
    low = sa.sink_flash(q, k, v, torch.full((4,), -1e4), 0, flash=ref_flash_local)
    high = sa.sink_flash(q, k, v, torch.full((4,), 1e4), 0, flash=ref_flash_local)
    torch.testing.assert_close(low, plain)
    assert high.abs().max() < 1e-6 < plain.abs().max()


def test_probe_accepts_a_correct_flash_and_refuses_wrong_ones(monkeypatch):
    """The probe keeps flash on only when it computes the reference: a top-left-aligned window (the other causal
    convention) or a flash that raises turns it off for that geometry, once (cached), and warns."""
    monkeypatch.setattr(sa, "_SINK_FLASH_OK", {})
    q, k, _, sinks = _problem(3, 4, 4, 2, 8)
    assert sa._sink_flash_ok(q, k, sinks, flash=ref_flash_local)

    def misaligned(*args):
        return ref_flash_local(*args, top_left=True)

    def refuses(*args):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer")

    calls = []
    for bad, shape in ((misaligned, (6, 3, 8)), (refuses, (8, 2, 8))):
        q2, k2, _, s2 = _problem(3, 4, *shape)
        assert not sa._sink_flash_ok(q2, k2, s2, flash=lambda *a, f=bad: calls.append(1) or f(*a))
        n = len(calls)
        assert not sa._sink_flash_ok(q2, k2, s2, flash=lambda *a: calls.append(1))  # cached: not probed again
        assert len(calls) == n
    assert len(sa._SINK_FLASH_OK) == 3


@pytest.mark.skipif(not CUDA, reason="flash attention path is CUDA-only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,past,window", [(1, 0, 0), (7, 13, 5), (300, 77, 128), (512, 1000, 128), (1024, 3072, 0),
                                           (4096, 4096, 128)])
def test_cuda_sink_flash_matches_the_reference(dtype, t, past, window):
    """gpt-oss-20b's attention geometry (64 q heads, 8 kv heads, hd 64): the real flash path against the reference,
    and `windowed_attention` takes it (the probe passed); its peak stays a few [T, nq, hd] (the reference's blocks
    are what ran out of memory at an 8 GiB budget)."""
    nq, nkv, hd = 64, 8, 64
    q, k, v, sinks = (a.to("cuda", dtype) for a in _problem(t, past, nq, nkv, hd, seed=t + past))
    sa.windowed_attention(q, k, v, past, sinks, window)  # the geometry's one-time probe runs outside the measure
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = sa.windowed_attention(q, k, v, past, sinks, window)
    peak = torch.cuda.max_memory_allocated() - base
    assert sa._SINK_FLASH_OK[(q.device.index, dtype, nq, nkv, hd, True)] is True
    ref = sa.sink_attention(q.float(), k.float(), v.float(), past, sinks.float(), window)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    assert peak <= 4 * q.numel() * q.element_size() + (1 << 20)
