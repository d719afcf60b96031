"""Plans and the time budget of tools/gpu_bench.py (pure functions: no torch, no GPU; tested on the CPU).

A plan is a named set of defaults: `--plan full` is the whole benchmark matrix of the GPU issue in one command
(explicit flags still win). Before each stage the bench asks `TimePlan.admit(stage, estimate)`: a stage whose
estimate would end past the deadline is skipped, and the reason is recorded in the results.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# Issue matrix: decode at batch 1 (512 tokens after a 2k prompt) at 8/12/24 GiB + resident, both routings, against
# the Belady bound; prefill at 2k/16k/32k against the PCIe roofline; static and resident baselines; the engine path;
# a torch.profiler breakdown. Stage order puts what the report needs most first; `tests` overlaps the background
# checkpoint builds; `bw` late (it stalled once for 150 s, and e2e falls back to the last recorded bandwidth profile
# without it); `kernel` was measured before. Deadline 540 s: a running piece may overrun its estimate by ~20 s, and
# the device call's hard limit is 600 s including start-up.
PLANS: dict[str, dict] = {
    "full": dict(stages="env,tests,pin,profile,e2e,bw,kernel", bg_ckpt="uniform,skewed", layers=4,
                 routings="uniform,skewed", budgets=[8.0, 12.0, 24.0], modes="hybrid,mapped", prompt=2048,
                 tokens=512, warmup=32, prefill_lengths=[2048, 16384, 32768], prefill_budgets=[8.0],
                 profile_tokens=16, profile_trace=True, deadline_s=540.0),
}

# Seconds, from the H200 runs A-E of benchmarks/gpu.md (4 layers of the Qwen3.6-35B-A3B geometry), rounded up.
COST = dict(env=2.0, tests=40.0, pin=8.0, kernel=25.0, bw=35.0, build=60.0, load=6.0, logits=10.0, setup=2.0,
            engine_load=5.0)
RATE = dict(resident=90.0, offload=40.0, engine=10.0)  # decode tok/s (engine: measured 11.8 at 8 GiB)
PREFILL_RATE = dict(resident=12000.0, stream=6000.0)  # prefill tok/s


def decode_runs(args) -> list[str]:
    """Placements e2e times per routing: resident three times (one throw-away, one through the host-planned
    kernel), each mode at each budget, static where the budget leaves CPU layers (not at 24 GiB: every expert fits)."""
    runs = ["resident", "resident", "resident"]
    for gib in args.budgets:
        runs += [m for m in args.modes.split(",")] + (["static"] if gib < 24 else [])
    return runs


def estimate(stage: str, args, built: frozenset[str] = frozenset()) -> float:
    """Seconds `stage` should take with these args; `built`: routings whose checkpoint already exists."""
    if stage in ("env", "tests", "pin", "kernel", "bw"):
        return COST[stage]
    if stage == "ckpt":
        return sum(COST["build"] for r in args.routings.split(",") if r not in built)
    if stage == "profile":  # resident / hybrid / mapped / static direct loops, the engine at the budget and resident
        per_path = COST["setup"] + 3 * args.profile_tokens / RATE["offload"] + args.prompt / PREFILL_RATE["stream"]
        return COST["load"] + 2 * COST["engine_load"] + 6 * per_path + (0 if args.routings.split(",")[0] in built
                                                                     else COST["build"])
    if stage == "e2e":
        return sum(routing_estimate(args, r in built, first=i == 0)
                   for i, r in enumerate(args.routings.split(",")))
    raise ValueError(f"no estimate for stage {stage!r}")


def routing_estimate(args, built: bool, *, first: bool) -> float:
    """Seconds of one routing in e2e: build, load, decode runs, engine run, prefill at every length."""
    t = (0 if built else COST["build"]) + COST["load"] + (COST["logits"] if first and not args.no_logits else 0)
    prefill = args.prompt / PREFILL_RATE["stream"]
    for run in decode_runs(args):
        rate = RATE["resident"] if run == "resident" else RATE["offload"]
        t += COST["setup"] + 2 * prefill + (args.warmup + args.tokens) / rate
    if first:
        t += COST["engine_load"] + (8 + 48) / RATE["engine"]
    t += prefill_estimate(args)
    return t


def prefill_estimate(args) -> float:
    """Prefill runs of one routing: resident + streamed at each prefill budget, each length run 3 times."""
    t = 0.0
    for length in args.prefill_lengths:
        t += COST["setup"] + 3 * length / PREFILL_RATE["resident"]
        t += len(args.prefill_budgets) * (COST["setup"] + 3 * length / PREFILL_RATE["stream"])
    return t


@dataclass
class TimePlan:
    """Admits stages while their estimate fits before the deadline (seconds since the epoch)."""

    deadline: float
    clock: object = time.time
    skipped: dict[str, str] = field(default_factory=dict)
    estimates: dict[str, float] = field(default_factory=dict)

    def left(self) -> float:
        return self.deadline - self.clock()

    def admit(self, stage: str, seconds: float) -> bool:
        """True if `stage` (estimated `seconds`) fits; else records why it is skipped and returns False."""
        self.estimates[stage] = round(seconds, 1)
        left = self.left()
        if seconds > left:
            self.skipped[stage] = f"estimated {seconds:.0f} s, {max(left, 0):.0f} s left before the deadline"
            return False
        return True


def apply_plan(parser, argv: list[str]):
    """Parse `argv`; a `--plan NAME` supplies defaults that explicit flags override."""
    args = parser.parse_args(argv)
    if getattr(args, "plan", None):
        if args.plan not in PLANS:
            parser.error(f"unknown plan {args.plan!r}; known: {', '.join(PLANS)}")
        parser.set_defaults(**PLANS[args.plan])
        args = parser.parse_args(argv)
    return args
