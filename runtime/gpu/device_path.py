"""Sync-free MoE calls of `GpuExperts`: the routing stays on the device when every routed expert is resident.

A call takes this path (`uses_device_plan`) when
  * `GpuExperts.device_plan` is on (default on CUDA; the CPU emulation opts in),
  * the layer is an MoE layer whose experts are all preloaded and never evicted (mode "resident"),
  * T * k <= MAX_DEVICE_PAIRS (decode; prefill calls: see below; other calls keep the host-planned tile kernel).
Such a call counts calls / tokens / pairs only: hits, misses, per-layer counts and the routing trace need the routing
on the host, so they stay untouched (in these modes every expert is a hit anyway). It advances the cache clock (a
host integer), takes the layer's row of the device slot table (uploaded only when the host table changed; never after
`allocate` in these modes) and runs the device-planned kernels (`nvfp4_decode_mma.decode_kernel`: per-pair FMA
kernels for 1-2 tokens, tensor-core kernels per distinct expert from 3). No host sync, no `.cpu()`.

`device_kernel` (the kernel part alone) also serves host-planned decode calls of offloaded layers, after their
admits: their routing went to the host for the cache anyway, but the GPU share needs no host-built plan.

Prefill calls of the same layers (`uses_device_prefill`: T >= `prefill_tokens`, the host path's own prefill bound, and
T * k > MAX_DEVICE_PAIRS) keep their routing on the device too: `prefill_plan.py` groups the pairs by expert with torch
ops and runs the tile kernels of `nvfp4_triton.py` (tensor-core dots) over a grid of fixed size. They count calls /
tokens / pairs / prefill_calls. The first such call of a `GpuExperts` is checked once against the host-planned call
on the same tiles (it syncs); a failure turns this path off for it (logged), so prefill falls back to the host plan.

On device "cpu" (emulation) the same path runs the PyTorch reference on slots gathered from the device table, or the
Triton kernels under the interpreter when `GpuExperts.interpret` is set.
"""

from __future__ import annotations

import logging

import torch

from .kernels.moe_reference import moe_ref

log = logging.getLogger("ft.gpu")

SELF_CHECK_TOL = 1e-2  # both kernels dequantize bit-identically; they differ by fp32 summation order only
MAX_DEVICE_PAIRS = 64  # T * k bound of the device-planned path (grid (pairs, N tiles), one pair per program)


def uses_device_plan(ex, layer: int, num_tokens: int) -> bool:
    """Whether `ex(layer, x [num_tokens, H], ...)` takes the device-planned path (see the module docstring)."""
    o = ex.opts
    return (ex.device_plan and layer in ex.banks and o.mode == "resident"
            and 0 < num_tokens * ex.k <= MAX_DEVICE_PAIRS)


def count_call(ex, num_tokens: int, calls: int = 1) -> None:
    """What `calls` layer calls whose routing stays on the device count at once (calls, tokens, pairs); advances the
    clock by one per call."""
    c = ex.counters
    c["calls"] += calls
    c["tokens"] += calls * num_tokens
    c["pairs"] += calls * num_tokens * ex.k
    ex.cache.clock += calls


def uses_device_prefill(ex, layer: int, num_tokens: int) -> bool:
    """Whether `ex(layer, x [num_tokens, H], ...)` is a prefill planned on the device (see the module docstring)."""
    o = ex.opts
    return (ex.device_plan and getattr(ex, "_device_prefill_ok", None) is not False and layer in ex.banks
            and o.mode == "resident" and num_tokens >= o.prefill_tokens
            and num_tokens * ex.k > MAX_DEVICE_PAIRS)


def device_prefill_call(ex, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                        topk_weights: torch.Tensor) -> torch.Tensor:
    """The device-planned prefill call -> fp32 [T, H]. The caller checked `uses_device_prefill`."""
    count_call(ex, topk_ids.shape[0])
    ex.counters["prefill_calls"] += 1
    row = ex.cache.device_table(ex.device).row(layer)
    if ex.device.type == "cuda" or ex.interpret:
        from .prefill_plan import moe_nvfp4_prefill

        if getattr(ex, "_device_prefill_ok", None):
            return moe_nvfp4_prefill(ex.pool, ex.layout, x, topk_ids, row, topk_weights)
        return _first_prefill(ex, x, topk_ids, row, topk_weights, moe_nvfp4_prefill)
    return moe_device_ref(ex.pool, ex.layout, x, topk_ids, row, topk_weights)


def _first_prefill(ex, x, topk_ids, row, topk_weights, kernel) -> torch.Tensor:
    """First device-planned prefill: `_checked` against the host-planned call on the same tiles. A plan or kernel that
    fails or disagrees sets `ex._device_prefill_ok = False`: prefill routing goes through the host."""
    from .kernels.nvfp4_triton import pick_blocks

    T, k = topk_ids.shape
    blocks = pick_blocks(T * k / min(ex.E, T * k), x.shape[1], ex.layout.inter)
    got, want = _checked(ex, x, topk_ids, row, topk_weights, kernel, "prefill", blocks=blocks)
    ex._device_prefill_ok = got is not None
    return want if got is None else got


def device_call(ex, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """The device-planned call -> fp32 [T, H]. The caller checked `uses_device_plan`."""
    count_call(ex, topk_ids.shape[0])
    return device_kernel(ex, layer, x, topk_ids, topk_weights)


def uses_device_kernel(ex, num_tokens: int) -> bool:
    """Whether a host-planned decode call (offloaded layers: the routing was brought to the host for the cache) still
    computes its GPU share with the device-planned kernel, through the slot table row (see `device_kernel`)."""
    return ex.device_plan and 0 < num_tokens * ex.k <= MAX_DEVICE_PAIRS


def device_kernel(ex, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                  exact: bool = False) -> torch.Tensor:
    """[T, H] (x's dtype on CUDA, stored by the kernel without a cast launch; fp32 with `exact`, for callers that add
    another partial sum, and on the CPU) = sum over the routed pairs whose expert has a slot in the layer's row of the
    device slot table
    (re-uploaded when the host table changed, e.g. by this call's admits); pairs without a slot (experts computed on
    the CPU) contribute 0. The kernel resident layers use, so an offloaded decode with no CPU share computes exactly
    what a resident one does, whatever slots the experts sit in."""
    row = ex.cache.device_table(ex.device).row(layer)
    if ex.device.type == "cuda" or ex.interpret:
        from .kernels.nvfp4_decode_mma import decode_kernel

        kernel = decode_kernel(x.shape[0])
        if kernel in getattr(ex, "_checked_kernels", ()):
            # the interpreter's bf16 store truncates instead of rounding: fp32 off CUDA
            out_dtype = x.dtype if ex.device.type == "cuda" and not exact else torch.float32
            return kernel(ex.pool, ex.layout, x, topk_ids, row, topk_weights, out_dtype=out_dtype)
        return _first_call(ex, x, topk_ids, row, topk_weights, kernel)
    return moe_device_ref(ex.pool, ex.layout, x, topk_ids, row, topk_weights)


def _first_call(ex, x, topk_ids, row, topk_weights, kernel) -> torch.Tensor:
    """First device-planned decode call of a process with this kernel: `_checked` against the host-planned kernel. A
    kernel that fails to build or disagrees turns the path off for this `GpuExperts`: a correct slower decode beats a
    wrong fast one on a GPU/Triton combination the tests have not seen."""
    got, want = _checked(ex, x, topk_ids, row, topk_weights, kernel, "decode")
    if got is None:
        ex.device_plan = False
        return want
    ex._checked_kernels = getattr(ex, "_checked_kernels", set()) | {kernel}
    return got


def _checked(ex, x, topk_ids, row, topk_weights, kernel, what: str, **kw):
    """Run `kernel` (compiling it) and the host-planned call on the same pairs (this syncs) -> (kernel's result, or
    None if it failed or is off by more than SELF_CHECK_TOL (logged); the host-planned result)."""
    ids = topk_ids.reshape(-1).to("cpu").numpy()
    slots = row.to("cpu")
    want = ex._gpu_moe(x, ids, {int(e): int(slots[int(e)]) for e in set(ids.tolist())}, topk_weights, **kw)
    try:
        got = kernel(ex.pool, ex.layout, x, topk_ids, row, topk_weights, **kw)
        err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
    except Exception as e:  # noqa: BLE001 - any plan/build/launch failure falls back to the host-planned path
        got, err, why = None, float("inf"), f"{type(e).__name__}: {e}"
    else:
        why = f"relative error {err:.2e} against the host-planned kernel"
    if got is None or not err <= SELF_CHECK_TOL:
        log.warning("device-planned MoE %s disabled (%s); its routing goes through the host", what, why)
        return None, want
    return got, want


def moe_device_ref(pool: torch.Tensor, layout, x: torch.Tensor, topk_ids: torch.Tensor, slot_row: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor:
    """Reference of the device-planned kernel: slots = slot_row[topk_ids] gathered on the device, then `moe_ref`
    (pairs with slot -1 contribute nothing). `moe_ref` itself reads slots on the host: emulation and tests only."""
    return moe_ref(pool, layout, x, slot_row.long()[topk_ids.long()], weights)
