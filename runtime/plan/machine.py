"""The machine a plan is for: what it is, the rates the speed model uses, and when a plan fits the machine an engine
starts on.

Match rule (specs/plan.md, "Choosing a plan"): the GPU's name is the plan's, its total memory within 2 %, the VRAM
budget the engine resolved within max(2 %, 256 MiB) of the plan's, and the host's RAM (MemTotal) within 10 %. On the
CPU emulation the "GPU" is named `cpu` with 0 bytes.

Rates come from the `ft bench bw` profile of this GPU when there is one (and the HBM read rate, when the profile does
not have it, is measured here in a fraction of a second); otherwise from the defaults below, and the plan says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ft.formats.plan import Plan, PlanRates

BUDGET_TOLERANCE, BUDGET_SLACK = 0.02, 256 << 20
HOST_TOLERANCE = 0.10
GPU_MEMORY_TOLERANCE = 0.02
# without a bench profile: a PCIe 4.0 x16 link, a desktop CPU lane, a mid-range GPU's memory
DEFAULT_HBM, DEFAULT_H2D, DEFAULT_CPU_BYTES_S = 1.0e12, 25e9, 25e9


@dataclass(frozen=True)
class Machine:
    gpu: str
    gpu_memory: int
    host_memory: int


def host_memory() -> int:
    """MemTotal in bytes (0 when /proc/meminfo cannot be read)."""
    from ft.formats.prefetch import meminfo

    return meminfo("MemTotal")


def this_machine(device: torch.device) -> Machine:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return Machine(p.name, int(p.total_memory), host_memory())
    return Machine("cpu", 0, host_memory())


def mismatch(plan: Plan, here: Machine, budget: int | None) -> str | None:
    """None when `plan` fits this machine at this VRAM budget, else why not (one phrase)."""
    m = plan.machine
    if m.gpu != here.gpu:
        return f"GPU {m.gpu!r}, this one is {here.gpu!r}"
    if abs(m.gpu_memory - here.gpu_memory) > GPU_MEMORY_TOLERANCE * max(m.gpu_memory, 1):
        return f"GPU memory {m.gpu_memory / 2**30:.1f} GiB, this one has {here.gpu_memory / 2**30:.1f} GiB"
    if budget is None or abs(plan.vram.budget - budget) > max(BUDGET_TOLERANCE * plan.vram.budget, BUDGET_SLACK):
        have = "none" if budget is None else f"{budget / 2**30:.2f} GiB"
        return f"VRAM budget {plan.vram.budget / 2**30:.2f} GiB, this engine's is {have}"
    if abs(m.host_memory - here.host_memory) > HOST_TOLERANCE * max(m.host_memory, 1):
        return f"host RAM {m.host_memory / 2**30:.1f} GiB, this host has {here.host_memory / 2**30:.1f} GiB"
    return None


def measure_hbm(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes/s of reading device memory (a bf16 sum over `nbytes`, best of 5 after a warm-up)."""
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    best = None
    for i in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        x.sum(dtype=torch.float32)
        end.record()
        end.synchronize()
        if i:
            best = min(best or 1e30, start.elapsed_time(end) / 1e3)
    del x
    return nbytes / best


def lane_fixed_s() -> float:
    """The CPU lane's cost per call beyond its experts (its own starting estimate, cpu/lane.py), or a default where
    the lane cannot be imported (no triton: no GPU scheduler at all)."""
    try:
        from ft.runtime.gpu.cpu.lane import CPU_FIXED_S, SIGNAL_S
    except ImportError:
        return 20e-6
    return CPU_FIXED_S + SIGNAL_S


def lane_available() -> bool:
    """Whether the CPU lane's kernel library exists for this CPU (else the GPU copies every miss)."""
    try:
        from ft.runtime.gpu.cpu.kernel import load_library
    except ImportError:
        return False
    return load_library() is not None


def rates(device: torch.device, payload_bytes: int, profile: dict | None) -> PlanRates:
    """The speed model's rates for this machine: the bench profile's, else the defaults (the source says which)."""
    lane_fixed = lane_fixed_s()
    gbs = (profile or {}).get("gbs") or {}
    if not gbs.get("h2d_pinned"):
        hbm = measure_hbm(device) if device.type == "cuda" else DEFAULT_HBM
        why = "no `ft bench bw` profile for this GPU" if device.type == "cuda" else "no GPU"
        return PlanRates(hbm, DEFAULT_H2D, DEFAULT_H2D, lane_fixed, payload_bytes / DEFAULT_CPU_BYTES_S,
                         f"defaults ({why}): links {DEFAULT_H2D / 1e9:.0f} GB/s, CPU lane "
                         f"{DEFAULT_CPU_BYTES_S / 1e9:.0f} GB/s; HBM "
                         + ("measured now" if device.type == "cuda" else f"{DEFAULT_HBM / 1e9:.0f} GB/s"))
    hbm = gbs.get("hbm_read")
    hbm = hbm * 1e9 if isinstance(hbm, (int, float)) and hbm > 0 else measure_hbm(device)
    expert = profile.get("expert") or {}
    per = gbs.get("cpu_per_expert_s")
    if isinstance(per, (int, float)) and per > 0 and expert.get("payload_bytes"):
        per = per * payload_bytes / expert["payload_bytes"]  # the profile's records may be another size
    else:
        per = payload_bytes / (gbs.get("cpu_expert") or DEFAULT_CPU_BYTES_S / 1e9) / 1e9
    pinned = gbs.get("h2d_expert_pinned") or gbs["h2d_pinned"]
    return PlanRates(hbm, gbs["h2d_pinned"] * 1e9, pinned * 1e9, lane_fixed, per,
                     f"ft bench bw profile of {profile.get('timestamp', 'unknown date')}"
                     + ("" if gbs.get("hbm_read") else "; HBM measured now"))
