"""How many of a step's misses to fetch over PCIe and how many to compute on the CPU.

Each path costs a fixed part per call plus a part per expert: fetching F experts takes about a_f + F * b_f (copy
engine, or the staging memcpy when that is slower), computing the other M - F on the CPU takes a_c + (M - F) * b_c
(waking the worker team, three barriers, the partial-sum transfer back; then streaming the records). Both run at
once, so a step waits max(fetch(F), cpu(M - F)) with fetch(0) = cpu(0) = 0, and `AffineSplit.count` picks the F that
minimises it. For large M this tends to F / M = q* = b_c / (b_f + b_c) = B_pcie / (B_pcie + B_cpu); for small M the
CPU's fixed cost keeps everything on PCIe unless the CPU really wins.

The per-expert parts start from bandwidths (a `ft bench bw` profile measured with both paths running at once, or
defaults); both lines are then refitted from measured (experts, seconds) pairs by exponentially weighted least squares,
so a wrong profile or a busy host corrects itself within a few dozen steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def optimal_share(b_pcie: float, b_cpu: float) -> float:
    """q* = B_pcie / (B_pcie + B_cpu) (0 when both are 0)."""
    total = b_pcie + b_cpu
    return b_pcie / total if total > 0 else 0.0


def fetch_count(misses: int, t_fetch: float, t_cpu: float, *, cap: int | None = None,
                fixed_fetch: float = 0.0, fixed_cpu: float = 0.0) -> int:
    """Number of misses to fetch (0..min(misses, cap)) minimising max(fetch(F), cpu(misses - F))."""
    if misses <= 0:
        return 0
    hi = misses if cap is None else max(0, min(misses, cap))
    best, best_wait = 0, math.inf
    for f in range(hi, -1, -1):  # ties go to fetching more (the fetched experts may hit again)
        c = misses - f
        wait = max(fixed_fetch + f * t_fetch if f else 0.0, fixed_cpu + c * t_cpu if c else 0.0)
        if wait < best_wait - 1e-15:
            best, best_wait = f, wait
    return best


@dataclass
class AffineCost:
    """seconds(n) = fixed + per * n (n >= 1), fitted online; the prior counts as `prior_weight` observations."""

    fixed: float
    per: float
    decay: float = 0.95
    prior_weight: float = 4.0
    _s: list[float] = field(default_factory=list)  # decayed sums: w, w n, w n^2, w y, w n y

    def __post_init__(self) -> None:
        self._s = [0.0] * 5
        for n in (1.0, 8.0):  # two prior points on the starting line pin both parameters
            self._add(n, self.fixed + self.per * n, self.prior_weight / 2)

    def _add(self, n: float, y: float, w: float) -> None:
        for i, v in enumerate((w, w * n, w * n * n, w * y, w * n * y)):
            self._s[i] += v

    def __call__(self, n: int) -> float:
        return self.fixed + self.per * n if n > 0 else 0.0

    def observe(self, n: int, seconds: float) -> None:
        if n <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return
        self._s = [v * self.decay for v in self._s]
        self._add(float(n), seconds, 1.0)
        w, sn, snn, sy, sny = self._s
        det = w * snn - sn * sn
        if det > 1e-9 * w * snn:  # enough spread in n to fit a slope
            per = (w * sny - sn * sy) / det
            self.per = max(per, 1e-9)
        self.fixed = max(0.0, (sy - self.per * sn) / w)


@dataclass
class SplitEstimator:
    """Fetch and CPU cost lines; `count` gives the min-wait fetch count for a step's misses."""

    fetch: AffineCost
    cpu: AffineCost
    fixed: bool = False  # True: keep the starting numbers (benchmarks that compare against the profile)

    @classmethod
    def from_bandwidths(cls, expert_bytes: int, b_pcie: float, b_cpu: float, *, fixed: bool = False,
                        fetch_fixed_s: float = 20e-6, cpu_fixed_s: float = 150e-6, decay: float = 0.95,
                        alpha: float | None = None) -> SplitEstimator:
        """Per-expert seconds from bandwidths (bytes/s; 0 = path unavailable). `alpha` (older API) = 1 - decay."""
        if alpha is not None:
            decay = 1.0 - alpha
        t_f = expert_bytes / b_pcie if b_pcie > 0 else math.inf
        t_c = expert_bytes / b_cpu if b_cpu > 0 else math.inf
        return cls(AffineCost(fetch_fixed_s, t_f, decay), AffineCost(cpu_fixed_s, t_c, decay), fixed)

    @property
    def t_fetch(self) -> float:
        return self.fetch.per

    @property
    def t_cpu(self) -> float:
        return self.cpu.per

    @property
    def share(self) -> float:
        """q for many misses: b_c / (b_f + b_c)."""
        if math.isinf(self.t_fetch):
            return 0.0
        if math.isinf(self.t_cpu):
            return 1.0
        return self.t_cpu / (self.t_fetch + self.t_cpu)

    def count(self, misses: int, cap: int | None = None) -> int:
        hi = misses if cap is None else max(0, min(misses, cap))
        if math.isinf(self.t_fetch):
            return 0
        if math.isinf(self.t_cpu):
            return hi
        return fetch_count(misses, self.t_fetch, self.t_cpu, cap=cap, fixed_fetch=self.fetch.fixed,
                           fixed_cpu=self.cpu.fixed)

    def observe_fetch(self, num: int, seconds: float) -> None:
        if not self.fixed and math.isfinite(self.t_fetch):
            self.fetch.observe(num, seconds)

    def observe_cpu(self, num: int, seconds: float) -> None:
        if not self.fixed and math.isfinite(self.t_cpu):
            self.cpu.observe(num, seconds)

    def stats(self) -> dict:
        return {"fetch_share": self.share, "t_fetch_us": self.t_fetch * 1e6, "t_cpu_us": self.t_cpu * 1e6,
                "fetch_fixed_us": self.fetch.fixed * 1e6, "cpu_fixed_us": self.cpu.fixed * 1e6}


def split_from_profile(opts, profile: dict, payload: int, *, pinned: bool, default_b_pcie: float,
                       default_b_cpu: float) -> SplitEstimator:
    """Starting cost lines: options (b_pcie, b_cpu, cpu_fixed_s), else the bench profile (its pinned-record copy
    rate once banks are page-locked, its concurrent staged rate otherwise), else the defaults."""
    gbs = profile.get("gbs") or {}
    direct = next((gbs[k] for k in ("h2d_expert_registered_mmap", "h2d_expert_pinned")
                   if isinstance(gbs.get(k), (int, float))), None) if pinned else None
    b_p = opts.b_pcie or (direct * 1e9 if direct else None) or profile.get("b_pcie") or default_b_pcie
    b_c = opts.b_cpu or profile.get("b_cpu") or default_b_cpu
    fixed_s = opts.cpu_fixed_s if opts.cpu_fixed_s is not None else profile.get("cpu_fixed_s")
    kw = {"cpu_fixed_s": fixed_s} if fixed_s is not None else {}
    return SplitEstimator.from_bandwidths(payload, b_p, b_c, fixed=not opts.adapt, **kw)
