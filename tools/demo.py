"""The README demo, CPU only: synth the embedded demo model, compile it to FTW, serve it, ask it
one question through the unmodified `openai` client, print the answer and the server's stats, stop.

Usage: python tools/demo.py [--workdir DIR] [--port N]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _step(title: str) -> float:
    print(f"\n== {title}", flush=True)
    return time.perf_counter()


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"ft serve exited early with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"ft serve did not become ready within {timeout_s:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path(".cache/demo"))
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    from ft.compiler import compile_checkpoint
    from ft.compiler.synth import synth

    t_all = time.perf_counter()
    args.workdir.mkdir(parents=True, exist_ok=True)
    hf_dir, ftw_dir = args.workdir / "demo-hf", args.workdir / "demo.ftw"

    t = _step("1. ft synth --arch qwen3_5_moe --preset demo")
    if not (hf_dir / "config.json").exists():
        synth("qwen3_5_moe", "demo", hf_dir, force=True)
    print(f"   {hf_dir} ({sum(p.stat().st_size for p in hf_dir.iterdir()) / 2**20:.0f} MiB) "
          f"in {time.perf_counter() - t:.1f} s")

    t = _step("2. ft checkpoint")
    if not (ftw_dir / "model.ftw").exists():
        compile_checkpoint(hf_dir, ftw_dir, force=True)
    print(f"   {ftw_dir} in {time.perf_counter() - t:.1f} s")

    t = _step("3. ft serve")
    port = args.port or _free_port()
    url = f"http://127.0.0.1:{port}"
    ft_bin = Path(sys.executable).with_name("ft")
    proc = subprocess.Popen([str(ft_bin), "serve", "--ftw", str(ftw_dir), "--port", str(port),
                             "--served-model-name", "demo", "--kv-reserve-tokens", "4096"],
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        _wait_ready(url, proc)
        print(f"   ready at {url} in {time.perf_counter() - t:.1f} s")

        t = _step("4. POST /v1/chat/completions with the openai client")
        from openai import OpenAI

        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        reply = client.chat.completions.create(
            model="demo", max_tokens=32, temperature=0,
            messages=[{"role": "user", "content": "Name three uses of a mixture-of-experts model."}],
            # Qwen3.6 thinks by default; a random model never closes </think>, so ask for a plain answer.
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        msg = reply.choices[0].message
        print(f"   ({time.perf_counter() - t:.1f} s, finish_reason={reply.choices[0].finish_reason}, "
              f"usage={reply.usage.prompt_tokens}+{reply.usage.completion_tokens} tokens)")
        print("   The demo model has random weights, so its words are random too; the path is real.")
        reasoning = getattr(msg, "reasoning_content", None) or (msg.model_extra or {}).get("reasoning_content")
        if reasoning:
            print(f"   reasoning: {reasoning!r}")
        print(f"   answer:    {msg.content!r}")

        _step("5. GET /v1/stats")
        print(json.dumps(httpx.get(f"{url}/v1/stats", timeout=10).json(), indent=2))
    finally:
        _step("6. stop the server")
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(f"\ndemo finished in {time.perf_counter() - t_all:.1f} s")


if __name__ == "__main__":
    main()
