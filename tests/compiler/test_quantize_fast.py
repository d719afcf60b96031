"""The fast NVFP4 quantizer (`ft.compiler.quant.nvfp4`: bit arithmetic, row chunks) against a literal reference of the
documented rule, on random weights plus every edge the rule names: E2M1 ties, zeros and negative zeros, blocks whose
scale underflows e4m3, saturation (a global smaller than amax / 2688), the extremes of bf16 / float32 without inf, and
the parallel compile path (same bytes with any thread count)."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest
import torch

from ft.compiler import CheckpointError, compile_checkpoint
from ft.compiler.expert_jobs import ExpertJobs
from ft.compiler.quant import nvfp4 as q
from ft.compiler.synth import synth
from ft.formats.quant import nvfp4 as fmt
from ft.formats.reader import STAMP_NAME

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def ref_code(x: float) -> int:
    """One float32 value (already divided by its block scale) -> E2M1 code: the nearest grid value, ties to the even
    code, saturating at 6; the sign bit set where x < 0 (so -0.0 -> 0). Distances are exact rationals."""
    a = abs(Fraction(x))
    dist = [abs(a - Fraction(g)) for g in GRID]
    best = min(dist)
    mag = min(i for i, d in enumerate(dist) if d == best and (dist.count(best) == 1 or i % 2 == 0))
    return mag | (8 if x < 0 else 0)


def ref_quantize(w: torch.Tensor, s2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 2-5 of the module doc written out element by element: (packed u8 [out, in/2], e4m3 scales)."""
    w32 = w.float()
    out, n = w32.shape
    codes = torch.zeros(out, n, dtype=torch.uint8)
    scales = torch.zeros(out, n // 16)
    for o in range(out):
        for b in range(n // 16):
            blk = w32[o, 16 * b:16 * b + 16]
            bs = (blk.abs().max() / (6.0 * s2)).clamp(max=448.0).to(torch.float8_e4m3fn).float()
            bs = torch.ones_like(bs) if bs == 0 else bs
            scales[o, b] = bs
            x = blk / (bs * s2)  # float32 division, as the rule says
            for i in range(16):
                codes[o, 16 * b + i] = ref_code(x[i].item())
    return codes[:, 0::2] | (codes[:, 1::2] << 4), scales.to(torch.float8_e4m3fn)


def _edge_weight(g: torch.Generator, dtype: torch.dtype, extreme: bool) -> torch.Tensor:
    w = torch.randn(12, 64, generator=g) * torch.rand(12, 1, generator=g).pow(3) * 0.05
    w[0, :16] = 0.0
    w[0, 16:32] = -0.0  # negative zeros: code 0, not 8
    w[0, 32:48] = torch.tensor([0.0, -0.0] * 8)
    w[1, :16] = 1e-38 * torch.randn(16, generator=g)  # block scale underflows e4m3 -> 1.0, codes 0 / 8
    w[1, 16:32] = -1e-40  # float32 subnormals (flush in bf16)
    w[2, :16] = torch.tensor([6, -6, 5, 3.5, 3, 2.5, 2, 1.75, 1.5, 1.25, 1, .75, .5, .25, 0, -5]) * 0.01  # exact ties
    if extreme:  # inf-free extremes: the dtype's largest values set the global (the other rows then underflow)
        w[3] = torch.finfo(dtype).max * torch.sign(torch.randn(64, generator=g))
    w[4, :16] = torch.finfo(dtype).tiny
    w[5, ::2] *= 1e-4  # wide range inside each block: many small codes, negative x rounding to code 8
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale_2", [None, "small", "large", "extreme"])
def test_fast_path_matches_the_literal_rule(dtype: torch.dtype, scale_2: str | None) -> None:
    g = torch.Generator().manual_seed(11)
    w = _edge_weight(g, dtype, scale_2 == "extreme")
    amax_s2 = q.global_scale(w)
    # small: block scales saturate at 448 and codes at 6; large: a valid larger global (ModelOpt allows it)
    s2 = {None: None, "extreme": None, "small": amax_s2 / 37.0, "large": amax_s2 * 8.0}[scale_2]
    packed, scales, got_s2 = q.quantize(w, s2)
    ref_packed, ref_scales = ref_quantize(w, got_s2)
    assert torch.equal(got_s2, amax_s2 if s2 is None else s2)
    assert torch.equal(scales.view(torch.uint8), ref_scales.view(torch.uint8))
    assert torch.equal(packed, ref_packed)
    if scale_2 == "small":
        assert (fmt.unpack_nibbles(packed) & 7 == 7).any()  # saturation was exercised
    assert (fmt.unpack_nibbles(packed[0, :24]) == 0).all()  # zeros and negative zeros: code 0


def test_codes_of_every_tie_and_its_neighbours() -> None:
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, 7.0, 1e38])
    up, down = torch.nextafter(ties, torch.tensor(1e39)), torch.nextafter(ties, torch.tensor(-1.0))
    x = torch.cat([ties, up, down, -ties, -up, -down, torch.tensor([-0.0, -1e-45, 1e-45, 3e38, -3e38])])
    want = torch.tensor([ref_code(v) for v in x.tolist()], dtype=torch.uint8)
    assert torch.equal(q.e2m1_codes(x), want)


def test_codes_over_all_float32_magnitudes_below_eight() -> None:
    """A stride through every float32 bit pattern in [0, 8): the bit-arithmetic codes against the threshold rule."""
    bits = torch.arange(0, 0x41000000, 997, dtype=torch.int64).to(torch.int32)
    x = torch.cat([bits.view(torch.float32), -bits.view(torch.float32)])
    thresholds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    a = x.abs()
    mag = (a.unsqueeze(-1) > thresholds).sum(-1) + (a == 0.75) + (a == 1.75) + (a == 3.5)
    want = (mag | ((x < 0).long() << 3)).to(torch.uint8)
    assert torch.equal(q.e2m1_codes(x), want)


@pytest.mark.parametrize("chunk", [16, 48, 1 << 16])
def test_row_chunking_does_not_change_bytes(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(37, 96, generator=g) * 0.02).bfloat16()
    want = q.quantize(w.float())
    monkeypatch.setattr(q, "CHUNK_ELEMS", chunk)
    got = q.quantize(w)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8))
    assert torch.equal(got[2], want[2])


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="in % 16"):
        q.quantize(torch.zeros(4, 24))
    with pytest.raises(ValueError, match="float32/bfloat16/float16"):
        q.quantize(torch.zeros(4, 32, dtype=torch.int32))


# -- the parallel compile path ---------------------------------------------------------------------------------------

def test_expert_jobs_write_in_order_bounded_and_raise_the_first_failure() -> None:
    jobs = ExpertJobs(3, max_bytes=1000)
    try:
        events: list[tuple[str, int]] = []

        def read(e: int):
            events.append(("read", e))
            return (lambda: e * e), 300  # 300 bytes each: at most 3 held under max_bytes=1000

        def write(e: int, v: int) -> None:
            assert v == e * e
            events.append(("write", e))

        jobs.run(10, read, write)
        assert [e for k, e in events if k == "write"] == list(range(10))
        held = 0
        for k, _ in events:
            held += 1 if k == "read" else -1
            assert held <= 4  # three held plus the one just read, waiting for room
        written: list[int] = []

        def bad_read(e: int):
            def job() -> int:
                if e == 4:
                    raise ValueError("expert 4 is bad")
                return e
            return job, 0

        with pytest.raises(ValueError, match="expert 4 is bad"):
            jobs.run(10, bad_read, lambda e, v: written.append(e))
        assert written == [0, 1, 2, 3]
    finally:
        jobs.close()
    with pytest.raises(ValueError, match=">= 1"):
        ExpertJobs(0)


@pytest.mark.parametrize("layout,quant", [("per_expert", "none"), ("fused", "none"), ("per_expert", "fp8")])
def test_compile_bytes_do_not_depend_on_threads(tmp_path: Path, layout: str, quant: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import ft.compiler.emit as emit

    workers = []
    monkeypatch.setattr(emit, "ExpertJobs", lambda n: workers.append(n) or ExpertJobs(n))
    src = synth("qwen3_5_moe", "tiny", tmp_path / "src", dtype="bf16", expert_layout=layout, quant=quant,
                twin=False)
    one = compile_checkpoint(src, tmp_path / "one.ftw", progress=False, quantize="nvfp4", threads=1)
    many = compile_checkpoint(src, tmp_path / "many.ftw", progress=False, quantize="nvfp4", threads=3)
    assert workers == [1, 3]  # the threads asked for reach the workers
    names = sorted(p.name for p in one.iterdir())
    assert names == sorted(p.name for p in many.iterdir())
    for n in set(names) - {STAMP_NAME}:
        assert (one / n).read_bytes() == (many / n).read_bytes(), n


def test_bad_thread_counts_are_refused(tmp_path: Path) -> None:
    for bad in (0, -2, 1.5, True):
        with pytest.raises(CheckpointError, match="positive number of threads"):
            compile_checkpoint(tmp_path, tmp_path / "x.ftw", progress=False, quantize="nvfp4", threads=bad)


def test_eager_fallback_gives_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without TorchScript the same functions run eagerly: same bytes (scripted ones run unoptimized, as eager)."""
    g = torch.Generator().manual_seed(8)
    w = _edge_weight(g, torch.bfloat16, False)
    x = torch.randn(999, generator=g) * 4
    want, want_codes = q.quantize(w), q.e2m1_codes(x)
    monkeypatch.setattr(q, "_scripted", lambda: (q._codes_into, q._quantize_loop))
    got = q.quantize(w)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8))
    assert torch.equal(q.e2m1_codes(x), want_codes)
