"""Benchmark: agent sessions that do not all fit in the KV budget, with and without the prefix cache's host tier.

    python tools/bench_prefix_host.py --out DIR [--ftw DIR] [--sessions 2] [--kv-tokens 40000] [--host-memory 4GiB]
                                      [--device cuda --vram-budget 8GiB]

N agent sessions (the committed fixture `tools/fixtures/agent_session.json` and N-1 more made the same way with other
seeds, `bench_agent_replay.make_session`) send their requests in turn, one request of each session after the other,
as an agent does that runs several conversations (a main task and its sub-agents) against one server. The KV budget
holds one conversation (up to ~31k tokens) but not N: every switch pushes the other sessions' kept states out. With
the host tier (`--prefix-cache-host-memory`) they move to host memory and are copied back when their session sends
its next request; without it they are dropped and that request prefills its whole prompt again. Per configuration:
tokens prefilled against tokens new since the session's previous request, the tier's counters, and time to first
token. Model: the `demo` qwen3_5_moe preset on the CPU unless --ftw is given. Writes DIR/prefix_host.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_agent_replay import demo_ftw, make_session, requests, run


def interleaved(engine, sessions: list[dict]) -> list[dict]:
    """One request of each session in turn until all are done: their rows, with the session's number."""
    streams = [requests(engine.tokenizer, s) for s in sessions]
    rows, step = [], 0
    while streams:
        for k, stream in list(enumerate(streams)):
            req = next(stream, None)
            if req is None:
                streams.remove(stream)
                continue
            rows.append({"request": len(rows) + 1, "session": k + 1, **run(engine, f"s{k}r{step}", *req)})
        step += 1
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ftw", type=Path)
    ap.add_argument("--fixture", type=Path, default=Path(__file__).with_name("fixtures") / "agent_session.json")
    ap.add_argument("--sessions", type=int, default=2)
    ap.add_argument("--kv-tokens", type=int, default=40000)
    ap.add_argument("--host-memory", default="4GiB")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vram-budget", default=None)
    args = ap.parse_args()
    from ft.runtime.engine import Engine, EngineSettings

    sessions = [json.loads(args.fixture.read_text())] + [make_session(seed=k) for k in range(1, args.sessions)]
    result = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": args.device,
              "vram_budget": args.vram_budget, "kv_tokens": args.kv_tokens, "sessions": args.sessions}
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ftw = args.ftw or demo_ftw(Path(tmp))
        result["model"] = "demo (qwen3_5_moe)" if args.ftw is None else args.ftw.name
        for name, host in (("host_tier", args.host_memory), ("no_host_tier", "0")):
            engine = Engine(ftw, EngineSettings(device=args.device, vram_budget=args.vram_budget,
                                                kv_reserve_tokens=args.kv_tokens, prefix_cache_host_memory=host))
            t = time.perf_counter()
            rows = interleaved(engine, sessions)
            ttft = sorted(r["ttft_s"] for r in rows[args.sessions:])  # past each session's first request
            result[name] = {"host_memory": host, "seconds": round(time.perf_counter() - t, 2), "requests": rows,
                            "prompt": sum(r["prompt"] for r in rows), "new": sum(r["new"] for r in rows),
                            "prefilled": sum(r["prefilled"] for r in rows),
                            "worst_prefilled_over_new": max(r["prefilled"] / max(r["new"], 1)
                                                            for r in rows[args.sessions:]),
                            "ttft_p50_s": ttft[len(ttft) // 2], "ttft_max_s": ttft[-1],
                            "prefix_cache": engine.stats()["prefix_cache"]}
            engine.close()
            del engine  # its device memory back before the next variant's engine measures what is in use
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            r = result[name]
            print(f"{name}: {r['seconds']} s, prefilled {r['prefilled']} of {r['prompt']} prompt tokens "
                  f"(new {r['new']}), TTFT p50 {r['ttft_p50_s']} s max {r['ttft_max_s']} s")
            # after each variant: one that fails later keeps what this one measured
            (args.out / "prefix_host.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
