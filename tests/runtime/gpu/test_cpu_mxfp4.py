"""The CPU expert kernel on MXFP4 records (gpt-oss: E8M0 scale per 32, biases, clamped SwiGLU) against the PyTorch
reference on the exact dequantization, for every ISA build this CPU runs; and the refusal of other record schemes."""

from __future__ import annotations

import ctypes
import dataclasses
import platform

import numpy as np
import pytest
import torch

from ft.runtime.gpu.cpu import build as cpu_build
from ft.runtime.gpu.cpu.kernel import CpuMoe, c_layout, load_library
from ft.runtime.gpu.kernels.moe_reference import expert_weights, moe_ref
from ft.runtime.gpu.record_layout import RecordLayout

from .gpu_fixtures import random_mxfp4_records, rel_err

needs_cc = pytest.mark.skipif(cpu_build.compiler() is None, reason="no C compiler")
H, I, E = 128, 64, 6


def _levels() -> list[tuple[str, tuple[str, ...]]]:
    """(name, compiler flags) of each prebuilt ISA level this CPU runs (the flags follow -march=native, so the
    level's -march wins: its code path, not the native one, is tested)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return [("native", ())]
    have = cpu_build.cpu_flags()
    return [(name, flags) for name, need, flags in cpu_build.LEVELS if set(need) <= have]


def _records(layout: RecordLayout, seed: int, *, biases: bool) -> torch.Tensor:
    recs = random_mxfp4_records(layout, E, seed)
    if not biases:
        for r in recs:
            layout.view(r, "gate_up_bias").zero_()
            layout.view(r, "down_bias").zero_()
    return recs


def _route(T: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    slots = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    flat = slots.reshape(-1).numpy()
    uniq = np.unique(flat)
    groups = [np.nonzero(flat == s)[0] for s in uniq]
    return x, slots, w, uniq, groups, np.arange(flat.size) // k


@needs_cc
@pytest.mark.parametrize("level,flags", _levels(), ids=[n for n, _ in _levels()])
@pytest.mark.parametrize("act,biases", [("clamped_swiglu", True), ("clamped_swiglu", False), ("silu", True),
                                        ("silu", False), ("clamped_silu", False)])
@pytest.mark.parametrize("T,k,seed", [(1, 4, 0), (5, 3, 1)])
def test_c_kernel_matches_the_reference_on_mxfp4_records(level, flags, act, biases, T, k, seed):
    layout = RecordLayout.packed(H, I, "mxfp4", act=act, alpha=1.702, limit=7.0)
    recs = _records(layout, seed, biases=biases)
    x, slots, w, uniq, groups, pair_tok = _route(T, k, seed)
    moe = CpuMoe(layout, threads=2, backend="c", extra_flags=flags)
    assert moe.backend == ("c-avx512" if level.startswith("avx512") else "c")
    args = ([recs[int(s)] for s in uniq], groups, pair_tok, w.reshape(-1).numpy(), x)
    got = moe(*args)
    ref = moe_ref(recs, layout, x.bfloat16(), slots, w)
    assert rel_err(got, ref) < 1e-5
    assert torch.equal(CpuMoe(layout, threads=1, backend="c", extra_flags=flags)(*args), got)  # any thread count
    y, _ = moe.submit(*args).result()  # the native worker runs the same call
    assert torch.equal(y, got)
    moe.close()


def test_the_clamp_and_the_biases_matter_at_these_sizes():
    """The cases above test the clamp and the biases only if they change the result: the gate/up dots exceed the
    limit on both sides, and the reference moves when either is dropped."""
    layout = RecordLayout.packed(H, I, "mxfp4", act="clamped_swiglu", limit=7.0)
    recs = _records(layout, 0, biases=True)
    x, slots, w, *_ = _route(5, 3, 0)
    gate_up, _ = expert_weights(recs[0], layout)
    gu = x.bfloat16().float() @ gate_up.T
    assert bool((gu[:, :I] > 7).any()) and bool((gu[:, I:].abs() > 7).any())
    ref = moe_ref(recs, layout, x.bfloat16(), slots, w)
    unclamped = dataclasses.replace(layout, limit=1e30)
    assert rel_err(moe_ref(recs, unclamped, x.bfloat16(), slots, w), ref) > 1e-2
    assert rel_err(moe_ref(_records(layout, 0, biases=False), layout, x.bfloat16(), slots, w), ref) > 1e-2


@needs_cc
def test_e8m0_scales_are_exact_powers_of_two_over_the_whole_range():
    """Scales far from 1 (2^-66 .. 2^-59) decode as exact powers of two: the result scales with them exactly."""
    layout = RecordLayout.packed(H, I, "mxfp4", act="silu")
    recs = _records(layout, 3, biases=False)
    x, slots, w, uniq, groups, pair_tok = _route(2, 2, 3)
    moe = CpuMoe(layout, threads=2, backend="c")
    args = ([recs[int(s)] for s in uniq], groups, pair_tok, w.reshape(-1).numpy(), x)
    base = moe(*args)
    for r in recs:  # down scales times 2^-60: y times 2^-60 (the activations are unchanged)
        layout.view(r, "down_scale").sub_(60)
    assert torch.equal(moe(*args), base * 2.0 ** -60)
    assert rel_err(moe(*args), moe_ref(recs, layout, x.bfloat16(), slots, w)) < 1e-5


def _unknown_scheme(layout: RecordLayout) -> RecordLayout:
    """A layout of a scheme the CPU kernel has no decode for. RecordLayout itself refuses names outside its SCHEMES,
    so this stands for a scheme the GPU kernels gain before the CPU kernel does."""
    other = dataclasses.replace(layout)
    object.__setattr__(other, "scheme", "mxfp8")
    return other


@pytest.mark.parametrize("backend", ["auto", "c", "torch"])
def test_a_scheme_without_a_cpu_decode_is_refused(backend):
    with pytest.raises(ValueError, match="reads nvfp4, mxfp4 records, not 'mxfp8'"):
        CpuMoe(_unknown_scheme(RecordLayout.packed(H, I, "mxfp4")), backend=backend)
    other_act = dataclasses.replace(RecordLayout.packed(H, I, "mxfp4"))
    object.__setattr__(other_act, "act", "gelu")
    with pytest.raises(ValueError, match="not 'gelu'"):
        CpuMoe(other_act, backend=backend)


@needs_cc
def test_the_c_kernel_refuses_a_layout_it_cannot_read():
    """The kernel checks the layout itself too (ctypes callers other than CpuMoe): code -1 / no lane."""
    lib = load_library()
    layout = RecordLayout.packed(H, I, "mxfp4")
    for field, value in (("scheme", 2), ("act", 5), ("inter", 48)):
        clay = c_layout(layout)
        setattr(clay, field, value)
        y = torch.zeros(1, H)
        rc = lib.ft_nvfp4_moe(ctypes.byref(clay), 0, None, np.zeros(1, np.int32).ctypes.data, None, None, 1,
                              torch.zeros(1, H).data_ptr(), None, None, y.data_ptr(), 1)
        assert rc == -1, field
        mb = torch.zeros(1 << 16, dtype=torch.int32)
        base = (ctypes.c_void_p * 1)(None)
        assert not lib.ft_lane_new(ctypes.byref(clay), mb.data_ptr(), 1, 1, base, np.zeros(1, np.int64).ctypes.data,
                                   np.zeros(1, np.int32).ctypes.data, 1), field
