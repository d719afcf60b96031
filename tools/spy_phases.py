"""Where each thread's time went, window by window, in a py-spy chrome trace (`py-spy record --format chrometrace
--idle --threads`, as `tools/bench_coldstart.py --py-spy` records `ft serve`).

    python tools/spy_phases.py TRACE.json --cuts 5,12.5,24 [--top 6] [--min-s 0.2]

The trace holds, per thread, begin/end events of stack frames with microsecond timestamps from py-spy's start. The
windows are [0, cut1), [cut1, cut2), ... [last cut, end), in seconds. Per window and thread (threads with less than
--min-s seconds of samples in it are left out) it prints the frames that held the most time: the innermost frame
whose file is under the project (`/ft/` or the repo's folders) with the leaf frame beside it, so that a thread
waiting in a library call (a CUDA call, a read, a lock) shows both the call and who made it.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

OURS = ("/ft/", "/runtime/", "/formats/", "/compiler/", "/cli/")


def stacks(events: list[dict]) -> dict[str, list[tuple[float, float, tuple]]]:
    """thread -> [(start s, end s, stack of (name, file, line) outermost first)] from the B/E events. A thread is
    named by its own outermost frame, py-spy's "thread (N): name" (an ended thread's id may be reused by another)."""
    out: dict[str, list] = defaultdict(list)
    open_: dict[int, list] = defaultdict(list)
    since: dict[int, float] = {}
    for ev in sorted(events, key=lambda e: e["ts"]):  # stable: a timestamp's E and B keep their order
        tid, t = ev["tid"], ev["ts"] / 1e6
        st = open_[tid]
        if st and tid in since and t > since[tid]:
            out[st[0][0]].append((since[tid], t, tuple(st)))
        if ev["ph"] == "B":
            st.append((ev["name"], ev["args"].get("filename", ""), ev["args"].get("line", 0)))
        elif ev["ph"] == "E" and st:
            st.pop()
        since[tid] = t
    return out


def _frame(f: tuple) -> str:
    return f"{f[0]} ({Path(f[1]).name}:{f[2]})"


def label(stack: tuple) -> str:
    """`innermost project frame -> leaf frame` of one stack (the leaf alone when it is the project's own)."""
    leaf = stack[-1]
    mine = next((f for f in reversed(stack) if any(k in f[1] for k in OURS)), None)
    if mine is None or mine == leaf:
        return _frame(leaf)
    return f"{_frame(mine)} -> {_frame(leaf)}"


def report(trace: Path, cuts: list[float], top: int, min_s: float) -> str:
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    per_thread = stacks(events)
    end = max((s[-1][1] for s in per_thread.values() if s), default=0.0)
    edges = [0.0, *cuts, end]
    lines = [f"{trace.name}: {len(per_thread)} threads, {end:.1f} s sampled"]
    for a, b in zip(edges, edges[1:]):
        lines.append(f"\n== {a:.1f}-{b:.1f} s ==")
        for name, spans in per_thread.items():
            held: dict[str, float] = defaultdict(float)
            for s, e, stack in spans:
                overlap = min(e, b) - max(s, a)
                if overlap > 0 and len(stack) > 1:  # stack[0] is the thread's own pseudo-frame
                    held[label(stack[1:])] += overlap
            total = sum(held.values())
            if total < min_s:
                continue
            lines.append(f"  {name}: {total:.2f} s")
            for lab, sec in sorted(held.items(), key=lambda kv: -kv[1])[:top]:
                lines.append(f"    {sec:6.2f} s  {lab}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--cuts", default="", help="comma-separated window edges in seconds")
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--min-s", type=float, default=0.2)
    args = ap.parse_args()
    cuts = [float(c) for c in args.cuts.split(",") if c]
    print(report(args.trace, cuts, args.top, args.min_s))


if __name__ == "__main__":
    main()
