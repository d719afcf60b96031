"""The CPU lane: part of a decode call's expert-cache misses computed on the CPU while the GPU reads the others.

Mode mapped's decode call (`mapped_path.py`) copies every miss from page-locked host memory over PCIe, so a step at
a small VRAM budget is bound by the link while the host's cores and the rest of its memory bandwidth sit idle. The
lane adds the CPU as a second miss path inside the same call, with no host work per call (CUDA-graph safe):

1. after the plan (`gather._plan_kernel`), `_post_kernel` (one program) picks how many of the call's staged misses
   go to the CPU: c in 0..M minimising max((M - c) * t_gpu, t_fixed + c * t_cpu) (`split`, device f32 [4]: seconds
   per GPU miss (`lane_rates`), per CPU miss, the CPU's fixed cost per call, a cap). The last c misses in pair order
   become CPU pairs (pair_slot -1: the GPU kernels skip them; pair_copy 2: not copied, counted as CPU work on
   read-back). It writes their (expert, token, weight) and x into the mailbox through the GPU's mapping of it, then
   the sequence number (after a system-scope fence);
2. the CPU lane (`lane.c`: a persistent team of spinning threads) sees the number, computes those experts from
   the mmapped banks with the CPU kernel of `kernel.c` (NVFP4 or MXFP4 records), writes y and answers with the
   number;
3. the GPU meanwhile copies and computes its own misses and hits; then `_wait_add_kernel` spins until the answer is
   there and adds y to the call's fp32 sum, stored in the compute dtype on CUDA (no cast launch after it).
Both paths start together and the split puts the finish of both at the same time (for M large, c / M -> q* =
B_cpu / (B_pcie + B_cpu)). `state` (device int32 [2]: sequence number, CPU pairs of the current call) lives on the
device, so calls and graph replays need nothing from the host. The split is refitted from the lane's own timing
(`refit`, between steps: an upload of four floats).

The GPU gives up waiting after about `WAIT_LIMIT` polls (seconds) and raises the mailbox's MB_GAVE_UP; the lane
refuses a malformed post (MB_ERR, y zeros). `check` (host, no sync) turns both into an exception after the step, so a
dead lane fails the request instead of hanging the GPU.
"""

from __future__ import annotations

import ctypes
import logging
import math
import weakref
from time import monotonic

import numpy as np
import torch
import triton
import triton.language as tl

from .kernel import c_layout, lane_threads, load_library
from ..device_path import MAX_DEVICE_PAIRS
from ..kernels.pdl import pdl_args, pdl_wait
from ..pinning import bank_range, device_pointer
from ..record_layout import RecordLayout

log = logging.getLogger("ft.gpu")

# mailbox words (`lane.c`); MB_GAVE_UP is the GPU's timeout flag
MB_REQ, MB_DONE, MB_ERR, MB_GAVE_UP = tl.constexpr(0), tl.constexpr(16), tl.constexpr(17), tl.constexpr(48)
MB_N, MB_T, MB_LAYER = tl.constexpr(32), tl.constexpr(33), tl.constexpr(34)
MB_EXPERT, MB_TOKEN, MB_WEIGHT, MB_X = tl.constexpr(64), tl.constexpr(128), tl.constexpr(192), tl.constexpr(256)
WAIT_LIMIT = 5_000_000  # polls of MB_DONE (about a microsecond each over PCIe) before the GPU gives up
# starting guess of the lane's cost per call beyond its experts (barriers, y back), until its own fit takes over: the
# fits of measured runs (benchmarks/gpu_full.md) less SIGNAL_S
CPU_FIXED_S = 9e-6
SIGNAL_S = 5e-6  # the post reaching the lane and its answer reaching the GPU (PCIe round trips), outside its job time
STATS = ("jobs", "pairs", "experts", "busy_ns", "refused", "fit_jobs", "fit_experts", "fit_ns", "fit_experts_sq",
         "fit_experts_ns", "outliers")
STARVED_S = 2.0  # no job fitted for this long: the split goes back to its starting costs (`refit`)
OUTLIER = 4.0  # a job slower than this many times the fitted line's time stays out of the next fits (`refit`)


@triton.jit
def _fence_sys(FENCE: tl.constexpr):
    if FENCE:  # the interpreter has no inline assembly (and needs no fence: the host runs it in order)
        tl.inline_asm_elementwise("fence.sc.sys; mov.b32 $0, $1;", "=r,r", [tl.full([1], 0, tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _post_kernel(mb_addr, state, split, x, ids, weights, pair_slot, pair_copy, layer, staging0, T, H, P, K,
                 BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, FENCE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    mb = mb_addr.to(tl.int64).to(tl.pointer_type(tl.int32))
    mbf = mb_addr.to(tl.int64).to(tl.pointer_type(tl.float32))
    rp = tl.arange(0, BLOCK_P)
    valid = rp < P
    slot = tl.load(pair_slot + rp, mask=valid, other=0)
    copy = tl.load(pair_copy + rp, mask=valid, other=0)
    staged = valid & (copy == 1) & (slot == staging0 + rp)  # misses the GPU would copy into staging rows
    M = tl.sum(staged.to(tl.int32))
    c = rp.to(tl.float32)
    cost = tl.maximum((M - c) * tl.load(split), tl.where(c > 0, tl.load(split + 2) + c * tl.load(split + 1), 0.0))
    cost = tl.where((rp <= M) & (c <= tl.load(split + 3)), cost, float("inf"))
    n = tl.argmin(cost, 0).to(tl.int32)  # the first minimum: ties go to the GPU
    to_cpu = staged & (tl.cumsum(staged.to(tl.int32), 0) > M - n)
    tl.store(pair_slot + rp, -1, mask=to_cpu)
    tl.store(pair_copy + rp, 2, mask=to_cpu)
    tl.store(state + 1, n)
    if n > 0:
        pos = tl.cumsum(to_cpu.to(tl.int32), 0) - 1
        tl.store(mb + MB_EXPERT + pos, tl.load(ids + rp, mask=to_cpu, other=0).to(tl.int32), mask=to_cpu)
        tl.store(mb + MB_TOKEN + pos, rp // K, mask=to_cpu)
        tl.store(mbf + MB_WEIGHT + pos, tl.load(weights + rp, mask=to_cpu, other=0).to(tl.float32), mask=to_cpu)
        rh = tl.arange(0, BLOCK_H)
        for t in range(T):
            for h0 in range(0, H, BLOCK_H):
                m = h0 + rh < H
                xv = tl.load(x + t * H + h0 + rh, mask=m).to(tl.bfloat16)  # the GPU kernels' rounding of x
                tl.store(mbf + MB_X + t * H + h0 + rh, xv.to(tl.float32), mask=m)
        tl.store(mb + MB_N, n)
        tl.store(mb + MB_T, T)
        tl.store(mb + MB_LAYER, layer)
        seq = tl.load(state) + 1
        tl.store(state, seq)
        tl.debug_barrier()
        _fence_sys(FENCE)  # everything above reaches host memory before the sequence number does
        tl.debug_barrier()
        tl.store(mb + MB_REQ, seq)


@triton.jit
def _wait_add_kernel(out, res, mb_addr, state, TH, Y_OFF, LIMIT, BLOCK: tl.constexpr, FENCE: tl.constexpr,
                     PDL: tl.constexpr):
    # res = out + the CPU's y (once it is there, if the call posted any), stored in res's dtype (res may be out)
    pdl_wait(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < TH
    y = tl.zeros((BLOCK,), dtype=tl.float32)
    if tl.load(state + 1) > 0:
        mb = mb_addr.to(tl.int64).to(tl.pointer_type(tl.int32))
        mbf = mb_addr.to(tl.int64).to(tl.pointer_type(tl.float32))
        seq = tl.load(state)
        i = 0
        while (tl.load(mb + MB_DONE, volatile=True) != seq) & (i < LIMIT):
            i += 1
        if i >= LIMIT:
            tl.store(mb + MB_GAVE_UP, 1)
        _fence_sys(FENCE)
        y = tl.load(mbf + Y_OFF + offs, mask=m, other=0.0, cache_modifier=".cv")  # never a stale cached line
    tl.store(res + offs, (tl.load(out + offs, mask=m) + y).to(res.dtype.element_ty), mask=m)


class CpuLane:
    """The lane of one `GpuExperts` (module docstring). banks: layer -> (host address of expert 0's record, stride,
    number of experts); records are read in place, so the banks must stay mapped (and verified) while it runs."""

    def __init__(self, layout: RecordLayout, banks: dict[int, tuple[int, int, int]], num_layers: int, k: int,
                 device: torch.device, *, b_gpu: float, b_cpu: float, threads: int | None = None):
        self._clayout = c_layout(layout)  # NVFP4 or MXFP4 (ValueError for any other scheme)
        self.lib = load_library()
        if self.lib is None:
            raise RuntimeError("the CPU lane needs the C expert kernel (a C compiler on PATH or $CC)")
        self.layout, self.device, self.k = layout, device, k
        self.cuda = device.type == "cuda"
        self.tmax = MAX_DEVICE_PAIRS // k
        H = layout.hidden
        self.y_off = MB_X.value + self.tmax * H
        self.mailbox = torch.zeros(self.y_off + self.tmax * H, dtype=torch.int32, pin_memory=self.cuda)
        self.words = self.mailbox.numpy()
        addr = device_pointer(self.mailbox.data_ptr()) if self.cuda else self.mailbox.data_ptr()
        if addr is None:
            raise RuntimeError("the GPU cannot map the lane's page-locked mailbox")
        self.address = addr
        base = (ctypes.c_void_p * num_layers)(*[banks[i][0] if i in banks else None for i in range(num_layers)])
        stride = np.array([banks[i][1] if i in banks else 0 for i in range(num_layers)], np.int64)
        experts = np.array([banks[i][2] if i in banks else 0 for i in range(num_layers)], np.int32)
        self.threads = threads or lane_threads()
        handle = self.lib.ft_lane_new(ctypes.byref(self._clayout), self.mailbox.data_ptr(), self.tmax, num_layers,
                                      base, stride.ctypes.data, experts.ctypes.data, self.threads)
        if not handle:
            raise RuntimeError("could not start the CPU lane's threads")
        self.handle = handle
        self._finalizer = weakref.finalize(self, self.lib.ft_lane_free, handle)
        self.state = torch.zeros(2, dtype=torch.int32, device=device)
        per = layout.payload_bytes
        self.t_gpu = per / b_gpu if b_gpu > 0 else math.inf
        self.t_cpu = per / b_cpu if b_cpu > 0 else math.inf
        self.t_fixed = CPU_FIXED_S
        self._start = (self.t_cpu, self.t_fixed)
        self._last_fit = monotonic()
        self.enabled = True
        # [t_gpu, t_cpu, t_fixed, cap], then the same with the GPU path priced out (`split_all`: layers whose bank
        # is not mapped, every staged miss to the CPU)
        self._splits = torch.empty(2, 4, dtype=torch.float32, device=device)
        self.split, self.split_all = self._splits[0], self._splits[1]
        self._split_host = torch.empty(2, 4, dtype=torch.float32, pin_memory=self.cuda)
        self._upload_split()
        self._seen = np.zeros(len(STATS), np.float64)
        self.resting = False

    def rest(self, on: bool) -> None:
        """On while the host computes experts on its own team (host-planned calls: `host_call.py`): the lane's idle
        threads nap instead of spinning, which would take that team's cores; off before a call that may post to it
        (a job posted while resting is still answered, up to REST_NS late, and left out of the fit)."""
        if on != self.resting:
            self.lib.ft_lane_rest(self.handle, int(on))
            self.resting = on

    def _upload_split(self) -> None:
        big = 1e30  # an unavailable path costs "infinitely" much, finitely (inf * 0 would be nan in the kernel)
        cap = float(MAX_DEVICE_PAIRS) if self.enabled else 0.0
        t_cpu = min(self.t_cpu, big)
        self._split_host.copy_(torch.tensor([[min(self.t_gpu, big), t_cpu, self.t_fixed, cap],
                                             [big, t_cpu, self.t_fixed, float(MAX_DEVICE_PAIRS)]]))
        self._splits.copy_(self._split_host, non_blocking=self.cuda)

    def set_enabled(self, on: bool) -> None:
        """Off: later calls give the CPU nothing (benchmarks compare both paths in one engine)."""
        self.enabled = on
        self._upload_split()

    def post(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
             pair_slot: torch.Tensor, pair_copy: torch.Tensor, staging0: int, *, cpu_only: bool = False) -> None:
        """Hand the CPU its share of this call's staged misses (updates pair_slot / pair_copy in place); `cpu_only`:
        all of them (the layer's bank is not mapped for the GPU)."""
        T, H = x.shape
        if T > self.tmax:
            raise ValueError(f"the CPU lane takes calls of up to {self.tmax} tokens, got {T}")
        split = self.split_all if cpu_only else self.split
        _post_kernel[(1,)](self.address, self.state, split, x.contiguous(), topk_ids.reshape(-1),
                           topk_weights.reshape(-1), pair_slot, pair_copy, layer, staging0, T, H, topk_ids.numel(),
                           self.k, BLOCK_P=MAX_DEVICE_PAIRS, BLOCK_H=1024, FENCE=self.cuda, num_warps=4,
                           **pdl_args(self.device))

    def finish(self, y: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """y (fp32 [T, H], contiguous) + the CPU's answer, once it is there: in place in y for fp32, else a new
        tensor of `out_dtype` (the sum rounded once, on the store: no cast launch after it)."""
        n = y.numel()
        BLOCK = 2048
        res = y if out_dtype == y.dtype else torch.empty(y.shape, dtype=out_dtype, device=y.device)
        _wait_add_kernel[(triton.cdiv(n, BLOCK),)](y, res, self.address, self.state, n, self.y_off, WAIT_LIMIT,
                                                   BLOCK=BLOCK, FENCE=self.cuda, num_warps=4,
                                                   **pdl_args(self.device))
        return res

    def check(self) -> None:
        """Raise if a post was refused or the GPU gave up waiting (reads host memory only: no sync)."""
        if self.words[MB_GAVE_UP.value]:
            raise RuntimeError("the CPU expert lane did not answer within seconds; its experts were not computed")
        if self.words[MB_ERR.value]:
            raise RuntimeError(f"the CPU expert lane refused a malformed post (code {int(self.words[MB_ERR.value])})")

    def counters(self) -> dict:
        out = np.zeros(len(STATS), np.int64)
        self.lib.ft_lane_stats(self.handle, out.ctypes.data)
        return dict(zip(STATS, out.tolist()))

    def refit(self, min_jobs: int = 64) -> None:
        """The CPU's cost line from the lane's jobs since the last refit: job seconds = fixed + per * experts, least
        squares (falls back to per = mean time per expert when the jobs' sizes do not spread); the split's fixed cost
        adds the signalling around a job (SIGNAL_S). Uploads the split when it moved by more than 5 %.

        Jobs that found the team napping (after an idle stretch: start-up, graph capture, an idle server) are left out
        by the lane itself: their time includes waking threads up. A split that prices the CPU out gives it no jobs,
        so nothing could correct it: after STARVED_S with too few jobs for a fit it goes back to its starting costs,
        the few jobs dropped (a share near zero still trickles a handful of jobs: run 49's qwen3.6 at 12 GiB sat at
        617 us per expert with 135 jobs in 256 tokens). Least squares follows a few very slow jobs (a preempted
        thread): after each fit, a job slower than OUTLIER times the fitted line is counted (`outliers`) and left out
        of the next fits, until a starved reset lifts the cap (run 63: one window priced the CPU at 324 us an expert
        while its jobs averaged 65)."""
        now = np.array(list(self.counters().values()), np.float64)
        w, sn, sy, snn, sny = (now - self._seen)[5:10]
        if w < min_jobs or sn <= 0:
            if monotonic() - self._last_fit > STARVED_S and (self.t_cpu, self.t_fixed) != self._start:
                self.t_cpu, self.t_fixed = self._start
                self.lib.ft_lane_set_fit_cap(self.handle, 0, 0)  # whatever the jobs now take is fitted again
                self._seen = now
                self._last_fit = monotonic()
                self._upload_split()
            return
        self._seen = now
        self._last_fit = monotonic()
        sy *= 1e-9
        sny *= 1e-9
        det = w * snn - sn * sn
        per = (w * sny - sn * sy) / det if det > 1e-6 * w * snn else 0.0
        fixed = (sy - per * sn) / w if per > 0 else 0.0
        if per <= 0 or fixed < 0:
            per, fixed = sy / sn, 0.0
        t_cpu, t_fixed = max(per, 1e-7), fixed + SIGNAL_S
        self.lib.ft_lane_set_fit_cap(self.handle, int(OUTLIER * fixed * 1e9), max(1, int(OUTLIER * per * 1e9)))
        if abs(t_cpu - self.t_cpu) > 0.05 * min(t_cpu, self.t_cpu) or abs(t_fixed - self.t_fixed) > 0.05 * t_fixed:
            self.t_cpu, self.t_fixed = t_cpu, t_fixed
            self._upload_split()

    def stats(self) -> dict:
        c = self.counters()
        for key in ("fit_experts", "fit_ns", "fit_experts_sq", "fit_experts_ns"):
            del c[key]
        return {**c, "threads": self.threads, "t_gpu_us": self.t_gpu * 1e6, "t_cpu_us": self.t_cpu * 1e6,
                "t_fixed_us": self.t_fixed * 1e6,
                "cpu_share": self.t_gpu / (self.t_gpu + self.t_cpu) if math.isfinite(self.t_gpu + self.t_cpu) else 0.0,
                "busy_us_per_job": c["busy_ns"] / 1e3 / max(1, c["jobs"])}

    def close(self) -> None:
        self._finalizer()


def lane_for(md) -> CpuLane | None:
    """The lane of mode mapped's decode path `md` over its mapped banks, or None (off in the options, no C compiler,
    no mapping for the mailbox: the GPU then serves every miss)."""
    ex = md.ex
    if not (ex.opts.cpu_lane and (md.base or md.lane_only) and (ex.device.type == "cuda" or ex.interpret)):
        return None
    from ..store import DEFAULT_B_CPU, DEFAULT_B_PCIE
    from .lane_rates import copy_rate

    gbs = ex.profile.get("gbs") or {}
    b_gpu = ex.opts.b_pcie or copy_rate(md) or (gbs.get("h2d_expert_pinned") or 0) * 1e9 or DEFAULT_B_PCIE
    b_cpu = ex.opts.b_cpu or (gbs.get("cpu_expert") or 0) * 1e9 or DEFAULT_B_CPU
    banks = {}
    for i in sorted({*md.base, *md.lane_only}):  # a page-locked bank read through its locked view (no page faults)
        base, nbytes = bank_range(ex.banks[i])
        banks[i] = (ex.uploader.locked_address(base, nbytes) or base, ex.banks[i].stride, ex.E)
    try:
        return CpuLane(ex.layout, banks, ex.L, ex.k, ex.device, b_gpu=b_gpu, b_cpu=b_cpu,
                       threads=ex.opts.cpu_threads)
    except RuntimeError as e:  # no C compiler, or no mapping for the mailbox: the GPU serves every miss
        log.warning("CPU expert lane off: %s", e)
        return None
