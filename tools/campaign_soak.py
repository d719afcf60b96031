"""Campaign: a soak of `ft serve` on the CPU; concurrent streaming clients, random disconnects, malformed and
oversized requests; the target is no server error and a flat RSS.

    python tools/campaign_soak.py --out DIR [--minutes 10] [--clients 32] [--seed 0] [--port 19193]
                                  [--ftw DIR --device cuda --vram-budget 8GiB] [--prefix-cache-host-memory 256MiB]

Synthesizes and compiles the `tiny` qwen3_moe checkpoint, serves it on the CPU (64-token output cap, 4 running
requests; log in DIR/serve.log) and runs N client workers for M minutes, each looping over a request kind drawn from
a seeded RNG: OpenAI chat and Anthropic messages streams read to the end, non-streaming completions, streams dropped
after a few chunks and non-streaming requests cancelled mid-flight (random disconnects), malformed requests (invalid
JSON, wrong types, an unknown model, a lone surrogate, a body over --max-request-bytes, a prompt past the context)
that must get a 4xx, extra unknown fields (accepted by design), and the operations routes. A server error is a 5xx,
an error event or a missing end inside a 200 stream, a connection error or timeout the client did not cause. The
server's RSS and RssAnon are sampled every 10 s, with what the prefix cache's host tier holds (host memory kept on
purpose, up to its budget: RssAnon less it is what a leak would grow) and, on CUDA, its device memory as nvidia-smi
shows it. `--ftw`: serve that model instead (e.g. a full-size one on the GPU machine) with a 4,096-token KV budget, so
that the overflow requests still overflow. At the end /health must answer 200, no request may be left running, and
SIGINT must stop the server cleanly: status 130 (uvicorn re-raises the signal after its graceful shutdown, typer turns
the KeyboardInterrupt into 128 + SIGINT) or 0, "Application shutdown complete" and no traceback in its log. Writes
DIR/campaign_soak.json; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

FT = [sys.executable, "-c", "from ft.cli.main import main; main()"]
JSON = {"content-type": "application/json"}
WORDS = "the a model server token stream expert route cache prefix batch decode prefill queue window kernel".split()
# kind -> weight; the well-formed kinds dominate so the engine stays busy, the rest are mixed in throughout
KINDS = {"chat_stream": 24, "messages_stream": 20, "completion": 14, "drop_stream": 12, "cancel": 4,
         "invalid_json": 3, "wrong_type": 3, "unknown_model": 2, "extra_fields": 2, "lone_surrogate": 3,
         "oversized": 1, "context_overflow": 3, "ops": 5}
MALFORMED = {"invalid_json", "wrong_type", "unknown_model", "lone_surrogate", "oversized", "context_overflow"}
BUSY = {429, 529}  # queue full (OpenAI / Anthropic): an acceptable answer, counted apart


def text(rng: random.Random, lo: int = 3, hi: int = 120) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


async def chunks(data: bytes, size: int = 1 << 20) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):  # an async iterator: httpx sends it chunked, without a Content-Length
        yield data[i:i + size]


def rss_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, RssAnon) of `pid` in MiB. RSS also counts the FTW's mapped file pages a server touches (its expert
    banks, page-locked or read by the CPU), which grow as routing reaches more experts and are the page cache's, not
    a leak; RssAnon is the process's own memory, the part a leak grows."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    try:
        return int(fields["VmRSS"].split()[0]) / 1024, int(fields["RssAnon"].split()[0]) / 1024
    except KeyError as e:
        raise RuntimeError(f"no {e} in /proc/{pid}/status") from None


def vram_mib(pid: int) -> float | None:
    """Device memory of `pid` as nvidia-smi reports it (None without nvidia-smi or when it is not listed)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    used = [float(m) for p, m in (line.split(",") for line in out.splitlines() if "," in line) if int(p) == pid]
    return sum(used) if used else None


def wait_ready(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not become ready in {timeout:.0f} s")


class Soak:
    def __init__(self, url: str, seed: int, minutes: float):
        self.url, self.seed, self.end = url, seed, time.monotonic() + minutes * 60
        self.counts: dict[str, Counter] = defaultdict(Counter)  # kind -> status/outcome -> n
        self.errors: list[dict] = []  # the first server errors, in detail
        self.n_errors = 0
        self.oversized = b'{"prompt": "' + b"a" * (33 << 20) + b'"}'  # past the default 32 MiB --max-request-bytes

    def fail(self, kind: str, what: str, detail: str) -> None:
        self.counts[kind][what] += 1
        self.n_errors += 1
        if len(self.errors) < 50:
            self.errors.append({"kind": kind, "what": what, "detail": detail[:500],
                                "utc": time.strftime("%H:%M:%S", time.gmtime())})

    def answer(self, kind: str, status: int, body: str) -> None:
        """Count a complete (non-stream) answer: 5xx is a server error; malformed kinds must get a 4xx."""
        self.counts[kind][str(status)] += 1
        if status >= 500 and status not in BUSY:
            self.fail(kind, "server_error", f"{status} {body}")
        elif (not 400 <= status < 500 if kind in MALFORMED else status != 200) and status not in BUSY:
            self.counts[kind]["unexpected"] += 1  # not a crash (invalid input accepted, valid refused): to read

    async def post(self, c: httpx.AsyncClient, path: str, body: dict) -> httpx.Response:
        # json.dumps escapes non-ASCII (a lone surrogate included) as \\uXXXX; httpx's own encoder would refuse it
        return await c.post(self.url + path, content=json.dumps(body).encode(), headers=JSON)

    async def stream(self, c: httpx.AsyncClient, kind: str, path: str, body: dict, drop_after: int | None) -> None:
        """Read an SSE stream to its end marker, or close it after `drop_after` data lines (a client disconnect)."""
        end = "data: [DONE]" if path.endswith("completions") else "event: message_stop"
        async with c.stream("POST", self.url + path, content=json.dumps(body).encode(), headers=JSON) as r:
            if r.status_code != 200:
                return self.answer(kind, r.status_code, (await r.aread()).decode(errors="replace"))
            self.counts[kind]["200"] += 1
            seen, done = 0, False
            async for line in r.aiter_lines():
                if line.startswith("event: error") or line.startswith('data: {"error"'):
                    return self.fail(kind, "error_in_stream", line)  # the engine failed under a 200 stream
                done = done or line == end  # read on to the server's close (Anthropic's end event has data after)
                seen += line.startswith("data:")
                if drop_after is not None and seen >= drop_after and not done:
                    self.counts[kind]["dropped"] += 1
                    return  # leaving the `async with` closes the connection mid-stream
        if done:
            self.counts[kind]["completed"] += 1
        else:
            self.fail(kind, "truncated_stream", f"{path} ended without {end!r} after {seen} data lines")

    async def one(self, c: httpx.AsyncClient, rng: random.Random, kind: str) -> None:
        max_tokens = rng.randint(8, 64)
        chat = {"messages": [{"role": "system", "content": "You are terse."},  # a shared prefix for the prefix cache
                             {"role": "user", "content": text(rng)}], "max_tokens": max_tokens}
        anth = {"messages": [{"role": "user", "content": text(rng)}], "max_tokens": max_tokens}
        path, body = rng.choice([("/v1/chat/completions", chat), ("/v1/messages", anth)])  # for the kinds on both
        if kind in ("chat_stream", "messages_stream"):
            path, body = ("/v1/chat/completions", chat) if kind == "chat_stream" else ("/v1/messages", anth)
            return await self.stream(c, kind, path, {**body, "stream": True}, None)
        if kind == "drop_stream":  # a drop after one data line comes before any token (the stream's opening)
            return await self.stream(c, kind, path, {**body, "stream": True}, rng.randint(1, 12))
        if kind == "completion":
            r = await self.post(c, "/v1/completions", {"prompt": text(rng), "max_tokens": max_tokens})
            return self.answer(kind, r.status_code, r.text)
        if kind == "cancel":  # a non-streaming request whose client goes away while it is queued or decoding
            try:
                r = await asyncio.wait_for(self.post(c, "/v1/chat/completions", chat), rng.uniform(0.05, 2.0))
            except asyncio.TimeoutError:
                self.counts[kind]["cancelled"] += 1
                return
            return self.answer(kind, r.status_code, r.text)
        if kind == "ops":
            path = rng.choice(["/health", "/v1/models", "/v1/stats", "/metrics"])
            r = await c.get(self.url + path)
            return self.answer(kind, r.status_code, r.text)
        if kind == "invalid_json":
            raw = rng.choice([json.dumps(body)[:-rng.randint(1, 20)].encode(), b"", b"{]", b"\xff\xfe\x00garbage",
                              b'{"messages": [' * 2000])  # truncated, empty, not UTF-8, deeply nested
            r = await c.post(self.url + path, content=raw, headers=JSON)
        elif kind == "wrong_type":
            field, value = rng.choice([("max_tokens", "3"), ("max_tokens", 0), ("messages", "hi"), ("messages", []),
                                       ("stream", "yes"), ("temperature", "hot"), ("max_tokens", 3.5)])
            r = await self.post(c, path, {**body, field: value})
        elif kind == "unknown_model":
            r = await self.post(c, path, {**body, "model": "no-such-model"})
        elif kind == "extra_fields":  # unknown fields are accepted and ignored (schemas.py: SDKs add fields freely)
            r = await self.post(c, path, {**body, "x_unknown": {"a": [1, None]}, "logit_bias": {"5": 1}})
        elif kind == "lone_surrogate":
            r = await self.post(c, path, {**body, "messages": [{"role": "user", "content": "hi \ud800 there"}]})
        elif kind == "oversized":  # with a Content-Length (refused up front) or chunked (refused at the limit)
            raw = chunks(self.oversized) if rng.random() < 0.5 else self.oversized
            r = await c.post(self.url + "/v1/completions", content=raw, headers=JSON)
        else:  # context_overflow: 5,201 or 14,001 tokens (" ab" is one token) against the 4,096-token KV budget
            prompt = "ab " * rng.choice([5200, 14000])
            r = await (self.post(c, "/v1/completions", {"prompt": prompt, "max_tokens": 8}) if rng.random() < 0.5
                       else self.post(c, path, {**body, "messages": [{"role": "user", "content": prompt}]}))
        self.answer(kind, r.status_code, r.text)

    async def worker(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        kinds, weights = list(KINDS), list(KINDS.values())
        # one client per worker: a cancelled or dropped request cannot disturb another worker's connections
        timeout = httpx.Timeout(180.0, connect=10.0)
        async with httpx.AsyncClient(timeout=timeout) as c:
            while time.monotonic() < self.end:
                kind = rng.choices(kinds, weights)[0]
                self.counts[kind]["requests"] += 1
                try:
                    await self.one(c, rng, kind)
                except httpx.TimeoutException as e:
                    self.fail(kind, "timeout", repr(e))  # a hang: 180 s without a byte
                except httpx.TransportError as e:
                    self.fail(kind, "connection_error", repr(e))  # the server dropped a connection we kept


async def sample_rss(pid: int, stop: float, samples: list, vram: list | None, url: str) -> None:
    """Every 10 s: [s, RSS, RssAnon, the prefix cache's host tier] in MiB (the tier's bytes from /v1/stats: host
    memory the server keeps on purpose, up to its budget), and on CUDA the device memory."""
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as c:
        while True:
            samples.append([round(time.monotonic() - t0), *(round(m, 1) for m in rss_mib(pid)),
                            await tier_mib(c, url)])
            if vram is not None:
                vram.append([samples[-1][0], vram_mib(pid)])
            if time.monotonic() >= stop:
                return
            await asyncio.sleep(min(10.0, max(0.0, stop - time.monotonic())))


async def tier_mib(c: httpx.AsyncClient, url: str) -> float | None:
    try:
        tier = (await c.get(url + "/v1/stats")).json().get("prefix_cache") or {}
        return round(tier.get("host_bytes", 0) / 2**20, 1)
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=19193)
    ap.add_argument("--ftw", type=Path, help="serve this FTW (default: the tiny qwen3_moe, synthesized here)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vram-budget", default=None)
    ap.add_argument("--prefix-cache-host-memory", default=None,
                    help="the server's host tier of the prefix cache (default: its own; on the CPU none)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    with tempfile.TemporaryDirectory() as tmp, open(args.out / "serve.log", "w") as log:
        work = Path(tmp)
        ftw = args.ftw
        if ftw is None:
            ftw = work / "m.ftw"
            subprocess.run(FT + ["synth", "--arch", "qwen3_moe", "--preset", "tiny", "--out", str(work / "hf")],
                           check=True, capture_output=True)
            subprocess.run(FT + ["checkpoint", "--model", str(work / "hf"), "--out", str(ftw), "--no-progress"],
                           check=True, capture_output=True)
        serve = ["serve", "--ftw", str(ftw), "--port", str(args.port), "--device", args.device,
                 "--max-output-tokens", "64", "--max-running-requests", "4"]
        if args.ftw is not None:
            serve += ["--kv-reserve-tokens", "4096"]
        if args.vram_budget:
            serve += ["--vram-budget", args.vram_budget]
        if args.prefix_cache_host_memory:
            serve += ["--prefix-cache-host-memory", args.prefix_cache_host_memory]
        server = subprocess.Popen(FT + serve, stdout=log, stderr=subprocess.STDOUT)
        vram = [] if args.device.startswith("cuda") else None
        try:
            wait_ready(url, 600.0 if args.ftw is not None else 120.0)
            soak = Soak(url, args.seed, args.minutes)
            rss: list = []

            async def run() -> None:
                await asyncio.gather(sample_rss(server.pid, soak.end, rss, vram, url),
                                     *(soak.worker(i) for i in range(args.clients)))
            t = time.perf_counter()
            asyncio.run(run())
            seconds = time.perf_counter() - t
            time.sleep(2)  # let the engine retire aborted requests before the leak check
            health = httpx.get(url + "/health", timeout=10).status_code
            stats = httpx.get(url + "/v1/stats", timeout=10).json()
            tier = (stats.get("prefix_cache") or {}).get("host_bytes", 0) / 2**20
            rss.append([round(seconds), *(round(m, 1) for m in rss_mib(server.pid)), round(tier, 1)])  # at the end
        finally:
            server.send_signal(signal.SIGINT)  # a clean shutdown, as Ctrl-C; its exit status is checked
            try:
                exit_code = server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
                exit_code = f"hung on SIGINT (killed, {server.wait()})"
    served = (args.out / "serve.log").read_text(errors="replace")
    shutdown = {"exit_code": exit_code, "clean": "Application shutdown complete" in served,
                "tracebacks_in_log": served.count("Traceback")}
    warm = next((row for row in rss if row[0] >= 60), rss[-1])  # the first sample after a 60 s warm-up
    end = rss[-1]
    leftover = {"active": stats["requests"]["active"], "running": stats["scheduler"]["running"],
                "waiting": stats["scheduler"]["waiting"]}
    kinds = {k: dict(sorted(soak.counts[k].items())) for k in KINDS}
    total = sum(c["requests"] for c in soak.counts.values())
    busy = sum(n for c in soak.counts.values() for s, n in c.items() if s in ("429", "529"))
    ram_kib = int(Path("/proc/meminfo").read_text().split()[1])  # MemTotal, the first line
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
              "server": "ft " + " ".join(serve).replace(str(work), "TMP"),
              "machine": {"cores": os.cpu_count(), "ram_gib": round(ram_kib / 2**20, 1)},
              "minutes": args.minutes, "clients": args.clients, "seed": args.seed, "seconds": round(seconds, 1),
              "requests_total": total, "kinds": kinds, "server_errors": soak.n_errors, "errors": soak.errors,
              "busy_429_529": busy, "unexpected": sum(c["unexpected"] for c in soak.counts.values()),
              "rss_mib": {"first": rss[0][1], "after_warmup": warm[1], "end": end[1],
                          "drift": round(end[1] - warm[1], 1), "max": max(row[1] for row in rss),
                          "samples": rss},  # [s, RSS, RssAnon, prefix host tier]
              "anon_mib": {"after_warmup": warm[2], "end": end[2], "drift": round(end[2] - warm[2], 1),
                           "max": max(row[2] for row in rss)},
              # RssAnon less what the prefix cache's host tier holds on purpose (its budget bounds it): the drift a
              # leak would show
              "anon_less_tier_mib": None if warm[3] is None or end[3] is None else {
                  "after_warmup": round(warm[2] - warm[3], 1), "end": round(end[2] - end[3], 1),
                  "drift": round(end[2] - end[3] - warm[2] + warm[3], 1)},
              "vram_mib": None if vram is None else {"after_warmup": next((m for t_s, m in vram if t_s >= 60),
                                                                          vram[-1][1]),
                                                     "end": vram[-1][1], "max": max((m or 0) for _, m in vram),
                                                     "samples": vram},
              "final_health": health, "left_running": leftover, "server_stats": stats["requests"],
              # what the prefix cache holds at the end (its host tier and snapshots are host memory: on CUDA the
              # tier may take an eighth of MemAvailable), to set beside the RssAnon drift
              "prefix_cache": stats.get("prefix_cache"),
              "shutdown": shutdown}
    (args.out / "campaign_soak.json").write_text(json.dumps(result, indent=1) + "\n")
    for k, c in kinds.items():
        print(f"{k:17} {c.get('requests', 0):6}  {({s: n for s, n in c.items() if s != 'requests'})}")
    rss_summary = {k: v for k, v in result["rss_mib"].items() if k != "samples"}
    print({k: result[k] for k in ("requests_total", "server_errors", "busy_429_529", "unexpected", "final_health",
                                  "left_running", "shutdown")}, "RSS MiB", rss_summary,
          "RssAnon MiB", result["anon_mib"], "less the host tier", result["anon_less_tier_mib"],
          "prefix cache", result["prefix_cache"])
    ok = (soak.n_errors == 0 and health == 200 and not any(leftover.values()) and exit_code in (0, 130)
          and shutdown["clean"] and not shutdown["tracebacks_in_log"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
