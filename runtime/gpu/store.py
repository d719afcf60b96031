"""`GpuExperts`: the experts interface on a GPU, the expert store: a VRAM slot pool with a device slot table, the
banks page-locked in host memory, and three ways to serve a routed expert (a hit in its slot, the GPU reading the
record from host memory, the CPU computing it).

Each MoE layer call takes one of four paths, chosen from the call's size and the layer's state:
  * mode "resident" (every expert has a slot, never evicted): the routing stays on the device; decode calls
    (T * k <= MAX_DEVICE_PAIRS) run `device_path.py`'s kernels, prefill calls the device-planned tile kernels
    (`prefill_plan.py`). `graphs.graph_ready` is the contract for capturing decode in a CUDA graph.
  * mode "mapped", decode calls of layers whose bank the pinner has page-locked and verified (`mapped_path.py`): the
    GPU copies misses from host memory itself, the CPU lane computes a share of them, the cache is refilled a step
    later; no host sync, so decode steps are CUDA graphs too. A call of up to MAPPED_SLICES times that many pairs
    (a short prompt, a new turn's few tokens) runs as such calls of MAX_DEVICE_PAIRS pairs in turn, without the
    host-planned path's sync. Each of them copies its own misses, so an expert routed in several of them crosses
    the link once for each: two of them are the most that paid in every sample (`benchmarks/gpu_full.md`, runs
    100-105).
  * mode "mapped", forwards long enough to route to nearly every expert (`prefill_pipeline.py`): every expert
    without a slot streams through two prefill buffers ahead of its layer, without waiting for the routing.
  * any other call (before the pinner has finished, calls over MAPPED_SLICES * MAX_DEVICE_PAIRS pairs that the
    prefill pipeline does not take, and every call on device "cpu" unless `device_plan` is set) brings its routing to
    the host, one sync per call (`host_call.py`): misses split between uploads into slots and the CPU kernel by
    their measured costs (`split.py`); prefill calls stream their misses through the prefill buffers
    (`prefill_stream.py`) without admitting them, so decode-hot slots survive.

`device="cpu"` runs the same scheduler on a CPU "pool" with the PyTorch reference as the GPU side (tests, emulation;
`interpret=True` runs the Triton kernels under Triton's interpreter instead).
Uploads run on the uploader's staging thread; page-locked banks (`pin_host_bytes`, registered on a background thread
after `allocate`: `wait_pinned`) skip the staging copy. Device-planned calls count calls / tokens / pairs only;
mapped calls count hits, misses and the trace when their routing comes back.
"""

from __future__ import annotations

import numpy as np
import torch

from ft.formats import FtwReader

from .cpu.kernel import CpuMoe
from .device_path import MAX_DEVICE_PAIRS, device_call, device_prefill_call, uses_device_plan, uses_device_prefill
from .expert_cache import ExpertCache, plan_num_slots
from .graphs import graph_call
from .host_call import host_call
from .mapped_path import MappedDecode, uses_mapped
from .kernels.moe_reference import moe_ref
from .offload_config import OffloadConfig
from .pinning import BackgroundPinner
from .prefill_pipeline import PrefillPipeline, uses_pipeline
from .record_layout import RecordLayout
from .sizing import resolve_reserve
from .split import SplitEstimator, split_from_profile
from .store_stats import experts_stats, reset_experts_stats
from .transfer import CudaUploader, HostUploader

MAPPED_SLICES = 2  # a call of up to this many mapped calls' pairs runs as mapped calls in turn (module docstring)
DEFAULT_B_PCIE = 25e9  # used only when neither options nor a bench profile give bandwidths
DEFAULT_B_CPU = 25e9


class GpuExperts:
    def __init__(self, reader: FtwReader, opts: OffloadConfig, *, device: str = "cuda",
                 profile: dict | None = None, device_plan: bool | None = None, interpret: bool = False):
        """device_plan: allow the sync-free device-planned path (see the module docstring); None = on CUDA only, so
        the CPU emulation keeps its host-planned path and per-expert counters unless asked. interpret: on device
        "cpu", run the Triton kernels (TRITON_INTERPRET=1 must be set before triton is imported)."""
        cfg = reader.config
        self.opts, self.device = opts, torch.device(device)
        self.device_plan = self.device.type == "cuda" if device_plan is None else device_plan
        self.interpret = interpret and self.device.type != "cuda"
        self.moe_layers = [i for i, t in enumerate(cfg.mlp_types) if t == "moe"]
        self.banks = {i: reader.bank(f"layers.{i}.mlp.experts") for i in self.moe_layers}
        self._reader = reader  # its sizes: the activation reserve of a pool sized here (`allocate`)
        self.layout = RecordLayout.for_model(self.banks[self.moe_layers[0]], cfg)  # format + activation: kernels'
        for i, b in self.banks.items():
            if RecordLayout.for_model(b, cfg) != self.layout:
                raise ValueError(f"expert bank of layer {i} has a different record layout "
                                 f"than layer {self.moe_layers[0]}")
        self.L, self.E, self.k = cfg.num_layers, cfg.num_experts, cfg.num_experts_per_tok
        self.profile = profile or {}
        self.split = self._make_split(pinned=False)
        self.cpu = CpuMoe(self.layout, threads=opts.cpu_threads)
        self.cache: ExpertCache | None = None
        self.mapped: MappedDecode | None = None  # mode mapped: the sync-free decode path's state, made by allocate
        self.pipeline: PrefillPipeline | None = None  # mode mapped: the layer-pipelined prefill, made by allocate
        self.graph_calls = False  # set while a decode step is captured in a CUDA graph (graphs.py)
        self._prefill_done: list = [None, None]  # per prefill buffer: event after the last kernel reading it
        self.trace: list[tuple[int, np.ndarray]] = []
        self.counters = dict.fromkeys(("calls", "tokens", "pairs", "hits", "misses", "fetched", "cpu_experts",
                                       "bytes_h2d", "bytes_cpu", "bytes_mapped", "prefill_calls",
                                       "prefill_streamed"),
                                      0)
        self.counters["cpu_seconds"] = 0.0
        self.per_layer = np.zeros((4, self.L), np.int64)  # hits, misses, fetched, cpu-computed per layer
        self.vram_plan = None  # set by the engine when it sized the pool from a VRAM budget
        self.placement = None  # the engine's placement plan (`ft.runtime.plan.select.Placement`), when it has one
        self.capped: torch.device | None = None  # the device whose allocator the engine capped (lifted at close)
        self.pin_info: dict = {}  # BackgroundPinner's result, once it has finished
        self.pinner: BackgroundPinner | None = None
        self._stage_seen = 0.0

    def _make_split(self, *, pinned: bool) -> SplitEstimator:
        return split_from_profile(self.opts, self.profile, self.layout.payload_bytes, pinned=pinned,
                                  default_b_pcie=DEFAULT_B_PCIE, default_b_cpu=DEFAULT_B_CPU)

    # ---- allocation --------------------------------------------------------------------------------------
    def allocate(self, num_slots: int | None = None, *, priors: np.ndarray | None = None,
                 preload: list[tuple[int, int]] | None = None) -> None:
        """Size and allocate the slot pool (+ two prefill buffers); mode resident preloads every expert.
        `num_slots` (the engine's VRAM plan) overrides the options' sizing. A placement plan's routing counts
        (`priors` [L, E]) seed the cache's frequency estimates and its (layer, expert) list (`preload`, hottest
        first) fills the slots now (`ft.runtime.plan`)."""
        o, stride = self.opts, self.layout.stride
        extra = 2 * o.prefill_slots
        resident = o.mode == "resident"
        if resident:
            n = len(self.moe_layers) * self.E
        elif num_slots is not None or o.num_slots is not None:
            n = num_slots if num_slots is not None else o.num_slots
        elif o.vram_budget is None:
            raise ValueError(f"mode {o.mode} needs vram_budget or num_slots to size the expert cache")
        else:
            used = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
            n = plan_num_slots(o.vram_budget, used + extra * stride, stride,
                               reserve=resolve_reserve(o.reserve_bytes, self._reader, None,
                                                       dense_quantized=o.dense == "quantized"),
                               max_slots=len(self.moe_layers) * self.E)
        self.num_slots = n
        self.pool = torch.empty(n + extra, stride, dtype=torch.uint8, device=self.device)
        self.cache = ExpertCache(self.L, self.E, n, policy=o.policy, moe_layers=self.moe_layers, priors=priors)
        if self.device.type == "cuda":
            self.uploader = CudaUploader(self.pool, num_staging=o.num_staging, copy_threads=o.copy_threads)
            self.compute_stream = torch.cuda.current_stream(self.device)
        else:
            self.uploader = HostUploader(self.pool)
        if resident:
            preload = [(layer, e) for layer in self.moe_layers for e in range(self.E)]
        if preload:
            self._preload(preload[:n])
        if resident:
            return
        # on a thread (pinning.py), also when nothing may be page-locked: it verifies the banks. Started after the
        # preload, which is on the way to ready: the pinner reads every bank (readahead, checksums), and on a cold
        # page cache the two would share the disk
        if self.device.type == "cuda":
            self.pinner = BackgroundPinner(self.uploader, [self.banks[i] for i in self.moe_layers], o.pin_host_bytes,
                                           verify=True)
        self.mapped = MappedDecode(self)
        self.pipeline = PrefillPipeline(self)

    def _preload(self, pairs: list[tuple[int, int]]) -> None:
        """Admit and upload (layer, expert) pairs into empty slots (every expert in mode resident, or a plan's); the
        device table (the device-planned path's, uploaded once for resident layers) after they land."""
        self.cache.tick()
        for layer in dict.fromkeys(layer for layer, _ in pairs):  # layers in first-seen order
            experts = np.array([e for lay, e in pairs if lay == layer], np.int64)
            for e, s in zip(experts.tolist(), self.cache.admit_many(layer, experts)[0].tolist()):
                self.uploader.upload(s, self.banks[layer].record(e))
        self.cache.tick()
        self._wait(self.uploader.fence())
        self.cache.device_table(self.device).sync()

    def _wait(self, event) -> None:
        if event is not None:
            self.compute_stream.wait_event(event)

    # ---- the experts interface ---------------------------------------------------------------------------
    def __call__(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self.cache is None:
            self.allocate()
        T, k = topk_ids.shape
        if T == 0:
            return torch.zeros_like(x)
        if self.graph_calls:  # inside a captured step: kernels only, bookkeeping after the replay
            return graph_call(self, layer, x, topk_ids, topk_weights).to(x.dtype)
        if uses_device_plan(self, layer, T):  # no host sync: routing stays on the device
            return device_call(self, layer, x, topk_ids, topk_weights).to(x.dtype)
        if uses_device_prefill(self, layer, T):  # the same for prefill: pairs grouped by expert on the device
            return device_prefill_call(self, layer, x, topk_ids, topk_weights).to(x.dtype)
        if self.pipeline is not None:
            if uses_pipeline(self, layer, T):  # large prefill: every expert without a slot streamed ahead, no sync
                return self.pipeline(layer, x, topk_ids, topk_weights).to(x.dtype)
            self.pipeline.abandon()
        if uses_mapped(self, layer, T):  # no host sync: misses read from the mapped bank, bookkeeping a step later
            return self.mapped(layer, x, topk_ids, topk_weights).to(x.dtype)
        piece = MAX_DEVICE_PAIRS // k
        if T <= MAPPED_SLICES * piece and uses_mapped(self, layer, piece):  # a short prefill: the same, piece by piece
            return torch.cat([self.mapped(layer, x[i:i + piece], topk_ids[i:i + piece], topk_weights[i:i + piece])
                              for i in range(0, T, piece)]).to(x.dtype)
        if self.mapped is not None:
            self.mapped.release()
        return host_call(self, layer, x, topk_ids, topk_weights)

    def uses_device_plan(self, layer: int, num_tokens: int) -> bool:
        """Whether a call of `num_tokens` tokens at `layer` keeps its routing on the device (any device)."""
        return uses_device_plan(self, layer, num_tokens)

    # ---- pieces ------------------------------------------------------------------------------------------
    def _gpu_moe(self, x, ids, slot_of, topk_weights, *, fence: bool = True, blocks=None, pair_out=None):
        """fp32 [T, H] over the pairs whose expert is in `slot_of`; with `pair_out` (Triton kernels only) the pairs'
        rows are written into it instead and None is returned (see `moe_nvfp4`)."""
        lut = np.full(self.E, -1, np.int64)  # expert -> slot for this call (vectorised: prefill has T*k pairs)
        if slot_of:
            n = len(slot_of)
            lut[np.fromiter(slot_of.keys(), np.int64, n)] = np.fromiter(slot_of.values(), np.int64, n)
        pair_slots = lut[ids]
        if self.device.type != "cuda" and not self.interpret:
            T, k = topk_weights.shape
            return moe_ref(self.pool, self.layout, x, torch.from_numpy(pair_slots).view(T, k), topk_weights)
        from .host_plan import moe_nvfp4

        if fence:  # wait for every upload issued so far; later uploads wait for this kernel (slot reuse)
            self._wait(self.uploader.fence())
        y = moe_nvfp4(self.pool, self.layout, x, pair_slots, topk_weights, blocks=blocks, pair_out=pair_out)
        if pair_out is not None:
            y = None
        if fence:
            self.uploader.after_compute(self._record_compute())
        return y

    def _record_compute(self):
        if self.device.type != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record(self.compute_stream)
        return ev

    def wait_pinned(self, timeout: float | None = None) -> dict:
        """Block until the expert banks are page-locked (benchmarks: time the steady state); the pin result."""
        if self.pinner is not None:
            self.pinner.wait(timeout)
            self._pin_finished()
        return self.pin_info

    def _pin_finished(self) -> None:
        """Once the pinner is done: record its result and start the split from the pinned copy rate."""
        if self.pinner is not None and not self.pin_info and self.pinner.done.is_set():
            self.pin_info = self.pinner.info
            if self.pin_info.get("pinned_bytes"):
                self.split = self._make_split(pinned=True)

    def _observe_timing(self) -> None:
        """Feed finished copies to the fetch cost line: seconds = max(copy engine, staging memcpy) since last time."""
        self._pin_finished()
        n, seconds = self.uploader.timing() if self.cache is not None else (0, 0.0)
        if n:
            stage = self.uploader.staging_seconds
            self.split.observe_fetch(n, max(seconds, stage - self._stage_seen))
            self._stage_seen = stage

    # ---- observability -----------------------------------------------------------------------------------
    def stats(self) -> dict:
        return experts_stats(self)

    def settle(self) -> None:
        """Mode mapped: count the routing still in flight now (waits for it; from the thread driving the model)."""
        if self.mapped is not None:
            self.mapped.release()
            self.pipeline.settle()

    def reset_stats(self) -> int:
        """Zero the counters (the cache keeps its contents; call after a warm-up). Returns the trace position where
        the new window starts (the trace itself is kept so that offline replays start from the same warm state)."""
        return reset_experts_stats(self)

    def close(self) -> None:
        if self.capped is not None:
            from .sizing import cap_allocator

            cap_allocator(self.capped, None)
            self.capped = None
        self.cpu.close()
        if self.mapped is not None and self.mapped.lane is not None:
            self.mapped.lane.close()
        if self.pinner is not None:
            self.pinner.stop()  # before the uploader unregisters: nothing may be registered after that
        if getattr(self, "uploader", None) is not None:
            self.uploader.close()
