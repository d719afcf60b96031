"""How many of a step's misses to fetch over PCIe and how many to compute on the CPU.

With M misses of one expert size, fetching F costs about F * t_fetch on the copy engine and computing the other
M - F costs (M - F) * t_cpu on the CPU cores; both run at once, so the step waits max(F * t_fetch, (M - F) * t_cpu).
The continuous optimum is F / M = q* = t_cpu / (t_fetch + t_cpu) = B_pcie / (B_pcie + B_cpu) in bandwidths.
`fetch_count` rounds it with "min-wait": F in {floor(qM), floor(qM) + 1}, whichever waits less.

`SplitEstimator` starts from bandwidths (a `ft bench bw` profile measured with both paths running at once, or
defaults) and refines the per-expert times from what each step actually took (exponential moving averages), so a
wrong profile or a busy host corrects itself within a few dozen steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def optimal_share(b_pcie: float, b_cpu: float) -> float:
    """q* = B_pcie / (B_pcie + B_cpu) (0 when both are 0)."""
    total = b_pcie + b_cpu
    return b_pcie / total if total > 0 else 0.0


def fetch_count(misses: int, t_fetch: float, t_cpu: float, *, cap: int | None = None) -> int:
    """Min-wait number of misses to fetch (0..misses), at most `cap` (free slots)."""
    if misses <= 0:
        return 0
    hi = misses if cap is None else max(0, min(misses, cap))
    if t_fetch <= 0:
        return hi
    if t_cpu <= 0:
        return 0
    q = t_cpu / (t_fetch + t_cpu)
    lo_f = int(math.floor(q * misses))
    best, best_wait = 0, math.inf
    for f in (lo_f, lo_f + 1):
        f = max(0, min(hi, f))
        wait = max(f * t_fetch, (misses - f) * t_cpu)
        if wait < best_wait - 1e-15:
            best, best_wait = f, wait
    return best


@dataclass
class SplitEstimator:
    """Per-expert seconds on each path; starts from bandwidths, then follows measurements."""

    t_fetch: float
    t_cpu: float
    alpha: float = 0.1  # EMA weight of one step's measurement
    fixed: bool = False  # True: keep the profile's numbers (benchmarks that compare against them)

    @classmethod
    def from_bandwidths(cls, expert_bytes: int, b_pcie: float, b_cpu: float, **kw) -> SplitEstimator:
        t_f = expert_bytes / b_pcie if b_pcie > 0 else math.inf
        t_c = expert_bytes / b_cpu if b_cpu > 0 else math.inf
        return cls(t_f, t_c, **kw)

    @property
    def share(self) -> float:
        if math.isinf(self.t_fetch):
            return 0.0
        if math.isinf(self.t_cpu):
            return 1.0
        return self.t_cpu / (self.t_fetch + self.t_cpu)

    def count(self, misses: int, cap: int | None = None) -> int:
        if math.isinf(self.t_fetch):
            return 0
        if math.isinf(self.t_cpu):
            return misses if cap is None else max(0, min(misses, cap))
        return fetch_count(misses, self.t_fetch, self.t_cpu, cap=cap)

    def observe_fetch(self, num: int, seconds: float) -> None:
        if num > 0 and seconds > 0 and not self.fixed:
            self.t_fetch = self._ema(self.t_fetch, seconds / num)

    def observe_cpu(self, num: int, seconds: float) -> None:
        if num > 0 and seconds > 0 and not self.fixed:
            self.t_cpu = self._ema(self.t_cpu, seconds / num)

    def _ema(self, old: float, new: float) -> float:
        return new if math.isinf(old) else (1 - self.alpha) * old + self.alpha * new
