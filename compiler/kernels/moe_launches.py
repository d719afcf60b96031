"""The launches of the routed-expert kernels for one model (`launches.GROUPS["moe"]`, module docstring of
`launches.py`): the device-planned decode kernels (resident and mapped, both output dtypes, the tensor-core ones above
two tokens), mode mapped's gather with the CPU lane's post and wait for every layer and staging-row class, the lane's
start-up calibration gathers, resident prefill tiles and the host-planned tile kernels of every tile config.
"""

from __future__ import annotations

import itertools

import torch

from .launches import ADDR, F32, MAX_DECODE, Geometry


def moe_launches(g: Geometry, lengths: list[int]) -> None:
    if not g.moe_layers:
        return
    from ft.runtime.gpu.cpu import lane as cpu_lane
    from ft.runtime.gpu.cpu.lane_rates import COPY_RATE_MISSES
    from ft.runtime.gpu.kernels.gather import gather_missing
    from ft.runtime.gpu.host_plan import moe_nvfp4
    from ft.runtime.gpu.kernels.nvfp4_decode import moe_nvfp4_device
    from ft.runtime.gpu.kernels.nvfp4_decode_mma import moe_nvfp4_mma
    from ft.runtime.gpu.kernels.nvfp4_triton import TILE_CONFIGS
    from ft.runtime.gpu.prefill_plan import moe_nvfp4_prefill
    from ft.runtime.gpu.record_layout import SCHEMES, RecordLayout

    scheme, act, alpha, limit = g.experts
    if scheme not in SCHEMES:  # no GPU expert kernel for this bank (its experts run on the CPU)
        return
    H, I, E, k, W = g.H, g.I, g.E, g.k, cpu_lane.MAX_DEVICE_PAIRS
    layout = (RecordLayout(*g.record) if g.record else
              RecordLayout.packed(H, I, scheme, act=act, alpha=alpha, limit=limit))  # the compiler's component order
    s16 = -(-E // 16) * 16  # staging rows start at the slot count: one of each integer class (== 1, % 16, other)
    staging = (1, s16, s16 + 1)
    pool = torch.zeros(s16 + 1 + W, layout.stride, dtype=torch.uint8)
    row = torch.arange(E, dtype=torch.int32)
    table = torch.zeros(max(g.moe_layers) + 1, E, dtype=torch.int32)
    state, split = torch.zeros(2, dtype=torch.int32), torch.zeros(4)
    for T in (t for t in lengths if t <= MAX_DECODE or t * k <= W):  # device-planned decode (`device_path`)
        ids, w = torch.arange(T * k).view(T, k) % E, torch.ones(T, k)
        x = torch.zeros(T, H, dtype=g.dtype)
        for combine in ("tokens", "pairs"):
            moe_nvfp4_device(pool, layout, x, ids, row, w, combine=combine)
        for out_dtype in (F32, g.dtype):
            moe_nvfp4_device(pool, layout, x, ids, row, w, out_dtype=out_dtype)
            moe_nvfp4_device(pool, layout, x, ids, row, w, host_base=ADDR, host_stride=layout.stride,
                             out_dtype=out_dtype)
        if T > 1:  # the tensor-core decode kernels, resident and mapped
            for host in (0, ADDR):  # fp32 out: the first call's check (`device_path._checked`), mode mapped
                for out_dtype in (F32, g.dtype):
                    moe_nvfp4_mma(pool, layout, x, ids, row, w, out_dtype=out_dtype, host_base=host,
                                  host_stride=layout.stride if host else 0)
        P = T * k
        if P <= W:
            entry = torch.full((3, W), -1, dtype=torch.int32)  # `MappedPath.entry` / one layer's `graph_buf` row
            # mode mapped after its gather: pairs 0..P-1 (int32) read the rows the plan wrote into the entry; fp32
            # (the first call's check, the lane's sum) or stored in the compute dtype; after the copy (`copied`, a
            # mapped bank) or without one (the lane's CPU-only layers)
            for out_dtype, copied in itertools.product((F32, g.dtype), (entry[2, :P], None)):
                moe_nvfp4_device(pool, layout, x, torch.arange(P, dtype=torch.int32).view(T, k), entry[1, :P], w,
                                 out_dtype=out_dtype, copied=copied)
            pair = torch.zeros(P, dtype=torch.int32)
            for layer in g.moe_layers:  # layer and staging row are launch integers: each of their classes
                for staging0 in staging:
                    gather_missing(pool, layout, ids, table, layer, ADDR, layout.stride, staging0, entry=entry)
                    cpu_lane._post_kernel[(1,)](ADDR, state, split, x, ids.reshape(-1), w.reshape(-1), pair,
                                                pair, layer, staging0, T, H, P, k, BLOCK_P=W,
                                                BLOCK_H=1024, FENCE=True, num_warps=4, PDL=False)
            y, y_off = torch.zeros(T, H), cpu_lane.MB_X.value + W // k * H
            for res in (y, torch.zeros(T, H, dtype=g.dtype)):  # the sum in place (fp32) or in the compute dtype
                cpu_lane._wait_add_kernel[(1,)](y, res, ADDR, state, y.numel(), y_off, cpu_lane.WAIT_LIMIT,
                                                BLOCK=2048, FENCE=True, num_warps=4, PDL=False)  # PDL: stand_in's
    for n in COPY_RATE_MISSES:  # the CPU lane's calibration at start (`lane_rates.copy_rate`)
        for layer in g.moe_layers:
            for staging0 in staging:
                gather_missing(pool, layout, torch.arange(n, dtype=torch.int32).view(1, n), table, layer, ADDR,
                               layout.stride, staging0)
    for T in (t for t in lengths if t * k > W):  # resident prefill (device plan); tiles from pick_blocks(T)
        ids = (torch.arange(T * k) % E).view(T, k)
        moe_nvfp4_prefill(pool, layout, torch.zeros(T, H, dtype=g.dtype), ids, row, torch.ones(T, k))
    for T in lengths:  # host-planned tile kernels (hybrid decode misses, offloaded prefill): every tile config
        slots = (torch.arange(T * k) % E).numpy()
        for blocks in TILE_CONFIGS.values():
            moe_nvfp4(pool, layout, torch.zeros(T, H, dtype=g.dtype), slots, torch.ones(T, k), blocks=blocks)
