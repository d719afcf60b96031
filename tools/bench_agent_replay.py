"""Benchmark: a coding agent's session replayed against the engine, with the prefix cache on and off.

    python tools/bench_agent_replay.py --out DIR [--ftw DIR] [--fixture tools/fixtures/agent_session.json]
                                       [--device cuda --vram-budget 8GiB] [--skip-off]
    python tools/bench_agent_replay.py --write-fixture tools/fixtures/agent_session.json

The fixture (committed; `--write-fixture` regenerates it deterministically) is a session as an agent sends it: a long
system prompt, four tool definitions, then turns of a user message followed by assistant steps with thinking and a
tool call, each answered by a tool result of file-sized text, and a final answer; it grows past 30k tokens. Before
every assistant message the whole history so far is rendered with the model's chat template (the Qwen3.6 template
drops older turns' thinking once a new user message arrives, as agents see it) and sent as one request (greedy, 8
tokens): per request, the prompt tokens, the tokens new since the previous request (prompt minus the prefix it shares
with it), the tokens the engine took from the cache, the tokens it prefilled and the time to first token. Model: the
`demo` qwen3_5_moe preset (Gated DeltaNet + attention, the Qwen3.6 tokenizer and template) on the CPU, synthesized
and compiled here unless --ftw is given. On the CPU the KV budget is 65,536 tokens; with --device cuda every engine
setting is the default (`ft serve`'s: KV sized from the VRAM budget) but the budget. `--skip-off`: the cache-off
replay is left out (on a large model it prefills ~540k tokens). Writes DIR/agent_replay.json.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FT = [sys.executable, "-c", "from ft.cli.main import main; main()"]
WORDS = ("def class return import self value index token cache layer expert batch stream config path error test "
         "assert result buffer kernel device model server request prompt state block router weight").split()
TOOLS = [{"type": "function", "function": {"name": n, "description": d, "parameters": {
    "type": "object", "properties": {p: {"type": "string", "description": f"the {p}"} for p in ps}, "required": ps}}}
    for n, d, ps in (("read_file", "Read a file of the repository", ["path"]),
                     ("grep", "Search the repository for a pattern", ["pattern", "path"]),
                     ("edit_file", "Replace text in a file", ["path", "old", "new"]),
                     ("run", "Run a shell command and return its output", ["command"]))]


def _text(rng: random.Random, words: int) -> str:
    lines, line = [], []
    for _ in range(words):
        line.append(rng.choice(WORDS))
        if len(line) >= rng.randint(6, 12):
            lines.append("    " * rng.randint(0, 2) + " ".join(line))
            line = []
    return "\n".join(lines + [" ".join(line)])


def make_session(seed: int = 0, turns: int = 8, steps: int = 3) -> dict:
    rng = random.Random(seed)
    messages = [{"role": "system", "content": "You are a coding agent working in a repository.\n" + _text(rng, 1500)}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"Task {t + 1}: " + _text(rng, 60)})
        for s in range(steps):
            name = rng.choice(TOOLS)["function"]["name"]
            args = {p: _text(rng, 3).strip() for p in next(x for x in TOOLS if x["function"]["name"] == name)[
                "function"]["parameters"]["required"]}
            messages.append({"role": "assistant", "content": "", "reasoning_content": _text(rng, 80),
                             "tool_calls": [{"id": f"call_{t}_{s}", "type": "function",
                                             "function": {"name": name, "arguments": args}}]})
            messages.append({"role": "tool", "tool_call_id": f"call_{t}_{s}", "content": _text(rng, 900)})
        messages.append({"role": "assistant", "reasoning_content": _text(rng, 60), "content": _text(rng, 80)})
    return {"seed": seed, "tools": TOOLS, "messages": messages}


def requests(tokenizer, session: dict):
    """The session's requests as the server renders them (`render_chat`): (prompt ids, the snapshot position it hands
    the engine (the start of the generation prompt), tokens new since the previous request)."""
    from ft.runtime.server.generation import render_chat

    msgs, previous = session["messages"], []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        rendered = render_chat(tokenizer, msgs[:i], session["tools"])
        prompt = rendered.ids
        shared = next((j for j, (a, b) in enumerate(zip(previous, prompt)) if a != b), min(len(previous), len(prompt)))
        yield prompt, rendered.header_start, len(prompt) - shared
        previous = prompt


def run(engine, rid: str, prompt: list[int], snapshot_at: int, new: int) -> dict:
    """One greedy request of 8 tokens: its row (prompt, new, cached, prefilled tokens, time to first token)."""
    from ft.runtime.engine import SamplingParams

    t0, ttft, cached = time.perf_counter(), None, 0
    engine.add_request(rid, prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                       snapshot_at=snapshot_at)
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.token_id is not None and ttft is None:
                ttft = time.perf_counter() - t0
            cached = ev.num_cached_tokens
    return {"prompt": len(prompt), "new": new, "cached": cached, "prefilled": len(prompt) - cached,
            "ttft_s": round(ttft, 4)}


def replay(engine, session: dict) -> list[dict]:
    reqs = requests(engine.tokenizer, session)
    return [{"request": i + 1, **run(engine, f"r{i}", *req)} for i, req in enumerate(reqs)]


def demo_ftw(tmp: Path) -> Path:
    """The `demo` qwen3_5_moe preset, synthesized and compiled under `tmp`."""
    hf, ftw = tmp / "demo-hf", tmp / "demo.ftw"
    subprocess.run([*FT, "synth", "--arch", "qwen3_5_moe", "--preset", "demo", "--out", str(hf)], check=True,
                   capture_output=True)
    subprocess.run([*FT, "checkpoint", "--model", str(hf), "--out", str(ftw)], check=True, capture_output=True)
    return ftw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--ftw", type=Path)
    ap.add_argument("--fixture", type=Path, default=Path(__file__).with_name("fixtures") / "agent_session.json")
    ap.add_argument("--write-fixture", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vram-budget", default=None)
    ap.add_argument("--skip-off", action="store_true")
    args = ap.parse_args()
    if args.write_fixture:
        args.write_fixture.parent.mkdir(parents=True, exist_ok=True)
        args.write_fixture.write_text(json.dumps(make_session(), indent=1) + "\n")
        return
    from ft.runtime.engine import Engine, EngineSettings

    session = json.loads(args.fixture.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        ftw = args.ftw or demo_ftw(Path(tmp))
        result = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "model": "demo (qwen3_5_moe)" if args.ftw is None else args.ftw.name}
        kv = 65536 if args.device == "cpu" else None
        result |= {"device": args.device, "vram_budget": args.vram_budget}
        for name, entries in (("cache_on", 8), ("cache_off", 0))[:1 if args.skip_off else 2]:
            engine = Engine(ftw, EngineSettings(device=args.device, vram_budget=args.vram_budget,
                                                kv_reserve_tokens=kv, prefix_cache_entries=entries))
            result[f"{name}_kv_tokens"] = engine.kv.total
            t = time.perf_counter()
            rows = replay(engine, session)
            result[name] = {"seconds": round(time.perf_counter() - t, 2), "requests": rows,
                            "prefilled": sum(r["prefilled"] for r in rows), "new": sum(r["new"] for r in rows),
                            "cached": sum(r["cached"] for r in rows)}
            engine.close()
            print(f"{name}: {result[name]['seconds']} s, prefilled {result[name]['prefilled']} of "
                  f"{sum(r['prompt'] for r in rows)} prompt tokens, new {result[name]['new']}")
    on = result["cache_on"]["requests"]
    result["worst_prefilled_over_new"] = max(r["prefilled"] / max(r["new"], 1) for r in on[1:])
    result["ttft_last_over_second"] = on[-1]["ttft_s"] / on[1]["ttft_s"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "agent_replay.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("worst_prefilled_over_new", "ttft_last_over_second")}))


if __name__ == "__main__":
    main()
