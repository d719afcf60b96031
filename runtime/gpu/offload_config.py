"""Settings of the GPU expert store (one frozen dataclass; unknown modes are refused)."""

from __future__ import annotations

from dataclasses import dataclass

from ft.runtime.settings import DENSE_WEIGHTS as DENSE

MODES = ("mapped", "resident")


@dataclass(frozen=True)
class OffloadConfig:
    """
    mode:
      mapped   - experts without a VRAM slot are served from their page-locked bank in host memory: a decode call
                 never waits for the host (the GPU copies each miss itself, the CPU lane computes a share of them,
                 the cache is refilled a step later from the routing read back asynchronously: `mapped_path.py`);
                 a large prefill streams every expert without a slot ahead of its layer (`prefill_pipeline.py`).
                 Calls neither path can take (before the banks are page-locked and verified, decode batches over
                 MAX_DEVICE_PAIRS pairs, mid-size prefill chunks) are planned on the host (`host_call.py`). The default.
      resident - every expert of every layer in VRAM (chosen by the engine when the budget holds them all)
    vram_budget: bytes the whole engine may use on the GPU (dense weights, KV, slots, prefill buffers, reserve);
      slots get what is left when the first MoE call arrives (or what the engine's VRAM plan gives them). With
      neither a budget nor num_slots, allocating the pool fails (mode resident needs neither).
    dense: how quantized dense linears (NVFP4 / FP8 in ModelOpt checkpoints) sit on the GPU: dequantized to the
      compute dtype at load, or quantized as stored (2-4x less VRAM for them, which goes to the expert cache; decode
      reads them through a dequantizing GEMV, prefill dequantizes them chunk by chunk per call; same values). The
      engine resolves `--dense-weights auto` into one of the two at load (`sizing.resolve_dense`).
    """

    mode: str = "mapped"
    vram_budget: int | None = None
    num_slots: int | None = None
    reserve_bytes: int | None = None  # activations, logits, allocator slack; None: sized from the model and prefill
    # chunk (`sizing.activation_reserve`)
    policy: str = "lru-freq"
    cpu_lane: bool = True  # mode mapped: the CPU computes part of each decode call's misses (cpu/lane.py)
    admit_max: int = 2  # mode mapped: experts uploaded into the cache per layer call at most
    admit_margin: float = 2.0  # mode mapped: a miss replaces a resident expert routed this many times less often
    # (routing counts over a few hundred tokens are noisy: with a smaller margin, swaps at uniform routing mostly spend
    # the link on uploads; benchmarks/gpu_full.md, run 25)
    prefill_tokens: int = 64  # calls with at least this many tokens stream their misses (prefill path)
    prefill_slots: int = 32  # slots per prefill buffer (two buffers)
    num_staging: int = 8  # pinned staging records
    copy_threads: int = 4  # threads of the pageable -> pinned copy
    pin_host_bytes: int | None = None  # page-lock expert banks up to this many bytes; None = half of MemAvailable
    cpu_threads: int | None = None
    b_pcie: float | None = None  # bytes/s for the initial split; None = bench profile, else defaults
    b_cpu: float | None = None
    cpu_fixed_s: float | None = None  # fixed seconds per CPU call for the initial split; None = profile / default
    adapt: bool = True  # refine the split from measured step times
    trace_limit: int = 0  # routing steps kept (`GpuExperts.trace`) for benchmarks' Belady comparisons; 0 = none
    dense: str = "dequantized"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown offload mode {self.mode!r}; supported: {', '.join(MODES)}")
        if self.dense not in DENSE:
            raise ValueError(f"unknown dense placement {self.dense!r}; supported: {', '.join(DENSE)}")
        if self.pin_host_bytes is not None and self.pin_host_bytes < 0:
            raise ValueError(f"pin_host_bytes must be >= 0 (0 = no pinning), got {self.pin_host_bytes}")
        if self.admit_max < 0:
            raise ValueError(f"admit_max must be >= 0, got {self.admit_max}")
        if not self.admit_margin >= 0:
            raise ValueError(f"admit_margin must be >= 0, got {self.admit_margin}")
        if self.prefill_slots < 1 or self.num_staging < 1:
            raise ValueError("prefill_slots and num_staging must be >= 1")
