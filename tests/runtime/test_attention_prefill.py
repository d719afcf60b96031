"""Chunked-prefill attention (`causal_attention` with past > 0): keys split into the past [0, past) (no mask) and the
chunk's own [past, past + T) (causal), each attended with its log-sum-exp, merged by `merge_attention`.

On CPU the CUDA flash path can't run, so the merge math and the head folding / unfolding of `_flash_split` are
checked in fp32 against a full reference, with `flash` stand-ins that honour `_cuda_flash`'s contract (a hand-written
softmax with an explicit logsumexp, and torch's CPU flash kernel). The last test compares the real CUDA path to the
masked SDPA path at bf16 tolerance, and is skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from ft.runtime.layers.attention import _flash_split, _sdpa, causal_attention, merge_attention

CUDA = torch.cuda.is_available()


def attn_lse(q, k, v, *, scale, mask=None):
    """q [..., Lq, hd], k, v [..., Lk, hd] (same leading dims), mask [Lq, Lk] bool (True = attend) -> output
    [..., Lq, hd], natural-log LSE [..., Lq] of the scaled scores; fp32 reference."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse[..., None]) @ v.float(), lse


def ref_flash(q, k, v, causal, scale):
    """Stand-in for `_cuda_flash`: [B, H, L, hd] in, (output, LSE [B, H, Lq]); causal top-left aligned."""
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril() if causal else None
    return attn_lse(q, k, v, scale=scale, mask=mask)


def cpu_flash(q, k, v, causal, scale):
    """Stand-in for `_cuda_flash` through torch's CPU flash kernel (same LSE convention)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def full_reference(q, k, v, past):
    """q [T, nq, hd], k, v [past + T, nkv, hd] -> [T, nq, hd]: query i sees keys <= past + i (GQA by head)."""
    t, nq, hd = q.shape
    r = nq // k.shape[1]
    kh, vh = (a.repeat_interleave(r, dim=1).transpose(0, 1) for a in (k, v))          # [nq, S, hd]
    mask = torch.arange(k.shape[0])[None, :] <= (past + torch.arange(t))[:, None]
    o, _ = attn_lse(q.transpose(0, 1), kh, vh, scale=hd ** -0.5, mask=mask)
    return o.transpose(0, 1)


def _qkv(t, past, nq, nkv, hd, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, nq, hd, generator=g)
    k = torch.randn(past + t, nkv, hd, generator=g)
    v = torch.randn(past + t, nkv, hd, generator=g)
    return q, k, v


@pytest.mark.parametrize("split", [1, 3, 7, 12, 19])
def test_merge_two_key_sets_is_full_attention(split):
    """Any partition of the keys of an unmasked attention, merged by LSE, equals attention over all of them."""
    g = torch.Generator().manual_seed(split)
    q, k, v = (torch.randn(3, 5, n, 16, generator=g) for n in (6, 20, 20))
    full, _ = attn_lse(q, k, v, scale=0.25)
    o1, l1 = attn_lse(q, k[..., :split, :], v[..., :split, :], scale=0.25)
    o2, l2 = attn_lse(q, k[..., split:, :], v[..., split:, :], scale=0.25)
    torch.testing.assert_close(merge_attention(o1, l1, o2, l2), full, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(merge_attention(o2, l2, o1, l1), full, atol=1e-6, rtol=1e-5)


def test_merge_extreme_lse_gap():
    """One part dominating by far more than fp32's exp range: no inf / nan, the result is that part."""
    o1, o2 = torch.randn(4, 8), torch.randn(4, 8)
    l1 = torch.tensor([0.0, 500.0, -500.0, 1e4])
    l2 = torch.tensor([0.0, -500.0, 500.0, -1e4])
    out = merge_attention(o1, l1, o2, l2)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0], (o1[0] + o2[0]) / 2)
    torch.testing.assert_close(out[1], o1[1])
    torch.testing.assert_close(out[2], o2[2])
    torch.testing.assert_close(out[3], o1[3])


def test_merge_keeps_dtype_and_computes_in_fp32():
    o1, o2 = torch.randn(2, 3, 8).bfloat16(), torch.randn(2, 3, 8).bfloat16()
    l1, l2 = torch.randn(2, 3), torch.randn(2, 3)
    out = merge_attention(o1, l1, o2, l2)
    assert out.dtype == torch.bfloat16
    w = torch.sigmoid(l1 - l2)[..., None]
    torch.testing.assert_close(out, (o1.float() * w + o2.float() * (1 - w)).bfloat16())


GEOMETRIES = [(4, 4, 16), (8, 2, 16), (16, 2, 32), (6, 1, 8)]     # (nq, nkv, hd): MHA, GQA r=4, r=8, MQA


@pytest.mark.parametrize("flash", [ref_flash, cpu_flash], ids=["ref", "cpu_flash"])
@pytest.mark.parametrize("nq,nkv,hd", GEOMETRIES)
@pytest.mark.parametrize("t,past", [(2, 1), (5, 1), (5, 4), (5, 5), (5, 6), (7, 23), (16, 3), (3, 40)])
def test_split_and_merge_matches_full_attention(flash, nq, nkv, hd, t, past):
    """`_flash_split` (past part with folded query heads + causal own part, merged) == full causal attention."""
    q, k, v = _qkv(t, past, nq, nkv, hd, seed=t * 100 + past)
    out = _flash_split(q, k, v, past, flash=flash)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, full_reference(q, k, v, past), atol=2e-6, rtol=1e-5)
    # ... and the masked SDPA path (what CUDA fell back to before, and CPU still runs).
    torch.testing.assert_close(out, _sdpa(q, k, v, past), atol=2e-6, rtol=1e-5)


def test_split_reads_cache_views_without_copy_semantics():
    """k, v handed in as the `[:end]` slice of a larger cache (as `Attention` does): rows past `end` are ignored."""
    t, past, nq, nkv, hd = 4, 9, 8, 2, 16
    q, k, v = _qkv(t, past, nq, nkv, hd)
    kc = torch.full((64, nkv, hd), float("nan"))
    vc = torch.full((64, nkv, hd), float("nan"))
    kc[:past + t], vc[:past + t] = k, v
    out = _flash_split(q, kc[:past + t], vc[:past + t], past, flash=ref_flash)
    torch.testing.assert_close(out, full_reference(q, k, v, past), atol=2e-6, rtol=1e-5)


@pytest.mark.skipif(not CUDA, reason="flash attention path is CUDA-only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nq,nkv,hd", [(32, 4, 128), (16, 2, 256), (8, 8, 128)])
@pytest.mark.parametrize("t,past", [(2, 1), (64, 1), (300, 77), (256, 1000), (1024, 3072)])
def test_cuda_chunked_flash_matches_masked_sdpa(dtype, nq, nkv, hd, t, past):
    from ft.runtime.layers import attention as A

    g = torch.Generator(device="cuda").manual_seed(t + past)
    q = torch.randn(t, nq, hd, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(past + t, nkv, hd, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(past + t, nkv, hd, device="cuda", dtype=dtype, generator=g)
    fast = A._flash_split(q, k, v, past)                               # raises if flash refuses: must not here
    with torch.nn.attention.sdpa_kernel(A._BACKENDS):
        masked = A._sdpa(q, k, v, past)
    ref = full_reference(q.float().cpu(), k.float().cpu(), v.float().cpu(), past).cuda()
    assert fast.dtype == dtype and fast.shape == q.shape
    torch.testing.assert_close(fast.float(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(fast.float(), masked.float(), atol=2e-2, rtol=2e-2)
    # The public entry point takes the fast path and agrees.
    torch.testing.assert_close(causal_attention(q, k, v, past), fast, atol=0, rtol=0)
    assert A._FLASH_OK.get((q.device.index, dtype, hd)) is True


@pytest.mark.skipif(not CUDA, reason="CUDA-only fallback")
def test_cuda_fp32_falls_back_to_masked_sdpa():
    """Flash attention refuses fp32: `causal_attention` must fall back and still be right."""
    t, past, nq, nkv, hd = 16, 5, 8, 2, 64
    q, k, v = (a.cuda() for a in _qkv(t, past, nq, nkv, hd))
    out = causal_attention(q, k, v, past)
    torch.testing.assert_close(out.cpu(), full_reference(*(a.cpu() for a in (q, k, v)), past), atol=1e-3, rtol=1e-3)


@pytest.mark.skipif(not CUDA, reason="measures CUDA allocations")
def test_cuda_chunked_flash_stays_within_its_activation_reserve():
    """A 4096-token chunk after 4096 tokens of past at qwen3moe-35b's attention (32 x 128 query heads, 4 kv heads):
    what the call allocates at its peak, beyond its inputs, is within the six [T, nq, hd] tensors that
    `sizing.activation_reserve` counts for it (an fp32 merge of the whole chunk needed twice that, and ran out of
    memory at an 8 GiB budget)."""
    t, past, nq, nkv, hd = 4096, 4096, 32, 4, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(t, nq, hd, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(past + t, nkv, hd, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    causal_attention(q[:64], k[:past + 64], v[:past + 64], past)       # flash's first call: library set-up
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = causal_attention(q, k, v, past)
    peak = torch.cuda.max_memory_allocated() - base
    assert peak <= 6 * q.numel() * q.element_size(), f"{peak >> 20} MiB"
    assert out.shape == q.shape and torch.isfinite(out).all()
