"""`ft serve` (a real subprocess) and `ft ctl health|stats|cache` against live servers; /metrics text format."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from typer.testing import CliRunner

from ft.cli.main import app
from ft.formats import startup_files

runner = CliRunner()


def _ctl(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["ctl", *args])
    return result.exit_code, result.output


def test_ctl_health_stats_cache(server):
    code, out = _ctl("health", "--url", server.url)
    assert code == 0 and "ok" in out
    httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    code, out = _ctl("stats", "--url", server.url)
    assert code == 0 and "tiny-qwen3" in out and "tok/s" in out and "KV" in out and "time to first token" in out
    code, out = _ctl("stats", "--url", server.url, "--json")
    stats = json.loads(out)
    assert stats["requests"]["completed"] >= 1 and stats["kv"]["total_tokens"] == 8192
    assert stats["moe"] is None
    code, out = _ctl("cache", "--url", server.url)
    assert code == 0 and "no expert cache" in out and "prefix cache" in out and "entries" in out
    code, out = _ctl("cache", "--url", server.url, "--json")
    body = json.loads(out)
    assert code == 0 and body["moe"] is None and {"hits", "hit_tokens", "entries", "kv_tokens_held"} <= set(
        body["prefix_cache"])


def test_ctl_auth_and_unreachable(tight_server):
    code, out = _ctl("stats", "--url", tight_server.url)
    assert code == 1 and "--api-key" in out
    code, out = _ctl("stats", "--url", tight_server.url, "--api-key", "secret", "--json")
    assert code == 0 and json.loads(out)["model"] == "tiny-tight"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    code, out = _ctl("health", "--url", dead, "--timeout", "2")
    assert code == 1 and "cannot reach" in out


def test_prometheus_metrics(server):
    text = httpx.get(server.url + "/metrics").text
    assert "# TYPE ft_requests_completed_total counter" in text
    assert re.search(r'^ft_up\{model="tiny-qwen3"\} 1$', text, re.M)
    assert re.search(r"^ft_kv_total_tokens 8192$", text, re.M)
    assert re.search(r"^ft_preemptions_total 0$", text, re.M)
    for line in text.splitlines():  # every sample line: name{labels} value
        assert line.startswith("#") or re.fullmatch(r"ft_[a-z0-9_]+(\{[^}]*\})? -?[0-9.e+-]+", line), line


def test_serve_flag_validation():
    result = runner.invoke(app, ["serve", "--ftw", ".", "--memory-ratio", "0"])
    assert result.exit_code == 2 and "--memory-ratio must be in (0, 1]" in result.output
    result = runner.invoke(app, ["serve", "--ftw", "/no/such/dir"])
    assert result.exit_code == 2 and "no such directory, and not a Hugging Face repo id" in result.output
    help_text = runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}).output
    for flag in ("--kv-reserve-tokens", "--max-prefill-length", "--max-output-tokens", "--max-running-requests",
                 "--memory-ratio", "--served-model-name", "--api-key", "127.0.0.1", "1919"):
        assert flag in help_text


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ft_serve_subprocess(qwen3_ftw, tmp_path):
    """A real `ft serve`: ready, authenticated by FT_API_KEY, and once ready it records what its start read (the
    next start reads that first; the FTW's own files are not in it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-c", "from ft.cli.main import main; main()", "serve", "--ftw", str(qwen3_ftw),
           "--port", str(port), "--device", "cpu", "--served-model-name", "sub", "--log-level", "warning"]
    env = {**os.environ, "FT_API_KEY": "k", "FT_CACHE_DIR": str(tmp_path)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
            time.sleep(0.1)
        assert httpx.get(url + "/v1/models").status_code == 401  # FT_API_KEY is the default --api-key
        models = httpx.get(url + "/v1/models", headers={"x-api-key": "k"}).json()
        assert models["data"][0]["id"] == "sub"
        while not (lists := list((tmp_path / "startup").glob("*.json"))) and time.monotonic() < deadline:
            time.sleep(0.1)
        files = {p for p, _, _ in startup_files.load(lists[0])}
        assert any("torch" in p.parts for p in files) and not any(p.is_relative_to(qwen3_ftw) for p in files)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(15)


def test_server_imports_neither_the_compiler_nor_transformers():
    code = ("import sys, ft.runtime.server.app, ft.cli.serve_cmd, ft.cli.ctl_cmd; "
            "print([m for m in sys.modules if m.startswith(('ft.compiler', 'transformers'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_ft_serve_exits_when_the_model_cannot_load(tmp_path):
    """A supervisor sees the failure: status 1 and the reason, unless --keep-alive-on-error keeps /health at 500;
    a non-loopback --host without a key is warned about."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = [sys.executable, "-c", "from ft.cli.main import main; main()", "serve", "--ftw", str(tmp_path),
            "--port", str(port), "--device", "cpu", "--log-level", "error"]
    env = {k: v for k, v in os.environ.items() if k != "FT_API_KEY"}
    done = subprocess.run(base + ["--host", "0.0.0.0"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1, done.stderr
    assert "cannot be served" in done.stderr and "--keep-alive-on-error" in done.stderr
    assert "--host 0.0.0.0 without --api-key" in done.stderr
    proc = subprocess.Popen(base + ["--keep-alive-on-error"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health")
                if r.status_code == 500:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
            time.sleep(0.1)
        assert r.json()["status"] == "error" and proc.poll() is None
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(15)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_process_age_counts_from_the_launch():
    code = "import time; time.sleep(0.6); from ft.runtime.server.app import process_age_s; print(process_age_s())"
    t = time.monotonic()
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 0.6 <= age <= time.monotonic() - t + 0.05
