"""Counters of `GpuExperts` as one JSON-ready dict (what `engine.stats()["moe"]`, /v1/stats and `ft ctl cache` show).

Totals: calls, tokens, routed pairs, hits / misses (unique experts per layer call), fetched (uploaded) vs
CPU-computed misses, bytes over PCIe (demand + admissions + prefill streaming), read by the CPU kernel and (mode
mapped) read by GPU kernels straight from host memory (`bytes_mapped`), the split's current cost lines, upload-path
figures (records DMA'd straight from pinned banks vs staged) and the VRAM plan.
`per_layer` holds lists over the MoE layers (layer ids in `per_layer["layer"]`).
"""

from __future__ import annotations


def experts_stats(ex) -> dict:
    c = dict(ex.counters)
    looked = c["hits"] + c["misses"]
    c.update(mode=ex.opts.mode, num_slots=getattr(ex, "num_slots", None), record_bytes=ex.layout.stride,
             hit_rate=c["hits"] / looked if looked else None, cpu_backend=ex.cpu.backend, cpu_threads=ex.cpu.threads)
    c.update(ex.split.stats())
    up = getattr(ex, "uploader", None)
    if up is not None:
        c.update(uploads=up.copies, uploads_direct=up.direct_copies, staging_seconds=up.staging_seconds,
                 pinned_bytes=up.pinned_bytes)
    lane = getattr(getattr(ex, "mapped", None), "lane", None)
    if lane is not None:
        c["cpu_lane"] = lane.stats()
    if ex.pin_info:
        c["pin_refused"] = ex.pin_info.get("pin_refused")
        c["pin"] = {k: ex.pin_info[k] for k in ("pinned_bytes", "read_s", "register_s", "verify_s", "seconds")
                    if k in ex.pin_info}  # the background page-locking's phases (start-up reports)
    if ex.vram_plan is not None:
        c["vram"] = ex.vram_plan.as_dict()
    rows = ex.moe_layers
    c["per_layer"] = {"layer": list(rows), **{name: ex.per_layer[i, rows].tolist() for i, name in
                                             enumerate(("hits", "misses", "fetched", "cpu_experts"))}}
    return c


def reset_experts_stats(ex) -> int:
    if getattr(ex, "mapped", None) is not None:
        ex.mapped.release()  # routing still in flight belongs to the window that ends here
    for key in ex.counters:
        ex.counters[key] = 0 if isinstance(ex.counters[key], int) else 0.0
    ex.per_layer[:] = 0
    up = getattr(ex, "uploader", None)
    if up is not None:
        up.copies = up.direct_copies = 0
        up.staging_seconds = ex._stage_seen = 0.0
    return len(ex.trace)
